#include "worker/infer/fasta_index.hpp"

#include <htslib/bgzf.h>
#include <htslib/faidx.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.hpp"

namespace dnallm::infer {
namespace {

namespace fs = std::filesystem;

// The bytes of a FASTA at uncompressed offsets: a plain file directly, a bgzip one through its
// .gzi (a .gzi that does not fit makes the reads fail, and so the check).
class FastaBytes {
 public:
  FastaBytes(const std::string& path, bool bgzip) {
    if (bgzip) {
      z_ = bgzf_open(path.c_str(), "r");
      ok_ = z_ != nullptr && bgzf_index_load(z_, path.c_str(), ".gzi") == 0;
    } else {
      f_ = std::fopen(path.c_str(), "rb");
      ok_ = f_ != nullptr;
    }
  }
  ~FastaBytes() {
    if (z_ != nullptr) bgzf_close(z_);
    if (f_ != nullptr) std::fclose(f_);
  }
  FastaBytes(const FastaBytes&) = delete;
  FastaBytes& operator=(const FastaBytes&) = delete;
  bool ok() const { return ok_; }
  // Up to `n` bytes at `at`: fewer at the end of the file, none past it.
  std::string read(int64_t at, size_t n) {
    std::string out(n, '\0');
    int64_t got = -1;
    if (z_ != nullptr) {
      if (bgzf_useek(z_, static_cast<off_t>(at), SEEK_SET) == 0) got = bgzf_read(z_, out.data(), n);
    } else if (fseeko(f_, static_cast<off_t>(at), SEEK_SET) == 0) {
      got = static_cast<int64_t>(std::fread(out.data(), 1, n, f_));
    }
    out.resize(got > 0 ? static_cast<size_t>(got) : 0);
    return out;
  }

 private:
  BGZF* z_ = nullptr;
  FILE* f_ = nullptr;
  bool ok_ = false;
};

// One line of a .fai: NAME LENGTH OFFSET LINEBASES LINEWIDTH (a FASTQ index adds QUALOFFSET).
struct FaiEntry {
  std::string name;
  int64_t length = 0, offset = 0, line_bases = 0, line_width = 0;
};

bool line_end(char c) { return c == '\n' || c == '\r'; }

// Why `e` does not describe the record of `bytes` it names ("" when it does); `last`: the last
// record of the file, which nothing but blank lines may follow.
std::string entry_misfit(FastaBytes& bytes, const FaiEntry& e, bool last_record) {
  // The header line, ">NAME ...", ends just before the first base.
  const int64_t back = std::min<int64_t>(e.offset, 4096);
  const std::string head = bytes.read(e.offset - back, static_cast<size_t>(back));
  if (e.offset < 2 || static_cast<int64_t>(head.size()) != back || head.back() != '\n') {
    return fmt::format("record \"{}\" does not begin at byte {}", e.name, e.offset);
  }
  const size_t before = head.find_last_of('\n', head.size() - 2);
  if (before != std::string::npos || back == e.offset) {  // (else a header over 4 KiB)
    std::string header = head.substr(before == std::string::npos ? 0 : before + 1);
    while (!header.empty() && line_end(header.back())) header.pop_back();
    const std::string want = ">" + e.name;
    if (header.compare(0, want.size(), want) != 0 ||
        (header.size() > want.size() && header[want.size()] != ' ' &&
         header[want.size()] != '\t')) {
      return fmt::format("the header before byte {} is not \"{}\"", e.offset, want);
    }
  }
  if (e.length == 0) return "";
  // The first line holds line_bases bases, then a line end, when the record is longer.
  if (e.length > e.line_bases) {
    const std::string first = bytes.read(e.offset + e.line_bases - 1, 2);
    if (first.size() != 2 || line_end(first[0]) || !line_end(first[1])) {
      return fmt::format("record \"{}\" has no line of {} bases at byte {}", e.name, e.line_bases,
                         e.offset);
    }
  }
  // The last base, then a line end (or the end of the file), then the next record (or the end).
  const int64_t last = e.length - 1;
  const int64_t at = e.offset + last / e.line_bases * e.line_width + last % e.line_bases;
  const std::string tail = bytes.read(at, 4);
  size_t k = 1;
  while (k < tail.size() && k < 3 && line_end(tail[k])) ++k;
  const bool fits = !tail.empty() && !line_end(tail[0]) && tail[0] != '>' &&
                    (tail.size() == 1 || k > 1) &&
                    (k >= tail.size() || tail[k] == '>' || line_end(tail[k]));
  if (!fits) {
    return fmt::format("record \"{}\" does not end after {} bases (at byte {})", e.name, e.length,
                       at);
  }
  if (last_record && k < tail.size() && tail[k] == '>') {
    return fmt::format("the file goes on after \"{}\", the last record the index lists", e.name);
  }
  return "";
}

bool older(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  const auto ta = fs::last_write_time(a, ea);
  const auto tb = fs::last_write_time(b, eb);
  return !ea && !eb && ta < tb;
}

// BGZF compression of `path`: 0 plain, 1 gzip, 2 BGZF (-1: unreadable).
int compression_of(const std::string& path) {
  BGZF* z = bgzf_open(path.c_str(), "r");
  if (z == nullptr) return -1;
  const int c = bgzf_compression(z);
  bgzf_close(z);
  return c;
}

}  // namespace

std::string fasta_index_misfit(const std::string& fasta, const std::string& fai, bool bgzip) {
  FastaBytes bytes(fasta, bgzip);
  if (!bytes.ok()) return bgzip ? fasta + ".gzi cannot be read" : fasta + " cannot be read";
  std::ifstream in(fai);
  std::string line;
  std::vector<FaiEntry> entries;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    std::istringstream fields(line);
    FaiEntry e;
    fields >> e.name >> e.length >> e.offset >> e.line_bases >> e.line_width;
    if (fields.fail() || e.length < 0 || e.offset < 0 || e.line_bases < 1 ||
        e.line_width < e.line_bases || e.line_width > e.line_bases + 2) {
      return fmt::format("line {} is not a faidx entry (NAME LENGTH OFFSET LINEBASES LINEWIDTH)",
                         n);
    }
    entries.push_back(std::move(e));
  }
  if (entries.empty()) return bytes.read(0, 1).empty() ? "" : "it lists no record";
  const auto last =
      std::max_element(entries.begin(), entries.end(),
                       [](const FaiEntry& a, const FaiEntry& b) { return a.offset < b.offset; });
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    auto why = entry_misfit(bytes, *it, it == last);
    if (!why.empty()) return why;
  }
  return "";
}

