// Runs build/bin/dnallm-launch as a child process for the CLI tests: stdout and stderr
// captured into files, an optional action while it runs, and a hard time limit.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/process.hpp"

extern char** environ;

namespace dnallm::launcher::testing {

inline std::string launch_binary() { return dnallm::testing::kBin + "dnallm-launch"; }

inline std::string read_file(const std::string& path) { return dnallm::testing::read_text(path); }

inline std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

// A fresh directory under /tmp, removed (files one level deep) at destruction.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/dnallm-launch-test-XXXXXX";
    path_ = ::mkdtemp(tmpl) ? tmpl : "";
  }
  ~TempDir() {
    // The test scripts only write plain files directly in the directory.
    if (path_.empty()) return;
    pid_t pid = ::fork();
    if (pid == 0) {
      ::execl("/bin/rm", "rm", "-rf", path_.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    int status = 0;
    if (pid > 0) ::waitpid(pid, &status, 0);
  }
  const std::string& path() const { return path_; }
  bool exists(const std::string& name) const {
    struct stat st {};
    return ::stat((path_ + "/" + name).c_str(), &st) == 0;
  }

 private:
  std::string path_;
};

struct LaunchResult {
  int exit_code = -1;  // 128 + signal when the launcher itself died by a signal
  std::string out;
  std::string err;
};

// Starts dnallm-launch with `args` and `extra_env` (added to this process's environment),
// calls `while_running(pid)` once it started (if given), and waits up to `limit`.
inline LaunchResult run_launch(const std::vector<std::string>& args,
                               const std::vector<std::string>& extra_env = {},
                               std::function<void(pid_t)> while_running = nullptr,
                               std::chrono::seconds limit = std::chrono::seconds(15)) {
  TempDir dir;
  std::string out_path = dir.path() + "/stdout";
  std::string err_path = dir.path() + "/stderr";
  std::vector<std::string> argv_s = {launch_binary()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  pid_t pid = ::fork();
  if (pid == 0) {
    int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(out, 1);
    ::dup2(err, 2);
    // Hermetic: a test run inside a Slurm job or under torchrun/mpirun must not change the
    // layout the launcher sees.
    std::vector<std::string> drop;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string name(*e);
      name = name.substr(0, name.find('='));
      for (const char* prefix : {"SLURM_", "OMPI_", "MASTER_", "DNALLM_", "TORCHELASTIC_"}) {
        if (name.rfind(prefix, 0) == 0) drop.push_back(name);
      }
      if (name == "OMP_NUM_THREADS" || name == "CUDA_VISIBLE_DEVICES") drop.push_back(name);
    }
    for (const auto& name : drop) ::unsetenv(name.c_str());
    for (const auto& kv : extra_env) ::putenv(const_cast<char*>(kv.c_str()));
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  LaunchResult r;
  if (pid < 0) {
    ADD_FAILURE() << "fork failed";
    return r;
  }
  if (while_running) while_running(pid);
  auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (true) {
    pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "dnallm-launch did not exit within " << limit.count() << " s";
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(out_path);
  r.err = read_file(err_path);
  return r;
}

// Waits until every file in `names` exists in `dir` (bounded by `limit`).
inline bool wait_for_files(const TempDir& dir, const std::vector<std::string>& names,
                           std::chrono::seconds limit = std::chrono::seconds(10)) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    bool all = true;
    for (const auto& n : names) all = all && dir.exists(n);
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace dnallm::launcher::testing
