// POSIX file helpers for the commit protocol: every durable file is written to a
// temporary name, fsync'ed, renamed over its final name, and its directory fsync'ed.
// All functions block and throw Error(kWriteFailed) naming the path and errno text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace dnallm::checkpoint {

// Note [A failed save]: a file that cannot be written (disk full, a read-only or removed
// checkpoint.dir, a file size limit) fails the same way after a restart, so it is exit code 2
// (the launcher does not restart a worker that diagnosed its failure) with the cause and what
// to do, never exit 1 "internal error". Committed checkpoints before it stay valid: the
// failed step has no manifest, and its *.tmp files are removed.
inline constexpr ExitCode kWriteFailed = ExitCode::kUsage;

// Throws Error(kWriteFailed) naming `what` (a path) and errno's text when `expr` is -1.
#define DNALLM_WRITECHECK(expr, what)                                                      \
  do {                                                                                     \
    if ((expr) == -1) {                                                                    \
      const int dnallm_errno_ = errno;                                                     \
      throw ::dnallm::Error(                                                               \
          ::dnallm::checkpoint::kWriteFailed,                                              \
          ::fmt::format("cannot write {}: {} ({}): free disk space or make the directory " \
                        "writable, then run again (it resumes from the last committed "    \
                        "checkpoint) [{}:{}]",                                             \
                        (what), ::dnallm::errno_string(dnallm_errno_), #expr, __FILE__,    \
                        __LINE__));                                                        \
    }                                                                                      \
  } while (0)

// An open file written sequentially; closes (without fsync) on destruction.
class OutFile {
 public:
  explicit OutFile(const std::filesystem::path& path);  // O_CREAT | O_TRUNC | O_WRONLY
  ~OutFile();
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, size_t size);  // retries short writes and EINTR
  // `size` bytes at file offset `offset` (pwrite: the sequential position and written() do
  // not move); retries short writes and EINTR.
  void write_at(uint64_t offset, const void* data, size_t size);
  void sync();  // fsync
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
// `j` as JSON text (indented by 2, a final newline), written by write_file_durable: every
// config.json, tokenizer file and best.json we write.
void write_json_durable(const std::filesystem::path& path, const nlohmann::json& j);
void write_json_durable(const std::filesystem::path& path, const nlohmann::ordered_json& j);

// Reads a whole (small) file; throws Error(kCheckpointCorrupt) when missing.
std::string read_small_file(const std::filesystem::path& path);

}  // namespace dnallm::checkpoint
