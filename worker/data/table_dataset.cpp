#include "worker/data/table_dataset.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/output_file.hpp"
#include "worker/data/rng.hpp"
#include "worker/data/sequence_reader.hpp"

namespace dnallm::data {
namespace {

constexpr char kIndexMagic[8] = {'D', 'N', 'A', 'I', 'D', 'X', '0', '1'};
// Header: magic, file size, mtime ns, options key, records, skipped, 2 reserved: 64 bytes.
constexpr size_t kIndexHeader = 64;

uint64_t string_key(uint64_t h, const std::string& s) {
  for (char c : s) h = hash_combine(h, static_cast<uint8_t>(c));
  return hash_combine(h, s.size());
}

void pread_all(int fd, void* buf, size_t n, uint64_t offset, const std::string& what) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail(ExitCode::kBadData, "cannot read {}: {}", what, errno_string());
    }
    if (r == 0)
      fail(ExitCode::kBadData, "{} is shorter than its index says: it changed while in use", what);
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

// Reads the line starting at `offset` (without '\n' / "\r\n"). The last line may lack '\n'.
std::string read_line_at(int fd, uint64_t offset, const std::string& path) {
  std::string line;
  char buf[16384];
  for (;;) {
    ssize_t r = ::pread(fd, buf, sizeof buf, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail(ExitCode::kBadData, "cannot read {}: {}", path, errno_string());
    }
    if (r == 0) break;
    auto* nl = static_cast<char*>(std::memchr(buf, '\n', static_cast<size_t>(r)));
    if (nl != nullptr) {
      line.append(buf, nl);
      break;
    }
    line.append(buf, static_cast<size_t>(r));
    offset += static_cast<uint64_t>(r);
  }
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return line;
}

bool is_blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

// Compressed tables are refused: records are read by offset.
void check_uncompressed(const std::string& path) {
  std::string lower = path;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (lower.size() > 3 && lower.compare(lower.size() - 3, 3, ".gz") == 0) {
    fail(ExitCode::kUsage, "{}: compressed tables cannot be read lazily; decompress it (gunzip -k)",
         path);
  }
}

// What an index was built for: the format, the columns, the task and the bad-record policy.
uint64_t index_key(const TableOptions& options, cfg::DataFormat format) {
  uint64_t key = string_key(0xD1A, cfg::spelling(format));  // "csv", "tsv", "jsonl"
  key = string_key(key, options.sequence_column);
  key = string_key(key, options.label_column);
  key = string_key(key, cfg::spelling(options.task));  // as the index files name it
  key = hash_combine(key, static_cast<uint64_t>(options.num_labels));
  key = hash_combine(key, options.on_bad_record == BadRecordPolicy::kSkip ? 1 : 0);
  return key;
}

// Candidate index locations of `path`: cache_dir, beside the file, $TMPDIR/dnallm-index.
std::vector<std::string> index_candidates(const std::string& path, const std::string& cache_dir) {
  namespace fs = std::filesystem;
  std::string flat = fs::absolute(path).lexically_normal().string();
  std::replace(flat.begin(), flat.end(), '/', '_');
  std::vector<std::string> candidates;
  if (!cache_dir.empty()) candidates.push_back((fs::path(cache_dir) / (flat + ".dnaidx")).string());
  candidates.push_back(path + ".dnaidx");
  const char* tmp = std::getenv("TMPDIR");
  candidates.push_back(
      (fs::path(tmp != nullptr ? tmp : "/tmp") / "dnallm-index" / (flat + ".dnaidx")).string());
  return candidates;
}

// The first candidate a file can be created in (its folder made where missing), or "".
std::string first_writable(const std::vector<std::string>& candidates) {
  namespace fs = std::filesystem;
  for (const auto& c : candidates) {
    std::error_code ec;
    fs::create_directories(fs::path(c).parent_path(), ec);
    std::string probe = c + ".probe." + unique_temp_suffix();
    int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) continue;
    ::close(fd);
    ::unlink(probe.c_str());
    return c;
  }
  return "";
}

}  // namespace