void check_fasta_index(const std::string& fasta, const std::string& label) {
  const std::string fai = fasta + ".fai", gzi = fasta + ".gzi";
  std::error_code ec;
  const int compression = compression_of(fasta);
  // No index: faidx builds one. Plain gzip: faidx refuses it with what to run.
  if (!fs::exists(fai, ec) || compression < 0 || compression == 1) return;
  const bool bgzip = compression == 2;
  std::string why;
  if (older(fai, fasta)) {
    why = fmt::format("its index {} is older than the FASTA", fai);
  } else if (bgzip && !fs::exists(gzi, ec)) {
    why = fmt::format("its index {} has no {} beside it", fai, gzi);
  } else if (bgzip && older(gzi, fasta)) {
    why = fmt::format("its index {} is older than the FASTA", gzi);
  } else {
    const auto misfit = fasta_index_misfit(fasta, fai, bgzip);
    if (misfit.empty()) return;
    // (Through a .gzi of another file the reads land elsewhere: either index may be the culprit.)
    why = bgzip ? fmt::format("its index {} read through {} does not fit the file ({})", fai, gzi,
                              misfit)
                : fmt::format("its index {} does not fit the file ({})", fai, misfit);
  }
  // Rebuilt beside the old one and renamed over it: a reader never sees half an index.
  const std::string tag = fmt::format(".tmp{}", ::getpid());
  const std::string new_fai = fai + tag, new_gzi = gzi + tag;
  std::string failed;
  if (fai_build3(fasta.c_str(), new_fai.c_str(), bgzip ? new_gzi.c_str() : nullptr) != 0) {
    failed =
        "faidx cannot rebuild it (its folder is not writable, or the FASTA's lines differ "
        "in length within a record)";
  } else if (bgzip && std::rename(new_gzi.c_str(), gzi.c_str()) != 0) {
    failed = fmt::format("{} cannot be replaced ({})", gzi, std::strerror(errno));
  } else if (std::rename(new_fai.c_str(), fai.c_str()) != 0) {
    failed = fmt::format("{} cannot be replaced ({})", fai, std::strerror(errno));
  }
  if (failed.empty()) {
    spdlog::warn("{}: {}: rebuilt it", label, why);
    return;
  }
  std::remove(new_fai.c_str());
  std::remove(new_gzi.c_str());
  fail(ExitCode::kBadData,
       "{}: {}, and {}: rebuild it with `samtools faidx {}`, or delete {}{} so that it is built "
       "on first use",
       label, why, failed, fasta, fai, bgzip ? " and " + gzi : std::string());
}

}  // namespace dnallm::infer
