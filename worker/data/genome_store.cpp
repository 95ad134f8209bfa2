#include "worker/data/genome_store.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::data {
namespace {

namespace fs = std::filesystem;

// The four bases of each 2-bit byte, in store order.
using Quad = std::array<char, 4>;
std::array<Quad, 256> make_quads() {
  std::array<Quad, 256> t{};
  for (int b = 0; b < 256; ++b)
    for (int k = 0; k < 4; ++k) t[b][k] = "ACGT"[(b >> (2 * k)) & 3];
  return t;
}
const std::array<Quad, 256> kQuads = make_quads();

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  fail(kStoreCorrupt,
       "genome store file {}: {}; the store is damaged or incomplete: pack it again "
       "(dnallm-data pack, docs/data.md), it is never used as it is",
       path, what);
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) corrupt(path, fmt::format("cannot be read ({})", errno_string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// Named, not anonymous: GenomeStore::Files holds it (a unity batch would warn otherwise).
namespace store_detail {

// One file of the store, mapped read-only; each chunk hashed the first time it is read.
class StoreFile {
 public:
  StoreFile(std::string path, uint64_t bytes, std::vector<uint64_t> hashes, bool random)
      : path_(std::move(path)), size_(bytes), hashes_(std::move(hashes)) {
    struct stat st {};
    if (::stat(path_.c_str(), &st) != 0)
      corrupt(path_, fmt::format("missing ({})", errno_string()));
    if (static_cast<uint64_t>(st.st_size) != size_) {
      corrupt(path_, fmt::format("is {} bytes but the manifest says {} (truncated or replaced)",
                                 st.st_size, size_));
    }
    verified_ = std::make_unique<std::atomic<uint64_t>[]>((hashes_.size() + 63) / 64);
    for (size_t i = 0; i < (hashes_.size() + 63) / 64; ++i) verified_[i] = 0;
    if (size_ == 0) return;
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) corrupt(path_, fmt::format("cannot be opened ({})", errno_string()));
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      fail(ExitCode::kBadData, "cannot memory-map genome store file {}: {}", path_,
           errno_string(err));
    }
    data_ = static_cast<const uint8_t*>(p);
    // Windows are read at random: no read-ahead beyond the pages a window touches.
    if (random) ::madvise(p, size_, MADV_RANDOM);
  }
  ~StoreFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  StoreFile(const StoreFile&) = delete;
  StoreFile& operator=(const StoreFile&) = delete;

  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  uint64_t chunks() const { return hashes_.size(); }

  // [offset, offset + len) of the file, its chunks verified; requires the range within it.
  const uint8_t* bytes(uint64_t offset, uint64_t len) const {
    if (len == 0) return data_ + offset;
    const uint64_t last = (offset + len - 1) / kStoreChunkBytes;
    for (uint64_t c = offset / kStoreChunkBytes; c <= last; ++c) {
      if ((verified_[c / 64].load(std::memory_order_acquire) >> (c % 64) & 1) == 0) verify(c);
    }
    return data_ + offset;
  }

  void verify(uint64_t c) const {
    const uint64_t begin = c * kStoreChunkBytes;
    const uint64_t n = std::min(kStoreChunkBytes, size_ - begin);
    if (XXH3_64bits(data_ + begin, n) != hashes_[c]) {
      corrupt(path_, fmt::format("bytes {}..{} do not match their checksum", begin, begin + n));
    }
    verified_[c / 64].fetch_or(uint64_t{1} << (c % 64), std::memory_order_acq_rel);
  }

 private:
  std::string path_;
  uint64_t size_ = 0;
  std::vector<uint64_t> hashes_;
  std::unique_ptr<std::atomic<uint64_t>[]> verified_;
  const uint8_t* data_ = nullptr;
};

}  // namespace store_detail

namespace {

using store_detail::StoreFile;

template <typename T>
T entry(const StoreFile& f, uint64_t i) {
  T t;
  std::memcpy(&t, f.bytes(i * sizeof(T), sizeof(T)), sizeof(T));
  return t;
}

// The first run of `f` ending after store coordinate `x` (runs are sorted and disjoint).
uint64_t first_run_after(const StoreFile& f, uint64_t x) {
  uint64_t lo = 0, hi = f.size() / sizeof(BaseRun);
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    const auto r = entry<BaseRun>(f, mid);
    if (r.start + r.length <= x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Calls fn(begin, end) for the part of every run of `f` within [lo, hi); stops when fn is false.
template <typename Fn>
void for_runs(const StoreFile& f, uint64_t lo, uint64_t hi, Fn&& fn) {
  const uint64_t n = f.size() / sizeof(BaseRun);
  for (uint64_t i = first_run_after(f, lo); i < n; ++i) {
    const auto r = entry<BaseRun>(f, i);
    if (r.start >= hi) break;
    if (!fn(std::max(r.start, lo), std::min(r.start + r.length, hi))) break;
  }
}

}  // namespace

std::optional<FileStamp> file_stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileStamp{static_cast<uint64_t>(st.st_size),
                   int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec};
}

bool is_genome_store(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / kStoreManifest, ec);
}

