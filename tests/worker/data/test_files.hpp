// Helpers for data tests: a temporary directory and writers for plain, gzip and BGZF files.
#pragma once

#include <unistd.h>
#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include <htslib/bgzf.h>

namespace dnallm::data::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dnallm-data-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

inline void write_gzip(const std::string& path, const std::string& text) {
  gzFile f = gzopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("gzopen failed");
  gzwrite(f, text.data(), static_cast<unsigned>(text.size()));
  gzclose(f);
}

inline void write_bgzf(const std::string& path, const std::string& text) {
  BGZF* f = bgzf_open(path.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("bgzf_open failed");
  if (bgzf_write(f, text.data(), text.size()) < 0) throw std::runtime_error("bgzf_write failed");
  bgzf_close(f);
}

// Deterministic pseudo-random bases.
inline std::string random_bases(size_t n, uint64_t seed) {
  std::string s(n, 'A');
  uint64_t x = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (auto& c : s) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    c = "ACGT"[(x >> 33) & 3];
  }
  return s;
}

}  // namespace dnallm::data::testing
