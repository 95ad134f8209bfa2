#include "worker/data/genome_regions.hpp"

#include <algorithm>
#include <charconv>
#include <string_view>

#include <htslib/bgzf.h>
#include <htslib/kstring.h>

#include "core/error.hpp"
#include "worker/data/compressed_stream.hpp"

namespace dnallm::data {
namespace {

// The next whitespace-separated field of `rest`, which it consumes; empty at the end.
std::string_view next_field(std::string_view& rest) {
  const size_t b = rest.find_first_not_of(" \t");
  if (b == std::string_view::npos) {
    rest = {};
    return {};
  }
  rest.remove_prefix(b);
  const size_t e = std::min(rest.find_first_of(" \t"), rest.size());
  std::string_view field = rest.substr(0, e);
  rest.remove_prefix(e);
  return field;
}

bool parse_position(std::string_view s, int64_t& out) {
  if (s.empty()) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size() && out >= 0;
}

std::string shown(std::string_view s) {
  if (s.empty()) return "nothing";
  return s.size() > 40 ? "'" + std::string(s.substr(0, 40)) + "...'" : "'" + std::string(s) + "'";
}

}  // namespace

GenomeRegions read_bed(const std::string& path) {
  BgzfLines f;
  f.fp = bgzf_open(path.c_str(), "r");
  if (f.fp == nullptr)
    fail(ExitCode::kBadData, "cannot open BED file {}: {}", path, errno_string());
  check_bgzf_complete(f.fp, path);
  GenomeRegions regions;
  regions.origin = path;
  int64_t line_no = 0;
  for (;;) {
    const int r = bgzf_getline(f.fp, '\n', &f.line);
    if (r == -1) break;
    if (r < -1) fail_damaged_stream(path, line_no, f.fp->errcode);
    ++line_no;
    std::string_view rest(f.line.s, f.line.l);
    if (!rest.empty() && rest.back() == '\r') rest.remove_suffix(1);
    const std::string_view name = next_field(rest);
    if (name.empty() || name.front() == '#' || name == "track" || name == "browser") continue;
    const std::string_view start_s = next_field(rest), end_s = next_field(rest);
    int64_t start = 0, end = 0;
    if (!parse_position(start_s, start) || !parse_position(end_s, end)) {
      fail(ExitCode::kBadData,
           "{}:{}: a BED line is `name start end` with 0-based integer positions; found start {} "
           "and end {}",
           path, line_no, shown(start_s), shown(end_s));
    }
    if (start >= end) {
      fail(ExitCode::kBadData,
           "{}:{}: interval {}:{}-{} is empty or reversed (BED is 0-based half-open: start < end)",
           path, line_no, name, start, end);
    }
    auto [it, added] = regions.intervals.try_emplace(std::string(name));
    if (added) regions.first_line[it->first] = line_no;
    it->second.push_back(Interval{start, end});
  }
  if (regions.intervals.empty())
    fail(ExitCode::kBadData, "{}: the BED file holds no interval", path);
  for (auto& [name, list] : regions.intervals) {
    std::sort(list.begin(), list.end(),
              [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
    std::vector<Interval> merged;
    for (const Interval& i : list) {
      if (!merged.empty() && i.begin <= merged.back().end) {
        merged.back().end = std::max(merged.back().end, i.end);
      } else {
        merged.push_back(i);
      }
    }
    list = std::move(merged);
  }
  return regions;
}

std::vector<Interval> intersect(const std::vector<Interval>& pieces,
                                const std::vector<Interval>& set) {
  std::vector<Interval> out;
  size_t j = 0;
  for (const Interval& p : pieces) {
    while (j < set.size() && set[j].end <= p.begin) ++j;
    for (size_t k = j; k < set.size() && set[k].begin < p.end; ++k) {
      out.push_back(Interval{std::max(p.begin, set[k].begin), std::min(p.end, set[k].end)});
    }
  }
  return out;
}

std::vector<Interval> subtract(const std::vector<Interval>& pieces,
                               const std::vector<Interval>& set) {
  std::vector<Interval> out;
  size_t j = 0;
  for (const Interval& p : pieces) {
    while (j < set.size() && set[j].end <= p.begin) ++j;
    int64_t at = p.begin;
    for (size_t k = j; k < set.size() && set[k].begin < p.end; ++k) {
      if (set[k].begin > at) out.push_back(Interval{at, set[k].begin});
      at = std::max(at, set[k].end);
    }
    if (at < p.end) out.push_back(Interval{at, p.end});
  }
  return out;
}

}  // namespace dnallm::data
