#include "worker/data/store_packer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <string_view>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/genome_store_format.hpp"
#include "worker/data/sequence_stream.hpp"

namespace dnallm::data {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

[[noreturn]] void write_failed(const std::string& path, int err) {
  fail(ExitCode::kUsage,
       "cannot write genome store file {}: {}; free disk space or choose a writable output "
       "directory, then pack again",
       path, errno_string(err));
}

// A store file written sequentially: buffered, each kStoreChunkBytes chunk hashed as it fills.
class ChunkedWriter {
 public:
  explicit ChunkedWriter(std::string path) : path_(std::move(path)), state_(XXH3_createState()) {
    fd_ = ::open(path_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd_ < 0) write_failed(path_, errno);
    XXH3_64bits_reset(state_);
    buffer_.reserve(kBufferBytes);
  }
  ~ChunkedWriter() {
    if (fd_ >= 0) ::close(fd_);
    XXH3_freeState(state_);
  }
  ChunkedWriter(const ChunkedWriter&) = delete;
  ChunkedWriter& operator=(const ChunkedWriter&) = delete;

  void write(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const size_t take = std::min<size_t>(n, kStoreChunkBytes - in_chunk_);
      XXH3_64bits_update(state_, p, take);
      buffer_.insert(buffer_.end(), p, p + take);
      in_chunk_ += take;
      bytes_ += take;
      if (in_chunk_ == kStoreChunkBytes) end_chunk();
      if (buffer_.size() >= kBufferBytes) flush();
      p += take;
      n -= take;
    }
  }
  void put(uint8_t b) {
    if (in_chunk_ + 1 < kStoreChunkBytes && buffer_.size() + 1 < kBufferBytes) {
      XXH3_64bits_update(state_, &b, 1);
      buffer_.push_back(b);
      ++in_chunk_;
      ++bytes_;
    } else {
      write(&b, 1);
    }
  }
  // Flushes, fsyncs and closes; the last partial chunk gets its hash.
  void finish() {
    if (in_chunk_ > 0) end_chunk();
    flush();
    if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
      fd_ = -1;
      write_failed(path_, errno);
    }
    fd_ = -1;
  }
  uint64_t bytes() const { return bytes_; }
  const std::vector<uint64_t>& hashes() const { return hashes_; }
  const std::string& path() const { return path_; }

 private:
  static constexpr size_t kBufferBytes = size_t{1} << 20;
  void end_chunk() {
    hashes_.push_back(XXH3_64bits_digest(state_));
    XXH3_64bits_reset(state_);
    in_chunk_ = 0;
  }
  void flush() {
    size_t done = 0;
    while (done < buffer_.size()) {
      const ssize_t w = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) write_failed(path_, errno);
      done += static_cast<size_t>(w);
    }
    buffer_.clear();
  }

  std::string path_;
  int fd_ = -1;
  XXH3_state_t* state_;
  std::vector<uint8_t> buffer_;
  std::vector<uint64_t> hashes_;
  uint64_t in_chunk_ = 0;
  uint64_t bytes_ = 0;
};

// Per character: the 2-bit code (bits 0-1), N (bit 2), lower case (bit 3). The sink sees
// normalised bases only (ACGTN acgtn).
std::array<uint8_t, 256> make_codes() {
  std::array<uint8_t, 256> t{};
  const char* bases = "ACGT";
  for (uint8_t k = 0; k < 4; ++k) {
    t[static_cast<uint8_t>(bases[k])] = k;
    t[static_cast<uint8_t>(bases[k] - 'A' + 'a')] = k | 8;
  }
  t['N'] = 4;
  t['n'] = 4 | 8;
  return t;
}
const std::array<uint8_t, 256> kCodes = make_codes();

// The run of one kind of base (N, lower-case) being extended; written when it ends.
struct RunTracker {
  bool open = false;
  uint64_t start = 0;
  uint64_t bases = 0;  // in closed runs
  void step(bool in_run, uint64_t at, ChunkedWriter& out) {
    if (in_run && !open) {
      open = true;
      start = at;
    } else if (!in_run && open) {
      close(at, out);
    }
  }
  void close(uint64_t at, ChunkedWriter& out) {
    if (!open) return;
    const BaseRun r{start, at - start};
    out.write(&r, sizeof r);
    bases += r.length;
    open = false;
  }
};

