#include "checkpoint/durable_io.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace dnallm::checkpoint {

OutFile::OutFile(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  DNALLM_WRITECHECK(fd_, path.string());
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutFile::write(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = n < 0 ? errno : ENOSPC;
      fail(kWriteFailed,
           "writing {} failed after {} bytes: {}: free disk space or make the directory "
           "writable, then run again (it resumes from the last committed checkpoint)",
           path_.string(), written_, errno_string(err));
    }
    p += n;
    size -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
}

void OutFile::write_at(uint64_t offset, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::pwrite(fd_, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = n < 0 ? errno : ENOSPC;
      fail(kWriteFailed,
           "writing {} at byte {} failed: {}: free disk space or make the directory "
           "writable, then run again (it resumes from the last committed checkpoint)",
           path_.string(), offset, errno_string(err));
    }
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void OutFile::sync() { DNALLM_WRITECHECK(::fsync(fd_), path_.string()); }

void OutFile::close() {
  int fd = fd_;
  fd_ = -1;
  DNALLM_WRITECHECK(::close(fd), path_.string());
}

void fsync_dir(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DNALLM_WRITECHECK(fd, dir.string());
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  errno = err;
  DNALLM_WRITECHECK(rc, dir.string());
}

void write_file_durable(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  try {
    OutFile f(tmp);
    f.write(text.data(), text.size());
    f.sync();
    f.close();
    DNALLM_WRITECHECK(::rename(tmp.c_str(), path.c_str()), path.string());
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);  // a failed save leaves no *.tmp behind
    throw;
  }
  fsync_dir(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

void write_json_durable(const std::filesystem::path& path, const nlohmann::json& j) {
  write_file_durable(path, j.dump(2) + "\n");
}

void write_json_durable(const std::filesystem::path& path, const nlohmann::ordered_json& j) {
  write_file_durable(path, j.dump(2) + "\n");
}

std::string read_small_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ExitCode::kCheckpointCorrupt, "cannot read {}: {}", path.string(), errno_string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace dnallm::checkpoint
