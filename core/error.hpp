// Errors that reach a user, with the exit codes DESIGN.md documents.
//
// Every failure that ends a process is an `Error` carrying an ExitCode. Messages are one
// sentence: what was wrong, where (file:line, key, rank, host), and what to do.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace dnallm {

// Process exit codes (DESIGN.md "Exit codes"). Stable: scripts rely on them.
enum class ExitCode : int {
  kOk = 0,
  kFailure = 1,            // an internal error (a bug): should not happen
  kUsage = 2,              // bad command line or configuration
  kBadData = 3,            // bad input data
  kPeerFailed = 4,         // a peer rank or the coordinator failed
  kCheckpointCorrupt = 5,  // checkpoint corrupt and no fallback
  kRequeue = 75,           // preempted after a checkpoint: asks the scheduler to requeue
};

// Note [Worker diagnosis]: a worker that exits with 2 (usage), 3 (bad data) or 5 (checkpoint
// corrupt) diagnosed the failure itself; it fails the same way every time, so neither the
// launcher nor the coordinator restarts it, and the launcher exits with that code.
constexpr bool is_worker_diagnosis(int exit_code) {
  return exit_code == static_cast<int>(ExitCode::kUsage) ||
         exit_code == static_cast<int>(ExitCode::kBadData) ||
         exit_code == static_cast<int>(ExitCode::kCheckpointCorrupt);
}

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  ExitCode code() const noexcept { return code_; }
  int exit_code() const noexcept { return static_cast<int>(code_); }

 private:
  ExitCode code_;
};

// Thin helpers so call sites read as what they report.
template <typename... Args>
[[noreturn]] void fail(ExitCode code, fmt::format_string<Args...> fmt_str, Args&&... args) {
  throw Error(code, fmt::format(fmt_str, std::forward<Args>(args)...));
}

// The `errno` text for system-call failures, e.g. "No space left on device".
inline std::string errno_string(int err = errno) { return std::strerror(err); }

}  // namespace dnallm

// DNALLM_CHECK(cond, code, fmt, args...): throw an Error with file:line when cond is false.
#define DNALLM_CHECK(cond, code, ...)                                                          \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      throw ::dnallm::Error(                                                                   \
          (code), ::fmt::format(__VA_ARGS__) + ::fmt::format(" [{}:{}]", __FILE__, __LINE__)); \
    }                                                                                          \
  } while (0)

// DNALLM_SYSCHECK(expr, what): for POSIX calls returning -1 on error. Records the
// expression, file:line and strerror(errno). `what` names the object (a path, a socket).
#define DNALLM_SYSCHECK(expr, what)                                                  \
  do {                                                                               \
    if ((expr) == -1) {                                                              \
      int dnallm_errno_ = errno;                                                     \
      throw ::dnallm::Error(                                                         \
          ::dnallm::ExitCode::kFailure,                                              \
          ::fmt::format("{} failed for {}: {} [{}:{}]", #expr, (what),               \
                        ::dnallm::errno_string(dnallm_errno_), __FILE__, __LINE__)); \
    }                                                                                \
  } while (0)