std::vector<std::string> split_table_line(const std::string& line, char separator) {
  std::vector<std::string> fields;
  std::string field;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          field.push_back('"');
          ++i;
        } else {
          quoted = false;
        }
      } else {
        field.push_back(c);
      }
    } else if (c == '"' && separator == ',') {
      quoted = true;
    } else if (c == separator) {
      fields.push_back(std::move(field));
      field.clear();
    } else {
      field.push_back(c);
    }
  }
  fields.push_back(std::move(field));
  return fields;
}

TableDataset::TableDataset(const std::vector<std::string>& files, TableOptions options)
    : options_(std::move(options)) {
  if (files.empty()) fail(ExitCode::kUsage, "no table files given");
  for (const auto& f : files) open_file(f);
  if (total_records_ == 0) {
    fail(ExitCode::kBadData, "{}: no usable records ({} skipped)", files.front(), skipped_);
  }
}

TableDataset::~TableDataset() {
  for (auto& f : files_) {
    if (f.data_fd >= 0) ::close(f.data_fd);
    if (f.index_fd >= 0) ::close(f.index_fd);
  }
}

void TableDataset::open_file(const std::string& path) {
  File f;
  f.path = path;
  f.format =
      options_.format == cfg::DataFormat::kAuto ? format_from_extension(path) : options_.format;
  if (f.format != cfg::DataFormat::kCsv && f.format != cfg::DataFormat::kTsv &&
      f.format != cfg::DataFormat::kJsonl) {
    fail(ExitCode::kUsage,
         "{}: cannot read format \"{}\" as a table (csv, tsv, jsonl); set data.format", path,
         f.format == cfg::DataFormat::kAuto ? "" : cfg::spelling(f.format));
  }
  check_uncompressed(path);
  f.data_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.data_fd < 0) fail(ExitCode::kBadData, "cannot open table {}: {}", path, errno_string());
  struct stat st {};
  if (::fstat(f.data_fd, &st) != 0)
    fail(ExitCode::kBadData, "cannot stat {}: {}", path, errno_string());
  const auto file_size = static_cast<uint64_t>(st.st_size);
  const int64_t mtime_ns =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;

  if (f.format != cfg::DataFormat::kJsonl) read_header(f);

  const uint64_t key = index_key(options_, f.format);
  const auto candidates = index_candidates(path, options_.cache_dir);
  if (!reuse_index(f, candidates, file_size, mtime_ns, key)) {
    const std::string chosen = first_writable(candidates);
    if (chosen.empty()) {
      fail(ExitCode::kUsage,
           "{}: no writable place for its record index (tried {}); set data.cache_dir", path,
           candidates.front());
    }
    build_index(f, chosen, file_size, mtime_ns, key);
    f.index_fd = ::open(chosen.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.index_fd < 0)
      fail(ExitCode::kFailure, "cannot reopen index {}: {}", chosen, errno_string());
    index_paths_.push_back(chosen);
  }
  f.first_record = total_records_;
  total_records_ += f.records;
  files_.push_back(std::move(f));
}

// Csv/tsv: the header line and the sequence and label columns' positions in it.
void TableDataset::read_header(File& f) const {
  const std::string& path = f.path;
  f.header_line = read_line_at(f.data_fd, 0, path);
  if (f.header_line.rfind("\xEF\xBB\xBF", 0) == 0) f.header_line.erase(0, 3);  // UTF-8 BOM (Excel)
  auto cols = split_table_line(f.header_line, f.format == cfg::DataFormat::kCsv ? ',' : '\t');
  for (size_t i = 0; i < cols.size(); ++i) {
    if (cols[i] == options_.sequence_column) f.sequence_col = static_cast<int>(i);
    if (cols[i] == options_.label_column) f.label_col = static_cast<int>(i);
  }
  if (f.sequence_col < 0) {
    fail(ExitCode::kBadData,
         "{}:1: missing column \"{}\" in the header (found: {}); set data.sequence_column", path,
         options_.sequence_column, f.header_line.substr(0, 200));
  }
  if (options_.task != cfg::Task::kPretrain && f.label_col < 0) {
    fail(ExitCode::kBadData,
         "{}:1: missing label column \"{}\" in the header (found: {}); set data.label_column", path,
         options_.label_column, f.header_line.substr(0, 200));
  }
}

