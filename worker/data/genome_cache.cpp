#include "worker/data/genome_cache.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/genome_store_format.hpp"
#include "worker/data/store_packer.hpp"

namespace dnallm::data {
namespace {

namespace fs = std::filesystem;

struct SourceStat {
  std::string path;  // absolute, as the manifest records it (store_packer.cpp)
  FileStamp stamp;
};

SourceStat stat_source(const std::string& file) {
  const auto stamp = file_stamp(file);
  if (!stamp) fail(ExitCode::kUsage, "{}: cannot read it: {}", file, errno_string());
  return {fs::absolute(file).lexically_normal().string(), *stamp};
}

bool compressed(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  unsigned char magic[2] = {0, 0};
  in.read(reinterpret_cast<char*>(magic), 2);
  return in.gcount() == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
}

// Whether `dir` is a store whose manifest lists exactly `sources`, as they are now.
bool fresh_store(const std::string& dir, const std::vector<SourceStat>& sources) {
  if (!is_genome_store(dir)) return false;
  std::ifstream in(fs::path(dir) / kStoreManifest);
  try {
    const auto m = nlohmann::json::parse(in);
    if (m.at("version").get<int>() != kStoreVersion) return false;
    const auto& listed = m.at("sources");
    if (listed.size() != sources.size()) return false;
    for (size_t i = 0; i < sources.size(); ++i) {
      const FileStamp then{listed[i].at("bytes").get<uint64_t>(),
                           listed[i].at("mtime_ns").get<int64_t>()};
      if (listed[i].at("path").get<std::string>() != sources[i].path || !(then == sources[i].stamp))
        return false;
    }
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;  // a damaged manifest: packed again
  }
}

// Note [Genome cache]: the candidate places, in order.
std::vector<std::string> candidates(const std::vector<SourceStat>& sources,
                                    const std::string& cache_dir) {
  const fs::path first(sources.front().path);
  std::string name = first.filename().string();
  if (sources.size() > 1) {
    std::string all;
    for (const auto& s : sources) all += s.path + '\n';
    name += fmt::format("+{}-{:08x}", sources.size() - 1,
                        static_cast<uint32_t>(XXH3_64bits(all.data(), all.size())));
  }
  name += ".dnallm-store";
  std::vector<std::string> out;
  if (!cache_dir.empty()) out.push_back((fs::path(cache_dir) / name).string());
  out.push_back((first.parent_path() / name).string());
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  if (xdg != nullptr && *xdg != '\0') {
    out.push_back((fs::path(xdg) / "dnallm-dist" / "genomes" / name).string());
  } else if (home != nullptr && *home != '\0') {
    out.push_back((fs::path(home) / ".cache" / "dnallm-dist" / "genomes" / name).string());
  }
  return out;
}

// Opens `<store>.lock` (its folder made where missing); -1 where that cannot be written.
int open_lock(const std::string& store) {
  std::error_code ec;
  fs::create_directories(fs::path(store).parent_path(), ec);
  return ::open((store + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
}

class LockFile {
 public:
  explicit LockFile(int fd) : fd_(fd) {}
  ~LockFile() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  LockFile(const LockFile&) = delete;
  LockFile& operator=(const LockFile&) = delete;

 private:
  int fd_;
};

}  // namespace

int64_t estimate_genome_bases(const std::vector<std::string>& files) {
  int64_t bases = 0;
  for (const auto& f : files) {
    std::error_code ec;
    const auto bytes = static_cast<int64_t>(fs::file_size(f, ec));
    if (ec) continue;  // the reader names it
    bases += compressed(f) ? 4 * bytes : bytes;
  }
  return bases;
}

std::string cached_genome_store(const std::vector<std::string>& files,
                                const GenomeCacheOptions& options) {
  if (options.threshold_bases <= 0 || files.empty()) return "";
  const int64_t estimate = estimate_genome_bases(files);
  if (estimate <= options.threshold_bases) return "";
  if (options.skip_bad_records) {
    spdlog::warn(
        "{}: about {:.2f} Gbases, read into memory by every rank, because data.on_bad_record = "
        "\"skip\" and packing refuses a bad record; pack them once (dnallm-data pack) or set "
        "on_bad_record = \"error\" to read them from a cached store",
        options.key, static_cast<double>(estimate) / 1e9);
    return "";
  }
  std::vector<SourceStat> sources;
  for (const auto& f : files) sources.push_back(stat_source(f));
  const auto places = candidates(sources, options.cache_dir);
  for (const auto& place : places) {
    if (fresh_store(place, sources)) {
      spdlog::info("{}: reading the genome store {}, packed from these {} file(s)", options.key,
                   place, sources.size());
      return place;
    }
  }
  for (const auto& place : places) {
    const int fd = open_lock(place);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      spdlog::info("{}: waiting for another process packing {}", options.key, place);
      if (::flock(fd, LOCK_EX) != 0) {
        ::close(fd);
        fail(ExitCode::kFailure, "cannot lock {}.lock: {}", place, errno_string());
      }
    }
    LockFile lock(fd);
    if (fresh_store(place, sources)) return place;  // packed while this one waited
    spdlog::info(
        "{}: about {:.2f} Gbases in {} file(s), over data.pack_threshold_bases = {}: packing "
        "them once into the genome store {} (later runs reuse it while the files are unchanged)",
        options.key, static_cast<double>(estimate) / 1e9, sources.size(), options.threshold_bases,
        place);
    std::vector<std::string> paths;
    for (const auto& s : sources) paths.push_back(s.path);
    PackOptions pack;
    pack.format = options.format;
    pack.replace = true;  // only ever a store (pack_genome_store refuses anything else)
    const PackStats stats = pack_genome_store(place, paths, pack);
    spdlog::info("{}: packed {} bases into {} in {:.1f} s ({:.0f} Mbases/s)", options.key,
                 stats.bases, place, stats.seconds, stats.mbases_per_s());
    return place;
  }
  fail(ExitCode::kUsage,
       "{}: about {:.2f} Gbases, over data.pack_threshold_bases = {}, but none of {} can be "
       "written to cache their genome store; set data.cache_dir to a writable folder, pack them "
       "(dnallm-data pack), or raise data.pack_threshold_bases",
       options.key, static_cast<double>(estimate) / 1e9, options.threshold_bases,
       fmt::format("{}", fmt::join(places, ", ")));
}

}  // namespace dnallm::data
