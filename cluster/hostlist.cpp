#include "cluster/hostlist.hpp"

#include <cctype>
#include <cstdint>

#include "core/error.hpp"

namespace dnallm::cluster {
namespace {

// One bracket's numbers, already rendered with their zero padding.
using Choices = std::vector<std::string>;

[[noreturn]] void malformed(const std::string& list, std::size_t pos, const char* what) {
  fail(ExitCode::kUsage, "malformed hostlist '{}' at character {}: {}", list, pos + 1, what);
}

bool is_digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

// Reads digits starting at `pos`; advances `pos` past them.
std::string read_digits(const std::string& list, std::size_t& pos) {
  std::size_t start = pos;
  while (pos < list.size() && is_digit(list[pos])) ++pos;
  if (pos == start) malformed(list, pos, "expected a number inside '[...]'");
  if (pos - start > 18) malformed(list, start, "number too long");
  return list.substr(start, pos - start);
}

// Parses "[lo-hi,n,...]" with list[pos] == '['; leaves pos after ']'.
Choices parse_bracket(const std::string& list, std::size_t& pos) {
  std::size_t open = pos++;
  Choices out;
  while (true) {
    if (pos >= list.size()) malformed(list, open, "'[' is never closed");
    std::size_t lo_pos = pos;
    std::string lo = read_digits(list, pos);
    std::string hi = lo;
    if (pos < list.size() && list[pos] == '-') {
      ++pos;
      hi = read_digits(list, pos);
    }
    uint64_t a = std::stoull(lo);
    uint64_t b = std::stoull(hi);
    if (a > b) malformed(list, lo_pos, "range start is greater than its end");
    if (b - a >= kMaxHostlistSize || out.size() + (b - a + 1) > kMaxHostlistSize) {
      malformed(list, lo_pos, "range expands to too many hosts");
    }
    // Slurm keeps the width of the lower bound: [01-10] -> 01..10, [1-10] -> 1..10.
    int width = static_cast<int>(lo.size());
    for (uint64_t v = a; v <= b; ++v) out.push_back(fmt::format("{:0{}}", v, width));
    if (pos >= list.size()) malformed(list, open, "'[' is never closed");
    char c = list[pos];
    if (c == ']') {
      ++pos;
      return out;
    }
    if (c != ',') malformed(list, pos, "expected ',', '-' or ']' inside '[...]'");
    ++pos;
  }
}

// Expands the item starting at pos (up to a top-level ',' or the end) into `out`.
void expand_item(const std::string& list, std::size_t& pos, std::vector<std::string>& out) {
  std::size_t start = pos;
  // Parts alternate text and bracket choices; text is stored as a single choice.
  std::vector<Choices> parts;
  std::string text;
  while (pos < list.size() && list[pos] != ',') {
    char c = list[pos];
    if (c == '[') {
      if (!text.empty()) parts.push_back({text});
      text.clear();
      parts.push_back(parse_bracket(list, pos));
    } else if (c == ']') {
      malformed(list, pos, "']' without a matching '['");
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      malformed(list, pos, "blank inside a host name");
    } else {
      text.push_back(c);
      ++pos;
    }
  }
  if (!text.empty()) parts.push_back({text});
  if (parts.empty()) malformed(list, start, "empty host name");

  std::size_t total = 1;
  for (const auto& p : parts) {
    total *= p.size();
    if (total + out.size() > kMaxHostlistSize) malformed(list, start, "expands to too many hosts");
  }
  // Odometer over the parts, rightmost fastest.
  std::vector<std::size_t> idx(parts.size(), 0);
  for (std::size_t n = 0; n < total; ++n) {
    std::string host;
    for (std::size_t i = 0; i < parts.size(); ++i) host += parts[i][idx[i]];
    out.push_back(std::move(host));
    for (std::size_t i = parts.size(); i-- > 0;) {
      if (++idx[i] < parts[i].size()) break;
      idx[i] = 0;
    }
  }
}

bool all_blank(const std::string& s) {
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list) {
  std::vector<std::string> out;
  if (all_blank(list)) return out;
  std::size_t pos = 0;
  while (true) {
    expand_item(list, pos, out);
    if (pos >= list.size()) break;
    ++pos;  // the ','
    if (pos >= list.size()) malformed(list, pos - 1, "trailing ','");
  }
  return out;
}

std::string compress_hostlist(const std::vector<std::string>& hosts) {
  struct Split {
    std::string prefix;
    std::string digits;  // trailing digits; empty when none
  };
  auto split = [](const std::string& h) {
    std::size_t i = h.size();
    while (i > 0 && is_digit(h[i - 1])) --i;
    // Names ending in a long digit run are not folded (they would not fit uint64).
    if (h.size() - i > 18) i = h.size();
    return Split{h.substr(0, i), h.substr(i)};
  };

  std::string out;
  std::size_t i = 0;
  while (i < hosts.size()) {
    Split first = split(hosts[i]);
    std::size_t j = i + 1;
    if (!first.digits.empty() && first.prefix.find_first_of("[],") == std::string::npos) {
      while (j < hosts.size()) {
        Split s = split(hosts[j]);
        if (s.digits.empty() || s.prefix != first.prefix ||
            s.digits.size() != first.digits.size()) {
          break;
        }
        ++j;
      }
    }
    if (!out.empty()) out += ',';
    if (j == i + 1) {
      out += hosts[i];
      i = j;
      continue;
    }
    // Fold hosts[i, j) into ranges of consecutive numbers.
    out += first.prefix + '[';
    std::size_t k = i;
    bool first_range = true;
    while (k < j) {
      std::string lo = split(hosts[k]).digits;
      uint64_t v = std::stoull(lo);
      std::size_t m = k + 1;
      std::string hi = lo;
      while (m < j) {
        std::string d = split(hosts[m]).digits;
        if (std::stoull(d) != v + (m - k)) break;
        hi = d;
        ++m;
      }
      if (!first_range) out += ',';
      first_range = false;
      out += lo;
      if (m > k + 1) out += '-' + hi;
      k = m;
    }
    out += ']';
    i = j;
  }
  return out;
}

}  // namespace dnallm::cluster
