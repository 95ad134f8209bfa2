// Ownership of a checkpoint directory for a job's life, and the checks that make an
// unusable `[checkpoint] dir` fail at start (exit 2) instead of at the first save.
//
// Note [Checkpoint directory lock]: two jobs writing one directory would silently replace
// each other's committed steps. The committer (rank 0) takes an exclusive flock(2) on
// <dir>/.dnallm-lock before training and holds it until it exits. The file records the
// holder ("host pid started"), so a second job can name it. The kernel drops the lock
// when the holder dies (whatever the way), so a lock file left by a dead job is simply
// locked again and rewritten: a stale lock is taken over without guessing from pids.
// flock works across nodes on NFSv4 and Lustre/GPFS with flock enabled; where the file
// system does not support it (ENOLCK, EOPNOTSUPP) the job goes on with a warning.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dnallm::checkpoint {

inline constexpr const char* kLockName = ".dnallm-lock";

// Checks that `dir` can hold checkpoints, creating it (and its parents) if missing: not
// empty, not overlong (PATH_MAX, NAME_MAX per component), not an existing non-directory,
// and writable (a probe file is created and removed). Throws Error(kUsage) naming `key`
// (e.g. "checkpoint.dir"), the path and what to do.
void validate_checkpoint_dir(const std::filesystem::path& dir, const std::string& key);

// Holds the exclusive lock of a checkpoint directory (see the Note above). Not copyable;
// the lock is released when the object is destroyed or the process ends.
class DirLock {
 public:
  // Takes the lock without waiting. Throws Error(kUsage) when another live process holds
  // it, naming that holder's host and pid and what to do.
  static DirLock acquire(const std::filesystem::path& dir);

  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();

  const std::filesystem::path& path() const { return path_; }

 private:
  DirLock() = default;
  std::filesystem::path path_;
  int fd_ = -1;
};

// A run that starts at `start_step` (0: fresh) saves steps above it. Step directories
// newer than that would be written over in place, mixing old and new shards: committed ones
// are renamed to step_N.superseded-<unix time> (kept, no longer loaded), uncommitted ones
// removed, each logged. Call on the committer while holding the DirLock, before training.
// Returns the directories renamed.
std::vector<std::filesystem::path> set_aside_newer_steps(const std::filesystem::path& root,
                                                         int64_t start_step);

}  // namespace dnallm::checkpoint
