#include "checkpoint/retention.hpp"

#include <algorithm>
#include <set>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/manifest.hpp"
#include "core/log.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;

std::vector<int64_t> steps_to_delete(std::vector<int64_t> committed, const RetentionPolicy& p,
                                     std::optional<int64_t> protected_step,
                                     std::optional<int64_t> latest_step) {
  std::vector<int64_t> out;
  if (p.keep_last <= 0 || committed.empty()) return out;
  std::sort(committed.begin(), committed.end());
  committed.erase(std::unique(committed.begin(), committed.end()), committed.end());
  const size_t n = committed.size();
  const size_t keep_from = n > static_cast<size_t>(p.keep_last) ? n - p.keep_last : 0;
  for (size_t i = 0; i < keep_from; ++i) {
    const int64_t s = committed[i];
    if (p.keep_every > 0 && s % p.keep_every == 0) continue;
    if (protected_step && s == *protected_step) continue;
    if (latest_step && s == *latest_step) continue;
    out.push_back(s);
  }
  return out;
}

bool remove_checkpoint(const fs::path& root, int64_t step) {
  const fs::path dir = root / step_dir_name(step);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  fs::remove(dir / kManifestName, ec);
  if (ec) {
    spdlog::warn("retention: cannot uncommit {}: {}", dir.string(), ec.message());
    return false;
  }
  fsync_dir(dir);
  fs::remove_all(dir, ec);
  if (ec) spdlog::warn("retention: cannot remove {}: {}", dir.string(), ec.message());
  fsync_dir(root);
  return true;
}

}  // namespace dnallm::checkpoint
