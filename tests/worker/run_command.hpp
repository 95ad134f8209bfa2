// Runs a shell command from a test and captures what it prints (the binaries under test are
// real processes). Shared by the end-to-end tests of tests/worker.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace dnallm::testing {

struct CommandResult {
  int code = -1;    // exit status, -1 when it did not exit normally
  std::string out;  // stdout, and stderr too with `with_stderr`
};

inline CommandResult run_command(const std::string& cmd, bool with_stderr) {
  CommandResult r;
  FILE* p = popen((cmd + (with_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace dnallm::testing