// Writes the store's files from the streamed records.
class StoreBuilder final : public SequenceSink {
 public:
  explicit StoreBuilder(const fs::path& dir)
      : bases_((dir / kStoreBases).string()),
        n_runs_((dir / kStoreNRuns).string()),
        lower_runs_((dir / kStoreLowerRuns).string()),
        contigs_((dir / kStoreContigs).string()),
        names_((dir / kStoreNames).string()) {}

  void set_source(uint32_t source) { source_ = source; }
  uint64_t total() const { return total_; }
  uint64_t contigs() const { return contig_count_; }
  uint64_t n_bases() const { return n_.bases; }
  uint64_t lower_bases() const { return lower_.bases; }

  void begin_record(const std::string& name) override {
    contig_start_ = total_;
    name_offset_ = names_.bytes();
    name_length_ = static_cast<uint32_t>(name.size());
    names_.write(name.data(), name.size());
  }
  void bases(std::string_view s) override {
    for (const char c : s) {
      const uint8_t t = kCodes[static_cast<uint8_t>(c)];
      n_.step((t & 4) != 0, total_, n_runs_);
      lower_.step((t & 8) != 0, total_, lower_runs_);
      byte_ |= static_cast<uint8_t>((t & 3) << (2 * (total_ & 3)));
      if ((total_ & 3) == 3) {
        bases_.put(byte_);
        byte_ = 0;
      }
      ++total_;
    }
  }
  void end_record() override {
    n_.close(total_, n_runs_);
    lower_.close(total_, lower_runs_);
    const ContigEntry e{contig_start_, total_ - contig_start_, name_offset_, name_length_, source_};
    contigs_.write(&e, sizeof e);
    ++contig_count_;
  }

  // Finishes every file; `files` gets their manifest entries and `sums` their chunk hashes.
  void finish(nlohmann::ordered_json& files, std::vector<uint64_t>& sums) {
    if ((total_ & 3) != 0) bases_.put(byte_);
    for (ChunkedWriter* w : {&bases_, &n_runs_, &lower_runs_, &contigs_, &names_}) {
      w->finish();
      files.push_back({{"name", fs::path(w->path()).filename().string()},
                       {"bytes", w->bytes()},
                       {"first_chunk", sums.size()},
                       {"chunks", w->hashes().size()}});
      sums.insert(sums.end(), w->hashes().begin(), w->hashes().end());
    }
  }

 private:
  ChunkedWriter bases_, n_runs_, lower_runs_, contigs_, names_;
  RunTracker n_, lower_;
  uint64_t total_ = 0;
  uint8_t byte_ = 0;
  uint64_t contig_start_ = 0, name_offset_ = 0, contig_count_ = 0;
  uint32_t name_length_ = 0;
  uint32_t source_ = 0;
};

// Passes the bases on and logs a progress line every `every` seconds.
class ProgressSink final : public SequenceSink {
 public:
  ProgressSink(StoreBuilder& builder, double every) : builder_(builder), every_(every) {}
  void set_file(const std::string& file, size_t index, size_t count) {
    file_ = fmt::format("file {}/{} {}", index + 1, count, file);
  }
  void begin_record(const std::string& name) override { builder_.begin_record(name); }
  void bases(std::string_view s) override {
    builder_.bases(s);
    if (every_ <= 0) return;
    const auto now = Clock::now();
    if (std::chrono::duration<double>(now - last_).count() < every_) return;
    last_ = now;
    const double s_total = std::chrono::duration<double>(now - start_).count();
    spdlog::info("pack: {:.1f} Mbases, {} contigs, {:.1f} Mbases/s ({})",
                 static_cast<double>(builder_.total()) / 1e6, builder_.contigs(),
                 static_cast<double>(builder_.total()) / 1e6 / s_total, file_);
  }
  void end_record() override { builder_.end_record(); }

 private:
  StoreBuilder& builder_;
  double every_;
  std::string file_;
  Clock::time_point start_ = Clock::now(), last_ = Clock::now();
};

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) write_failed(p.string(), errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) write_failed(p.string(), err);
}

void write_small(const fs::path& p, const void* data, size_t n) {
  ChunkedWriter w(p.string());
  w.write(data, n);
  w.finish();
}

