#include "launcher/spawner.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>

#include "core/error.hpp"
#include "core/signals.hpp"

namespace dnallm::launcher {

std::string WorkerExit::describe() const {
  if (signaled) return fmt::format("was killed by signal {} ({})", code, signal_name(code));
  return fmt::format("exited with code {}", code);
}

void PrefixedConsole::write_line(int rank, OutputStream stream, const std::string& line) {
  std::string out = fmt::format("[rank {}] {}\n", rank, line);
  int fd = stream == OutputStream::kStdout ? STDOUT_FILENO : STDERR_FILENO;
  std::lock_guard<std::mutex> lock(mu_);
  const char* p = out.data();
  std::size_t left = out.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our stdout is gone (closed pipe): drop the line, keep running
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

void LineTail::push(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  lines_.push_back(line);
  while (lines_.size() > capacity_) lines_.pop_front();
}

std::vector<std::string> LineTail::lines() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {lines_.begin(), lines_.end()};
}

PipeLineReader::PipeLineReader(int fd, std::function<void(const std::string&)> on_line)
    : fd_(fd), on_line_(std::move(on_line)) {
  thread_ = std::thread([this] { run(); });
}

PipeLineReader::~PipeLineReader() {
  stop();
  join();
  ::close(fd_);
}

void PipeLineReader::join() {
  if (thread_.joinable()) thread_.join();
}

void PipeLineReader::run() {
  constexpr std::size_t kMaxLine = 64 * 1024;
  std::string pending;
  char buf[8192];
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, 100);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    ssize_t n = ::read(fd_, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) break;  // EOF (every writer closed) or a read error
    pending.append(buf, static_cast<std::size_t>(n));
    std::size_t start = 0;
    while (true) {
      std::size_t nl = pending.find('\n', start);
      if (nl == std::string::npos) break;
      on_line_(pending.substr(start, nl - start));
      start = nl + 1;
    }
    pending.erase(0, start);
    while (pending.size() >= kMaxLine) {
      on_line_(pending.substr(0, kMaxLine));
      pending.erase(0, kMaxLine);
    }
  }
  if (!pending.empty()) on_line_(pending);
  eof_.store(true);
}

std::string resolve_executable(const std::string& name, const std::string& path_env) {
  auto runnable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.empty()) fail(ExitCode::kUsage, "the worker command is empty");
  if (name.find('/') != std::string::npos) {
    if (!runnable(name)) {
      fail(ExitCode::kUsage, "worker command '{}' is not an executable file", name);
    }
    return name;
  }
  std::size_t pos = 0;
  while (pos <= path_env.size()) {
    std::size_t end = path_env.find(':', pos);
    if (end == std::string::npos) end = path_env.size();
    std::string dir = path_env.substr(pos, end - pos);
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (runnable(candidate)) return candidate;
    pos = end + 1;
  }
  fail(ExitCode::kUsage, "worker command '{}' was not found in PATH", name);
}

namespace {

class ProcessWorker : public WorkerProcess {
 public:
  ProcessWorker(int pid, int out_fd, int err_fd, int rank, OutputSink& sink, std::size_t tail_lines)
      : pid_(pid), tail_(std::make_shared<LineTail>(tail_lines)) {
    auto tail = tail_;
    out_ = std::make_unique<PipeLineReader>(out_fd, [&sink, tail, rank](const std::string& l) {
      tail->push(l);
      sink.write_line(rank, OutputStream::kStdout, l);
    });
    err_ = std::make_unique<PipeLineReader>(err_fd, [&sink, tail, rank](const std::string& l) {
      tail->push(l);
      sink.write_line(rank, OutputStream::kStderr, l);
    });
  }

  ~ProcessWorker() override {
    // Never leave a child behind: the group owns its workers' lifetime.
    if (!exit_) {
      ::kill(-pid_, SIGKILL);
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      exit_ = WorkerExit{true, SIGKILL};
    }
    // Print what is still in the pipes before the readers are stopped.
    drain_output();
    out_.reset();
    err_.reset();
  }

  int pid() const override { return pid_; }

  std::optional<WorkerExit> try_wait() override {
    if (exit_) return exit_;
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == 0) return std::nullopt;
    if (r < 0) {
      if (errno == EINTR) return std::nullopt;
      // ECHILD: someone else reaped it; report it as lost rather than hang.
      exit_ = WorkerExit{false, 255};
      return exit_;
    }
    if (WIFSIGNALED(status)) {
      exit_ = WorkerExit{true, WTERMSIG(status)};
    } else {
      exit_ = WorkerExit{false, WEXITSTATUS(status)};
    }
    return exit_;
  }

  void send_signal(int sig) override {
    if (exit_) return;
    // The worker leads its own group (setpgid in both parent and child), so this reaches
    // any helper processes it started too.
    if (::kill(-pid_, sig) != 0 && errno == ESRCH) ::kill(pid_, sig);
  }

