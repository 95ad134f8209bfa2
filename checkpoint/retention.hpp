// Which committed checkpoints to delete. The policy is a pure function, called only by the
// CommitRegistry (checkpoint/commit.hpp: the one place retention is decided); the action
// removes directories under a root.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

namespace dnallm::checkpoint {

struct RetentionPolicy {
  int keep_last = 0;       // keep the N newest committed checkpoints; <= 0 keeps all
  int64_t keep_every = 0;  // also keep steps divisible by K; <= 0 disables
};

// Steps of `committed` (any order) to delete. Never returns the newest step,
// `protected_step` (the one being loaded or written) or `latest_step` (LATEST's target).
std::vector<int64_t> steps_to_delete(std::vector<int64_t> committed, const RetentionPolicy& p,
                                     std::optional<int64_t> protected_step,
                                     std::optional<int64_t> latest_step);

// Deletes the checkpoint of `step` under `root` the crash-safe way (manifest first, directory
// fsync'ed, then the directory). Returns false (with a warning) when it cannot be uncommitted.
bool remove_checkpoint(const std::filesystem::path& root, int64_t step);

}  // namespace dnallm::checkpoint
