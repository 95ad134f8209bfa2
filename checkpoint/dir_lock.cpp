#include "checkpoint/dir_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>
#include <string>

#include <fmt/format.h>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/manifest.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;

namespace {

std::string host_name() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// The holder line of a lock file ("host H pid P since T"), or "" if unreadable.
std::string read_holder(int fd) {
  char buf[512] = {0};
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "";
  std::string s(buf, static_cast<size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

void validate_checkpoint_dir(const fs::path& dir, const std::string& key) {
  const std::string text = dir.string();
  if (text.empty())
    fail(ExitCode::kUsage, "{} is empty: name the directory that holds the checkpoints", key);
  if (text.size() >= PATH_MAX)
    fail(ExitCode::kUsage, "{} is {} characters long (the limit is {}): choose a shorter path", key,
         text.size(), PATH_MAX - 1);
  for (const auto& part : dir) {
    if (part.string().size() > NAME_MAX)
      fail(ExitCode::kUsage,
           "{} = \"{}...\": the component \"{}...\" is {} characters long (the limit is {}): "
           "choose a shorter name",
           key, text.substr(0, 60), part.string().substr(0, 40), part.string().size(), NAME_MAX);
  }
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    fail(ExitCode::kUsage, "{} = \"{}\" exists and is not a directory: name a directory", key,
         text);
  fs::create_directories(dir, ec);
  if (ec)
    fail(ExitCode::kUsage, "{} = \"{}\": cannot create the directory: {}; choose a writable path",
         key, text, ec.message());
  // access(W_OK) is not enough (read-only mounts, ACLs, root): create a file for real.
  const fs::path probe = dir / fmt::format(".dnallm-write-probe-{}", ::getpid());
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    fail(ExitCode::kUsage, "{} = \"{}\" is not writable: {}; choose a writable directory", key,
         text, errno_string(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

DirLock DirLock::acquire(const fs::path& dir) {
  DirLock lock;
  lock.path_ = dir / kLockName;
  lock.fd_ = ::open(lock.path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock.fd_ < 0)
    fail(ExitCode::kUsage,
         "cannot open the checkpoint directory lock {}: {}; choose a writable "
         "checkpoint.dir",
         lock.path_.string(), errno_string(errno));
  if (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      std::string holder = read_holder(lock.fd_);
      ::close(lock.fd_);  // not ours: the destructor must not touch the holder's line
      lock.fd_ = -1;
      fail(ExitCode::kUsage,
           "checkpoint.dir {} is in use by another job ({}): two jobs on one directory would "
           "replace each other's checkpoints; give this job another checkpoint.dir, or stop "
           "the other job",
           dir.string(), holder.empty() ? std::string("holder unknown") : holder);
    }
    spdlog::warn(
        "cannot lock {} ({}): the file system does not support flock, so nothing "
        "stops a second job from writing the same checkpoint.dir",
        lock.path_.string(), errno_string(err));
    ::close(lock.fd_);
    lock.fd_ = -1;
    return lock;
  }
  const std::string previous = read_holder(lock.fd_);
  if (!previous.empty())
    spdlog::info(
        "took over the checkpoint directory lock {} from a job that is no longer "
        "running ({})",
        lock.path_.string(), previous);
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char since[32] = {0};
  std::strftime(since, sizeof(since), "%Y-%m-%dT%H:%M:%SZ", &utc);
  const std::string line = fmt::format("host {} pid {} since {}\n", host_name(), ::getpid(), since);
  if (::ftruncate(lock.fd_, 0) != 0 ||
      ::pwrite(lock.fd_, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size()))
    spdlog::warn("cannot record this job in {}: {}", lock.path_.string(), errno_string(errno));
  return lock;
}

std::vector<fs::path> set_aside_newer_steps(const fs::path& root, int64_t start_step) {
  std::vector<fs::path> moved;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return moved;
  std::vector<std::pair<int64_t, fs::path>> newer;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const auto step = parse_step_dir_name(entry.path().filename().string());
    if (step && *step > start_step && entry.is_directory(ec))
      newer.emplace_back(*step, entry.path());
  }
  const auto now = std::time(nullptr);
  for (const auto& [step, dir] : newer) {
    if (!fs::exists(dir / kManifestName, ec)) {
      fs::remove_all(dir, ec);
      spdlog::info(
          "removed the uncommitted checkpoint directory {} (newer than step {}, where "
          "this run starts)",
          dir.string(), start_step);
      continue;
    }
    fs::path aside = dir;
    aside += fmt::format(".superseded-{}", now);
    fs::rename(dir, aside, ec);
    if (ec)
      fail(ExitCode::kUsage,
           "{} is newer than step {}, where this run starts, and cannot be moved aside ({}); "
           "move it away yourself or resume from it",
           dir.string(), start_step, ec.message());
    spdlog::warn(
        "{} is newer than step {}, where this run starts: moved aside to {} so that "
        "this run's saves do not overwrite it",
        dir.string(), start_step, aside.string());
    moved.push_back(aside);
  }
  if (!moved.empty()) {
    // LATEST may name a step just moved: point it at the newest committed step left.
    const auto left = list_committed(root);
    if (left.empty()) {
      fs::remove(root / kLatestName, ec);
    } else {
      write_file_durable(root / kLatestName, left.back().second.filename().string() + "\n");
    }
  }
  return moved;
}

DirLock::DirLock(DirLock&& other) noexcept : path_(std::move(other.path_)), fd_(other.fd_) {
  other.fd_ = -1;
}

DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

DirLock::~DirLock() {
  if (fd_ < 0) return;
  // Empty the holder line first, so a later job does not report a takeover of a lock that
  // was released cleanly.
  [[maybe_unused]] const int ignored = ::ftruncate(fd_, 0);
  ::close(fd_);  // releases the flock
}

}  // namespace dnallm::checkpoint
