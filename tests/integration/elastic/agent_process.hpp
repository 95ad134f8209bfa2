// A dnallm-launch agent started in the background for the elastic integration tests:
// stdout and stderr go to files, wait() has a deadline, and the destructor SIGKILLs a
// still-running agent (its workers follow through PR_SET_PDEATHSIG).
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace dnallm::elastic_testing {

inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline bool file_exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// Waits until `path` exists; false after `limit`.
inline bool wait_for_file(const std::string& path, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!file_exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// A port nobody listens on right now (bind 127.0.0.1:0, read it, close).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t n = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return ntohs(a.sin_port);
}

class AgentProcess {
 public:
  // Starts `argv` (argv[0] a path) with this process's environment plus `extra_env`;
  // output goes to `log_prefix`.out / .err.
  AgentProcess(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
               const std::string& log_prefix)
      : out_(log_prefix + ".out"), err_(log_prefix + ".err") {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    for (const auto& kv : extra_env) env.push_back(kv);
    pid_ = ::fork();
    if (pid_ == 0) {
      int o = ::open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int e = ::open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(o, 1);
      ::dup2(e, 2);
      std::vector<char*> a, v;
      for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
      for (const auto& s : env) v.push_back(const_cast<char*>(s.c_str()));
      a.push_back(nullptr);
      v.push_back(nullptr);
      ::execve(a[0], a.data(), v.data());
      ::_exit(127);
    }
  }
  ~AgentProcess() {
    if (pid_ > 0 && code_ < 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  AgentProcess(const AgentProcess&) = delete;
  AgentProcess& operator=(const AgentProcess&) = delete;

  pid_t pid() const { return pid_; }
  // The exit code (128 + signal when killed), or -1 if still running after `limit`.
  int wait(std::chrono::milliseconds limit) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    while (code_ < 0) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return code_;
  }
  std::string out() const { return slurp(out_); }
  std::string err() const { return slurp(err_); }
  std::string log() const { return out() + err(); }

 private:
  std::string out_, err_;
  pid_t pid_ = -1;
  int code_ = -1;
};

}  // namespace dnallm::elastic_testing
