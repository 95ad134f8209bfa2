// Starting and watching worker processes: the `Spawner` seam.
//
// ProcessSpawner is the real implementation (fork/exec, one process group per worker,
// stdout/stderr through pipes and prefixed line by line). Unit tests of the group and
// restart policy use a fake (tests/launcher/fake_spawner.hpp) with the same contract.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dnallm::launcher {

// What to start for one worker.
struct WorkerSpec {
  int rank = 0;
  int local_rank = 0;
  std::vector<std::string> argv;  // argv[0]: a path, or a name looked up in PATH of `env`
  std::vector<std::string> env;   // the complete environment, "KEY=VALUE"
  // Note [Early stop signals]: start the worker with SIGUSR1 and SIGTERM blocked, so that a
  // stop signal forwarded before the worker installed its handlers stays pending instead of
  // killing it (their default action). For workers that unblock them once their handlers
  // are in place (dnallm-train does, first thing in main()); any other command would never
  // see them.
  bool hold_stop_signals = false;
  // >= 0: a warm spare (DNALLM_SPARE_ID), not a rank until it takes a dead rank's place
  // (Note [In-process recovery] in worker/train/in_process_recovery.hpp).
  int spare_id = -1;
};

// How a worker ended.
struct WorkerExit {
  bool signaled = false;  // true: killed by signal `code`; false: exited with status `code`
  int code = 0;
  bool ok() const { return !signaled && code == 0; }
  // "exited with code 3" or "was killed by signal 9 (SIGKILL)".
  std::string describe() const;
};

// A running (or ended) worker. Methods are called from one thread (the group's monitor).
class WorkerProcess {
 public:
  virtual ~WorkerProcess() = default;
  virtual int pid() const = 0;
  // Non-blocking. The exit once the worker has ended (reaped), nullopt while it runs; keeps
  // returning the same exit afterwards.
  virtual std::optional<WorkerExit> try_wait() = 0;
  // Sends `sig` to the worker's whole process group; a no-op once it has been reaped.
  virtual void send_signal(int sig) = 0;
  // The last lines it wrote to stdout and stderr, oldest first. Once ended, first waits
  // (bounded, about a second) for its output pipes to drain so the tail is complete.
  virtual std::vector<std::string> last_lines() = 0;
};

class Spawner {
 public:
  virtual ~Spawner() = default;
  // Starts a worker; throws Error when it cannot be started (command not found: kUsage).
  virtual std::unique_ptr<WorkerProcess> spawn(const WorkerSpec& spec) = 0;
};

enum class OutputStream { kStdout, kStderr };

// Where worker output lines go. Called from reader threads concurrently: implementations
// must be thread-safe and write each line whole.
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual void write_line(int rank, OutputStream stream, const std::string& line) = 0;
};

// Writes "[rank N] line\n" to this process's stdout or stderr with one write() per line,
// so lines of different workers never mix mid-line.
class PrefixedConsole : public OutputSink {
 public:
  void write_line(int rank, OutputStream stream, const std::string& line) override;

 private:
  std::mutex mu_;  // guards writes to fds 1 and 2
};

// The last `capacity` lines of a worker, shared by its two reader threads.
class LineTail {
 public:
  explicit LineTail(std::size_t capacity) : capacity_(capacity) {}
  void push(const std::string& line);
  std::vector<std::string> lines() const;

 private:
  std::size_t capacity_;
  mutable std::mutex mu_;  // guards lines_
  std::deque<std::string> lines_;
};

// Reads one pipe on its own thread, splitting it into lines for `on_line`. Owns the fd.
// stop() asks the thread to end (it polls every 100 ms), join() waits; the destructor does
// both. Lines longer than 64 KiB are cut into 64 KiB pieces.
class PipeLineReader {
 public:
  PipeLineReader(int fd, std::function<void(const std::string&)> on_line);
  ~PipeLineReader();
  PipeLineReader(const PipeLineReader&) = delete;
  PipeLineReader& operator=(const PipeLineReader&) = delete;

  bool at_eof() const { return eof_.load(); }
  void stop() { stop_.store(true); }
  void join();

 private:
  void run();

  int fd_;
  std::function<void(const std::string&)> on_line_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> eof_{false};
  std::thread thread_;
};

struct ProcessSpawnerOptions {
  std::size_t tail_lines = 10;  // lines kept per worker for failure reports
};

// fork/exec in a new process group (setpgid), stdin from /dev/null, stdout and stderr
// through close-on-exec pipes read by two PipeLineReaders per worker. The child unblocks
// all signals and restores default dispositions before exec, so a launcher that blocks
// SIGINT/SIGTERM (signalfd) or ignores SIGPIPE does not pass that on. Each worker gets
// PR_SET_PDEATHSIG = SIGKILL: it dies with the launcher even if the launcher is SIGKILLed.
// spawn() must be called from a thread that lives as long as the workers (the death signal
// follows the forking thread); the launcher calls it from main().
class ProcessSpawner : public Spawner {
 public:
  ProcessSpawner(OutputSink& sink, ProcessSpawnerOptions options = {});
  std::unique_ptr<WorkerProcess> spawn(const WorkerSpec& spec) override;

 private:
  OutputSink& sink_;
  ProcessSpawnerOptions options_;
};

// The path exec would run for `name` given a PATH value; `name` itself when it contains a
// '/'. Throws Error(kUsage) when nothing executable is found.
std::string resolve_executable(const std::string& name, const std::string& path_env);

}  // namespace dnallm::launcher