// Takes the first candidate that holds an index of this file as it is now (size, mtime and key
// alike); false where none does.
bool TableDataset::reuse_index(File& f, const std::vector<std::string>& candidates,
                               uint64_t file_size, int64_t mtime_ns, uint64_t key) {
  for (const auto& c : candidates) {
    int fd = ::open(c.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    char header[kIndexHeader];
    uint64_t words[7];
    bool fresh = ::pread(fd, header, kIndexHeader, 0) == static_cast<ssize_t>(kIndexHeader) &&
                 std::memcmp(header, kIndexMagic, 8) == 0;
    if (fresh) {
      std::memcpy(words, header + 8, sizeof words);
      struct stat ist {};
      fresh = words[0] == file_size && static_cast<int64_t>(words[1]) == mtime_ns &&
              words[2] == key && ::fstat(fd, &ist) == 0 &&
              static_cast<uint64_t>(ist.st_size) == kIndexHeader + 8 * words[3];
    }
    if (fresh) {
      f.index_fd = fd;
      f.records = words[3];
      skipped_ += static_cast<int64_t>(words[4]);
      index_paths_.push_back(c);
      return true;
    }
    ::close(fd);
  }
  return false;
}

void TableDataset::build_index(File& f, const std::string& index_path, uint64_t file_size,
                               int64_t mtime_ns, uint64_t key) {
  // Per-process name: ranks opening the same table at once each write their own, and the
  // last rename wins (the contents are identical).
  const std::string tmp = index_path + ".tmp." + unique_temp_suffix();
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (out == nullptr) fail(ExitCode::kFailure, "cannot write index {}: {}", tmp, errno_string());
  char header[kIndexHeader] = {};
  std::fwrite(header, 1, kIndexHeader, out);  // placeholder, rewritten at the end

  std::FILE* in = std::fopen(f.path.c_str(), "rb");
  if (in == nullptr) {
    std::fclose(out);
    fail(ExitCode::kBadData, "cannot open table {}: {}", f.path, errno_string());
  }
  std::vector<char> inbuf(1 << 20);
  std::setvbuf(in, inbuf.data(), _IOFBF, inbuf.size());
  char* raw = nullptr;
  size_t cap = 0;
  uint64_t offset = 0, line_no = 0, records = 0, skipped = 0, record_no = 0;
  std::string line;
  Sample sample;
  std::string why;
  ssize_t n;
  try {
    while ((n = ::getline(&raw, &cap, in)) > 0) {
      const uint64_t line_offset = offset;
      offset += static_cast<uint64_t>(n);
      ++line_no;
      if (line_no == 1 && f.format != cfg::DataFormat::kJsonl) continue;  // header
      line.assign(raw, static_cast<size_t>(n));
      while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
      if (is_blank(line)) continue;
      ++record_no;
      if (parse_record(f, line, sample, why)) {
        std::fwrite(&line_offset, sizeof line_offset, 1, out);
        ++records;
      } else if (options_.on_bad_record == BadRecordPolicy::kSkip) {
        ++skipped;
      } else {
        fail(ExitCode::kBadData, "{}:{}: record {}: {}", f.path, line_no, record_no, why);
      }
    }
  } catch (...) {
    free(raw);
    std::fclose(in);
    std::fclose(out);
    std::remove(tmp.c_str());
    throw;
  }
  free(raw);
  std::fclose(in);
  uint64_t words[7] = {file_size, static_cast<uint64_t>(mtime_ns), key, records, skipped, 0, 0};
  std::memcpy(header, kIndexMagic, 8);
  std::memcpy(header + 8, words, sizeof words);
  std::fseek(out, 0, SEEK_SET);
  std::fwrite(header, 1, kIndexHeader, out);
  if (std::fflush(out) != 0 || std::ferror(out)) {
    std::fclose(out);
    fail(ExitCode::kFailure, "cannot write index {}: {}", tmp, errno_string());
  }
  std::fclose(out);
  if (std::rename(tmp.c_str(), index_path.c_str()) != 0) {
    fail(ExitCode::kFailure, "cannot rename {} to {}: {}", tmp, index_path, errno_string());
  }
  f.records = records;
  skipped_ += static_cast<int64_t>(skipped);
  if (skipped > 0)
    spdlog::warn("{}: skipped {} bad records (data.on_bad_record = \"skip\")", f.path, skipped);
  spdlog::info("{}: indexed {} records into {}", f.path, records, index_path);
}

bool TableDataset::parse_record(const File& f, const std::string& line, Sample& out,
                                std::string& why) const {
  std::string seq, label;
  bool has_label = false;
  if (f.format == cfg::DataFormat::kJsonl) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      why = "not a JSON object";
      return false;
    }
    auto it = j.find(options_.sequence_column);
    if (it == j.end() || !it->is_string()) {
      why = fmt::format("missing string field \"{}\"", options_.sequence_column);
      return false;
    }
    seq = it->get<std::string>();
    auto lit = j.find(options_.label_column);
    if (lit != j.end() && !lit->is_null()) {
      has_label = true;
      label = lit->is_string() ? lit->get<std::string>() : lit->dump();
    }
  } else {
    auto fields = split_table_line(line, f.format == cfg::DataFormat::kCsv ? ',' : '\t');
    if (static_cast<int>(fields.size()) <= f.sequence_col) {
      why = fmt::format("missing column \"{}\" (the line has {} fields)", options_.sequence_column,
                        fields.size());
      return false;
    }
    seq = std::move(fields[f.sequence_col]);
    if (f.label_col >= 0 && static_cast<int>(fields.size()) > f.label_col) {
      has_label = true;
      label = std::move(fields[f.label_col]);
    }
  }
  out.bases.clear();
  size_t bad_at = normalise_bases(seq, out.bases);
  if (bad_at != std::string::npos) {
    why = fmt::format("invalid character {} at position {} of the sequence",
                      printable_char(seq[bad_at]), bad_at + 1);
    return false;
  }
  if (out.bases.empty()) {
    why = "empty sequence";
    return false;
  }
  out.label = -1;
  out.has_target = false;
  if (options_.task == cfg::Task::kPretrain) return true;
  if (!has_label || label.empty()) {
    why = fmt::format("missing label \"{}\"", options_.label_column);
    return false;
  }
  const char* begin = label.c_str();
  char* end = nullptr;
  errno = 0;
  if (options_.task == cfg::Task::kClassification) {
    long long v = std::strtoll(begin, &end, 10);
    if (end == begin || *end != '\0' || errno != 0 || v < 0 || v >= options_.num_labels) {
      why = fmt::format("bad label \"{}\": expected an integer class in [0, {})",
                        label.substr(0, 40), options_.num_labels);
      return false;
    }
    out.label = v;
  } else {
    double v = std::strtod(begin, &end);
    if (end == begin || *end != '\0' || errno != 0 || !std::isfinite(v)) {
      why = fmt::format("bad label \"{}\": expected a finite number", label.substr(0, 40));
      return false;
    }
    out.target = static_cast<float>(v);
    out.has_target = true;
  }
  return true;
}

