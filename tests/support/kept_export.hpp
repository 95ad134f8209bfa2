// Where a test writes an export that a check outside it reads too (tests/hf's scripts load our
// HyenaDNA and Caduceus exports with the families' own code).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace dnallm::testing {

// A fresh (emptied) folder for export `name`: $<keep_env>/<name> when that variable is set,
// where the export stays for the outside check; else <system temp>/dnallm_<prefix>_<name><pid>,
// removed with this object.
class KeptExport {
 public:
  KeptExport(const char* keep_env, const std::string& prefix, const std::string& name) {
    const char* keep = std::getenv(keep_env);
    kept_ = keep != nullptr && *keep != '\0';
    path_ = kept_ ? std::string(keep) + "/" + name
                  : (std::filesystem::temp_directory_path() /
                     ("dnallm_" + prefix + "_" + name + std::to_string(::getpid())))
                        .string();
    std::filesystem::remove_all(path_);
  }
  ~KeptExport() {
    std::error_code ec;
    if (!kept_) std::filesystem::remove_all(path_, ec);
  }
  KeptExport(const KeptExport&) = delete;
  KeptExport& operator=(const KeptExport&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool kept_ = false;
};

}  // namespace dnallm::testing