nlohmann::ordered_json source_entry(const std::string& file, const StreamedFile& streamed,
                                    uint64_t contigs) {
  const auto stamp = file_stamp(file);
  if (!stamp) fail(ExitCode::kBadData, "cannot read sequence file {}: {}", file, errno_string());
  return {{"path", fs::absolute(file).lexically_normal().string()},
          {"bytes", stamp->bytes},
          {"mtime_ns", stamp->mtime_ns},
          {"format", streamed.format},
          {"contigs", contigs},
          {"bases", streamed.bases}};
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Writes every file of the store into `dir` (which exists and is empty).
PackStats write_store(const fs::path& dir, const std::vector<std::string>& files,
                      const PackOptions& options) {
  const auto start = Clock::now();
  StoreBuilder builder(dir);
  ProgressSink sink(builder, options.progress_seconds);
  nlohmann::ordered_json sources = nlohmann::ordered_json::array();
  for (size_t i = 0; i < files.size(); ++i) {
    builder.set_source(static_cast<uint32_t>(i));
    sink.set_file(files[i], i, files.size());
    const uint64_t contigs_before = builder.contigs();
    const StreamedFile s = stream_sequences(files[i], options.format, sink, options.threads);
    sources.push_back(source_entry(files[i], s, builder.contigs() - contigs_before));
  }
  nlohmann::ordered_json entries = nlohmann::ordered_json::array();
  std::vector<uint64_t> sums;
  builder.finish(entries, sums);
  write_small(dir / kStoreChecksums, sums.data(), sums.size() * sizeof(uint64_t));
  PackStats stats;
  stats.bases = builder.total();
  stats.contigs = builder.contigs();
  stats.n_bases = builder.n_bases();
  stats.lower_bases = builder.lower_bases();
  stats.files = files.size();
  nlohmann::ordered_json m;
  m["format"] = kStoreFormatName;
  m["version"] = kStoreVersion;
  m["bases"] = stats.bases;
  m["contigs"] = stats.contigs;
  m["n_bases"] = stats.n_bases;
  m["lower_bases"] = stats.lower_bases;
  m["chunk_bytes"] = kStoreChunkBytes;
  m["files"] = std::move(entries);
  m["checksums_xxh3"] = fmt::format("{:016x}", XXH3_64bits(sums.data(), sums.size() * 8));
  m["sources"] = std::move(sources);
  m["packed_by"] = "dnallm-data pack " DNALLM_VERSION;
  m["packed_at"] = utc_now();
  const std::string text = m.dump(2) + "\n";
  write_small(dir / kStoreManifest, text.data(), text.size());
  fsync_path(dir);
  for (const auto& e : fs::directory_iterator(dir)) stats.store_bytes += fs::file_size(e.path());
  stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return stats;
}

}  // namespace

PackStats pack_genome_store(const std::string& out_dir, const std::vector<std::string>& files,
                            const PackOptions& options) {
  if (files.empty()) fail(ExitCode::kUsage, "no input files to pack into {}", out_dir);
  const fs::path out = fs::absolute(out_dir).lexically_normal();
  const fs::path target = out.filename().empty() ? out.parent_path() : out;
  std::error_code ec;
  if (fs::exists(target, ec)) {
    if (!options.replace || !is_genome_store(target.string())) {
      fail(ExitCode::kUsage,
           "{} exists; choose another output directory, remove it, or (if it is a genome store) "
           "pass --replace to replace it",
           target.string());
    }
  }
  const fs::path parent = target.parent_path();
  if (!fs::is_directory(parent, ec)) {
    fail(ExitCode::kUsage, "cannot pack into {}: its parent directory {} does not exist",
         target.string(), parent.string());
  }
  const std::string pid = std::to_string(::getpid());
  const fs::path tmp = parent / ("." + target.filename().string() + ".packing-" + pid);
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) write_failed(tmp.string(), ec.value());
  PackStats stats;
  try {
    stats = write_store(tmp, files, options);
    // A store being replaced is moved aside first: the name holds the old store or the new
    // one at every moment, never a part of either.
    const fs::path old = parent / ("." + target.filename().string() + ".replaced-" + pid);
    const bool replacing = fs::exists(target, ec);
    if (replacing && ::rename(target.c_str(), old.c_str()) != 0) write_failed(old.string(), errno);
    if (::rename(tmp.c_str(), target.c_str()) != 0) write_failed(target.string(), errno);
    if (replacing) fs::remove_all(old, ec);
    fsync_path(parent);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return stats;
}

}  // namespace dnallm::data