Sample TableDataset::get(uint64_t index, SampleRng& rng) const {
  DNALLM_CHECK(index < total_records_, ExitCode::kFailure, "table index {} out of range {}", index,
               total_records_);
  auto it = std::upper_bound(files_.begin(), files_.end(), index,
                             [](uint64_t v, const File& f) { return v < f.first_record; });
  const File& f = *(it - 1);
  const uint64_t local = index - f.first_record;
  uint64_t offset = 0;
  pread_all(f.index_fd, &offset, sizeof offset, kIndexHeader + 8 * local, f.path + ".dnaidx");
  std::string line = read_line_at(f.data_fd, offset, f.path);
  Sample s;
  std::string why;
  if (!parse_record(f, line, s, why)) {
    fail(ExitCode::kBadData, "{}: record {} at byte {}: {} (the file changed after indexing?)",
         f.path, local + 1, offset, why);
  }
  if (options_.reverse_complement > 0 && rng.uniform01() < options_.reverse_complement) {
    s.bases = reverse_complement(s.bases);
  }
  return s;
}

std::string TableDataset::describe() const {
  return fmt::format("table {}{}: {} records ({} skipped)", files_.front().path,
                     files_.size() > 1 ? fmt::format(" (+{} files)", files_.size() - 1) : "",
                     total_records_, skipped_);
}

}  // namespace dnallm::data