struct GenomeStore::Files {
  std::unique_ptr<StoreFile> bases, n_runs, lower_runs, contigs, names;
};

GenomeStore::GenomeStore(std::string dir)
    : dir_(std::move(dir)), files_(std::make_unique<Files>()) {}
GenomeStore::~GenomeStore() = default;

std::shared_ptr<const GenomeStore> GenomeStore::open(const std::string& dir) {
  if (!is_genome_store(dir)) {
    fail(ExitCode::kBadData,
         "{} is not a genome store (no {} in it): pack FASTA/FASTQ into one with dnallm-data pack "
         "{} FILES..., or list the files themselves",
         dir, kStoreManifest, dir);
  }
  std::shared_ptr<GenomeStore> store(new GenomeStore(dir));
  store->load_manifest();
  store->check_contigs();
  return store;
}

void GenomeStore::load_manifest() {
  const std::string path = (fs::path(dir_) / kStoreManifest).string();
  manifest_text_ = read_whole(path);
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(manifest_text_);
    if (m.value("format", std::string()) != kStoreFormatName)
      corrupt(path, "is not a store manifest");
    const int version = m.at("version").get<int>();
    if (version != kStoreVersion) {
      fail(ExitCode::kBadData,
           "{}: the genome store has format version {}, this build reads version {}; pack its "
           "sources again with this build's dnallm-data pack",
           path, version, kStoreVersion);
    }
    if (m.at("chunk_bytes").get<uint64_t>() != kStoreChunkBytes)
      corrupt(path, "names a chunk size this version does not write");
    total_bases_ = m.at("bases").get<uint64_t>();
    contigs_ = m.at("contigs").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    corrupt(path, fmt::format("is not a valid manifest ({})", e.what()));
  }
  // The chunk table, then each file against its entry.
  const std::string sums_path = (fs::path(dir_) / kStoreChecksums).string();
  const std::string sums = read_whole(sums_path);
  try {
    if (fmt::format("{:016x}", XXH3_64bits(sums.data(), sums.size())) !=
        m.at("checksums_xxh3").get<std::string>())
      corrupt(sums_path, "does not match the checksum in the manifest");
    auto open_file = [&](const char* name, bool random) {
      for (const auto& f : m.at("files")) {
        if (f.at("name").get<std::string>() != name) continue;
        const auto bytes = f.at("bytes").get<uint64_t>();
        const auto first = f.at("first_chunk").get<uint64_t>();
        const auto chunks = f.at("chunks").get<uint64_t>();
        if (chunks != (bytes + kStoreChunkBytes - 1) / kStoreChunkBytes ||
            (first + chunks) * 8 > sums.size())
          corrupt(path, fmt::format("has a chunk table entry for {} that does not fit", name));
        std::vector<uint64_t> hashes(chunks);
        if (chunks > 0) std::memcpy(hashes.data(), sums.data() + first * 8, chunks * 8);
        return std::make_unique<StoreFile>((fs::path(dir_) / name).string(), bytes,
                                           std::move(hashes), random);
      }
      corrupt(path, fmt::format("lists no file {}", name));
    };
    files_->bases = open_file(kStoreBases, true);
    files_->n_runs = open_file(kStoreNRuns, false);
    files_->lower_runs = open_file(kStoreLowerRuns, false);
    files_->contigs = open_file(kStoreContigs, false);
    files_->names = open_file(kStoreNames, false);
    for (const auto& s : m.at("sources")) {
      const auto src = s.at("path").get<std::string>();
      sources_.push_back(src);
      const auto now = file_stamp(src);
      if (!now) continue;  // moved away: the store stands alone
      if (!(*now == FileStamp{s.at("bytes").get<uint64_t>(), s.at("mtime_ns").get<int64_t>()})) {
        spdlog::warn(
            "genome store {}: its source {} changed since it was packed (size or time); the "
            "store still holds the old bases: pack it again to train on the new ones",
            dir_, src);
      }
    }
  } catch (const nlohmann::json::exception& e) {
    corrupt(path, fmt::format("is not a valid manifest ({})", e.what()));
  }
  const auto& f = *files_;
  if (f.bases->size() != (total_bases_ + 3) / 4)
    corrupt(f.bases->path(), fmt::format("does not hold {} bases", total_bases_));
  if (f.contigs->size() != contigs_ * sizeof(ContigEntry))
    corrupt(f.contigs->path(), fmt::format("does not hold {} contigs", contigs_));
  if (f.n_runs->size() % sizeof(BaseRun) != 0 || f.lower_runs->size() % sizeof(BaseRun) != 0)
    corrupt(f.n_runs->path(), "holds a partial run");
}