  std::vector<std::string> last_lines() override {
    if (exit_) drain_output();
    return tail_->lines();
  }

 private:
  // Once the worker has ended, waits (up to a second: a helper that left the process
  // group could hold the pipes open forever) until both readers saw end of file.
  void drain_output() {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while ((!out_->at_eof() || !err_->at_eof()) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  int pid_;
  std::optional<WorkerExit> exit_;
  std::shared_ptr<LineTail> tail_;
  std::unique_ptr<PipeLineReader> out_;
  std::unique_ptr<PipeLineReader> err_;
};

struct Pipe {
  int read = -1;
  int write = -1;
};

Pipe make_pipe() {
  int fds[2];
  DNALLM_SYSCHECK(::pipe2(fds, O_CLOEXEC), "worker output pipe");
  return {fds[0], fds[1]};
}

}  // namespace

ProcessSpawner::ProcessSpawner(OutputSink& sink, ProcessSpawnerOptions options)
    : sink_(sink), options_(options) {}

std::unique_ptr<WorkerProcess> ProcessSpawner::spawn(const WorkerSpec& spec) {
  if (spec.argv.empty()) fail(ExitCode::kUsage, "the worker command is empty");
  std::string path_env = "/usr/local/bin:/usr/bin:/bin";
  for (const auto& kv : spec.env) {
    if (kv.rfind("PATH=", 0) == 0) path_env = kv.substr(5);
  }
  const std::string program = resolve_executable(spec.argv[0], path_env);

  // Everything the child touches is prepared before fork: after fork only
  // async-signal-safe calls are allowed (other threads may hold locks).
  std::vector<char*> argv;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  DNALLM_SYSCHECK(devnull, "/dev/null");
  Pipe out = make_pipe();
  Pipe err = make_pipe();

  // Note [Inherited descriptors]: the child keeps only stdin/stdout/stderr. Sockets and
  // files opened without close-on-exec (by us or by a library, in any thread) would
  // otherwise live on in every worker, e.g. the coordinator's listening socket.
  rlimit nofile{};
  const int max_fd = ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY
                         ? static_cast<int>(std::min<rlim_t>(nofile.rlim_cur, 1 << 20))
                         : 65536;
  const bool hold_stop_signals = spec.hold_stop_signals;
  // Held from the child's first instruction: blocked in this thread across fork() (the
  // launcher has them blocked anyway; a test or another caller may not).
  sigset_t stop_signals, saved_mask;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGUSR1);
  sigaddset(&stop_signals, SIGTERM);
  if (hold_stop_signals) ::pthread_sigmask(SIG_BLOCK, &stop_signals, &saved_mask);
  const pid_t launcher_pid = ::getpid();
  pid_t pid = ::fork();
  if (pid != 0 && hold_stop_signals) ::pthread_sigmask(SIG_SETMASK, &saved_mask, nullptr);
  if (pid < 0) {
    int e = errno;
    for (int fd : {devnull, out.read, out.write, err.read, err.write}) ::close(fd);
    fail(ExitCode::kFailure, "fork failed for rank {}: {}", spec.rank, errno_string(e));
  }
  if (pid == 0) {
    // Die with the launcher: workers live in their own process groups, so nothing else
    // would stop them if the launcher were SIGKILLed (e.g. by a scheduler). The getppid()
    // check closes the race with a launcher that died before prctl().
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher_pid) ::_exit(127);
    ::setpgid(0, 0);
    sigset_t mask;
    sigemptyset(&mask);
    if (hold_stop_signals) mask = stop_signals;  // Note [Early stop signals] (spawner.hpp)
    ::sigprocmask(SIG_SETMASK, &mask, nullptr);
    for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGHUP, SIGQUIT, SIGCHLD}) ::signal(sig, SIG_DFL);
    ::dup2(devnull, STDIN_FILENO);
    ::dup2(out.write, STDOUT_FILENO);
    ::dup2(err.write, STDERR_FILENO);
    // See Note [Inherited descriptors].
#ifdef SYS_close_range
    if (::syscall(SYS_close_range, 3u, ~0u, 0u) != 0)
#endif
      for (int fd = 3; fd < max_fd; ++fd) ::close(fd);
    ::execve(program.c_str(), argv.data(), envp.data());
    const char msg[] = "dnallm-launch: exec of the worker command failed\n";
    ssize_t ignored = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    (void)ignored;
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: signals sent right after spawn must reach the group
  ::close(devnull);
  ::close(out.write);
  ::close(err.write);
  return std::make_unique<ProcessWorker>(pid, out.read, err.read, spec.rank, sink_,
                                         options_.tail_lines);
}

}  // namespace dnallm::launcher
