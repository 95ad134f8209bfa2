// POSIX file helpers for the commit protocol: every durable file is written to a
// temporary name, fsync'ed, renamed over its final name, and its directory fsync'ed.
// All functions block and throw Error(kFailure) naming the path and errno text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace dnallm::checkpoint {

// An open file written sequentially; closes (without fsync) on destruction.
class OutFile {
 public:
  explicit OutFile(const std::filesystem::path& path);  // O_CREAT | O_TRUNC | O_WRONLY
  ~OutFile();
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, size_t size);  // retries short writes and EINTR
  void sync();                                // fsync
  void close();
  uint64_t written() const { return written_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

void fsync_dir(const std::filesystem::path& dir);

// Writes `text` to `path` durably: <path>.tmp, fsync, rename, fsync parent directory.
void write_file_durable(const std::filesystem::path& path, const std::string& text);

// Reads a whole (small) file; throws Error(kCheckpointCorrupt) when missing.
std::string read_small_file(const std::filesystem::path& path);

}  // namespace dnallm::checkpoint