// Every contig follows the previous one and names bytes within names.bin, so no read of a valid
// record index leaves the mapped files.
void GenomeStore::check_contigs() const {
  uint64_t next = 0;
  for (uint64_t i = 0; i < contigs_; ++i) {
    const auto c = entry<ContigEntry>(*files_->contigs, i);
    if (c.offset != next || c.length == 0 ||
        c.name_offset + c.name_length > files_->names->size() || c.source >= sources_.size())
      corrupt(files_->contigs->path(), fmt::format("entry {} is inconsistent", i));
    next += c.length;
  }
  if (next != total_bases_)
    corrupt(files_->contigs->path(), fmt::format("covers {} bases, not {}", next, total_bases_));
}

size_t GenomeStore::record_count() const { return static_cast<size_t>(contigs_); }

int64_t GenomeStore::record_length(size_t record) const {
  return static_cast<int64_t>(entry<ContigEntry>(*files_->contigs, record).length);
}

size_t GenomeStore::record_file(size_t record) const {
  return entry<ContigEntry>(*files_->contigs, record).source;
}

std::string GenomeStore::record_name(size_t record) const {
  const auto c = entry<ContigEntry>(*files_->contigs, record);
  const auto* p = files_->names->bytes(c.name_offset, c.name_length);
  return std::string(reinterpret_cast<const char*>(p), c.name_length);
}

void GenomeStore::read(size_t record, int64_t pos, int64_t len, std::string& out) const {
  if (len <= 0) return;
  const auto c = entry<ContigEntry>(*files_->contigs, record);
  const uint64_t lo = c.offset + static_cast<uint64_t>(pos);
  const uint64_t hi = lo + static_cast<uint64_t>(len);
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(len));
  char* o = out.data() + at;
  const uint8_t* p = files_->bases->bytes(lo / 4, (hi - 1) / 4 - lo / 4 + 1) - lo / 4;
  uint64_t i = lo;
  for (; i < hi && (i & 3) != 0; ++i) *o++ = kQuads[p[i / 4]][i & 3];
  for (; i + 4 <= hi; i += 4, o += 4) std::memcpy(o, kQuads[p[i / 4]].data(), 4);
  for (; i < hi; ++i) *o++ = kQuads[p[i / 4]][i & 3];
  char* w = out.data() + at;
  for_runs(*files_->n_runs, lo, hi, [&](uint64_t b, uint64_t e) {
    std::memset(w + (b - lo), 'N', e - b);
    return true;
  });
}

void GenomeStore::read_keep_case(size_t record, int64_t pos, int64_t len, std::string& out) const {
  if (len <= 0) return;
  const size_t at = out.size();
  read(record, pos, len, out);
  const uint64_t lo = entry<ContigEntry>(*files_->contigs, record).offset + pos;
  char* w = out.data() + at;
  for_runs(*files_->lower_runs, lo, lo + static_cast<uint64_t>(len), [&](uint64_t b, uint64_t e) {
    for (uint64_t i = b; i < e; ++i) w[i - lo] = static_cast<char>(std::tolower(w[i - lo]));
    return true;
  });
}

int64_t GenomeStore::count_n(size_t record, int64_t pos, int64_t len, int64_t limit) const {
  if (len <= 0) return 0;
  const uint64_t lo = entry<ContigEntry>(*files_->contigs, record).offset + pos;
  int64_t n = 0;
  for_runs(*files_->n_runs, lo, lo + static_cast<uint64_t>(len), [&](uint64_t b, uint64_t e) {
    n += static_cast<int64_t>(e - b);
    return n <= limit;
  });
  return n;
}

void GenomeStore::verify_all(const std::function<void(uint64_t, uint64_t)>& progress) const {
  const StoreFile* all[] = {files_->bases.get(), files_->n_runs.get(), files_->lower_runs.get(),
                            files_->contigs.get(), files_->names.get()};
  uint64_t total = 0, done = 0;
  for (const auto* f : all) total += f->size();
  for (const auto* f : all) {
    for (uint64_t c = 0; c < f->chunks(); ++c) {
      f->verify(c);
      done += std::min(kStoreChunkBytes, f->size() - c * kStoreChunkBytes);
      if (progress && (c % 4096 == 4095 || done == total)) progress(done, total);
    }
  }
  if (progress) progress(done, total);
}

}  // namespace dnallm::data
