// ProcessSpawner with real processes (/bin/sh): output routing, environment, exits, signals.
#include "launcher/spawner.hpp"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <thread>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::launcher {
namespace {

using dnallm::testing::expect_error;

class CapturingSink : public OutputSink {
 public:
  void write_line(int rank, OutputStream stream, const std::string& line) override {
    std::lock_guard<std::mutex> lock(mu_);  // (SlowSink overrides and chains here)
    lines_[{rank, stream}].push_back(line);
  }
  std::vector<std::string> lines(int rank, OutputStream stream) {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_[{rank, stream}];
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, OutputStream>, std::vector<std::string>> lines_;
};

WorkerSpec sh(int rank, const std::string& script, std::vector<std::string> env = {}) {
  WorkerSpec s;
  s.rank = rank;
  s.argv = {"sh", "-c", script};
  env.push_back("PATH=/usr/bin:/bin");
  s.env = env;
  return s;
}

WorkerExit wait_exit(WorkerProcess& p, std::chrono::seconds limit = std::chrono::seconds(10)) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto e = p.try_wait()) return *e;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "worker did not exit";
  p.send_signal(SIGKILL);
  while (!p.try_wait()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return *p.try_wait();
}

TEST(ProcessSpawner, RoutesStdoutAndStderrLinesAndExitCode) {
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  auto p = spawner.spawn(sh(3, "echo one; echo two >&2; printf 'no newline'; exit 6"));
  WorkerExit e = wait_exit(*p);
  EXPECT_FALSE(e.signaled);
  EXPECT_EQ(e.code, 6);
  EXPECT_EQ(p->try_wait()->code, 6);                // stays reaped
  std::vector<std::string> tail = p->last_lines();  // waits for the pipes to drain
  EXPECT_EQ(sink.lines(3, OutputStream::kStdout), (std::vector<std::string>{"one", "no newline"}));
  EXPECT_EQ(sink.lines(3, OutputStream::kStderr), std::vector<std::string>{"two"});
  EXPECT_EQ(tail.size(), 3u);
}

TEST(ProcessSpawner, KeepsOnlyTheLastLines) {
  CapturingSink sink;
  ProcessSpawnerOptions o;
  o.tail_lines = 4;
  ProcessSpawner spawner(sink, o);
  auto p = spawner.spawn(sh(0, "i=0; while [ $i -lt 20 ]; do echo line$i; i=$((i+1)); done"));
  EXPECT_TRUE(wait_exit(*p).ok());
  EXPECT_EQ(p->last_lines(), (std::vector<std::string>{"line16", "line17", "line18", "line19"}));
  EXPECT_EQ(sink.lines(0, OutputStream::kStdout).size(), 20u);
}

TEST(ProcessSpawner, CutsVeryLongLines) {
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  // 70000 'a' then a newline: one 64 KiB piece and the rest.
  auto p = spawner.spawn(sh(0, "head -c 70000 /dev/zero | tr '\\0' a; echo; echo end"));
  EXPECT_TRUE(wait_exit(*p).ok());
  p->last_lines();
  auto lines = sink.lines(0, OutputStream::kStdout);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], std::string(65536, 'a'));
  EXPECT_EQ(lines[1], std::string(70000 - 65536, 'a'));
  EXPECT_EQ(lines[2], "end");
}

TEST(ProcessSpawner, PassesExactlyTheGivenEnvironment) {
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  auto p = spawner.spawn(
      sh(1, "echo \"$FOO|${HOME-unset}|$(cat)\"", {"FOO=bar baz"}));  // stdin is /dev/null
  EXPECT_TRUE(wait_exit(*p).ok());
  p->last_lines();
  EXPECT_EQ(sink.lines(1, OutputStream::kStdout), std::vector<std::string>{"bar baz|unset|"});
}

TEST(ProcessSpawner, SignalReachesTheWholeProcessGroup) {
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  // A background helper would print "late" if only the shell got the signal.
  auto p = spawner.spawn(sh(0, "(sleep 0.5; echo late) & echo ready; sleep 30; echo after"));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (sink.lines(0, OutputStream::kStdout).empty() &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  p->send_signal(SIGTERM);
  WorkerExit e = wait_exit(*p, std::chrono::seconds(5));
  EXPECT_TRUE(e.signaled);
  EXPECT_EQ(e.code, SIGTERM);
  EXPECT_EQ(e.describe(), "was killed by signal 15 (SIGTERM)");
  // last_lines() waits up to a second for the pipes to close, long enough for "late".
  p->last_lines();
  EXPECT_EQ(sink.lines(0, OutputStream::kStdout), std::vector<std::string>{"ready"});
}

TEST(ProcessSpawner, WorkersInheritOnlyStdio) {
  // A descriptor this process leaves inheritable (no O_CLOEXEC), like a listening socket.
  int leaky = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(leaky, 3);
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  auto p = spawner.spawn(sh(0, "ls /proc/self/fd | sort -n | tr '\\n' ' '"));
  EXPECT_TRUE(wait_exit(*p).ok());
  p->last_lines();
  ::close(leaky);
  // 0, 1, 2 and the descriptor ls opened to read the directory.
  const auto out = sink.lines(0, OutputStream::kStdout);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0], "0 1 2 3 ") << "leaked descriptors";
}

TEST(ProcessSpawner, HeldStopSignalsWaitForTheWorkerInsteadOfKillingIt) {
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  // SIGTERM at once, while the worker is still starting (before dnallm-train would have
  // installed its handler and unblocked it): held, it stays pending and does not kill.
  // (Not sh: dash clears its signal mask at start-up; sleep keeps the one it inherits.)
  WorkerSpec spec = sh(0, "");
  spec.argv = {"sleep", "0.3"};
  spec.hold_stop_signals = true;
  auto p = spawner.spawn(spec);
  p->send_signal(SIGTERM);
  WorkerExit held = wait_exit(*p, std::chrono::seconds(10));
  EXPECT_TRUE(held.ok()) << held.describe();

  WorkerSpec plain = sh(1, "");
  plain.argv = {"sleep", "0.3"};
  auto q = spawner.spawn(plain);
  q->send_signal(SIGTERM);
  WorkerExit killed = wait_exit(*q, std::chrono::seconds(10));
  EXPECT_TRUE(killed.signaled);
  EXPECT_EQ(killed.code, SIGTERM);
}

TEST(ProcessSpawner, MissingCommandIsUsageError) {
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  WorkerSpec s;
  s.argv = {"dnallm-no-such-command"};
  s.env = {"PATH=/bin"};
  expect_error([&] { spawner.spawn(s); }, ExitCode::kUsage, {"dnallm-no-such-command"});
}

// A sink slow enough that the pipe still holds output when the worker exits.
class SlowSink : public CapturingSink {
 public:
  void write_line(int rank, OutputStream stream, const std::string& line) override {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    CapturingSink::write_line(rank, stream, line);
  }
};

TEST(ProcessSpawner, OutputWrittenJustBeforeExitIsNotLost) {
  SlowSink sink;
  ProcessSpawner spawner(sink);
  {
    auto p = spawner.spawn(sh(0, "seq 1 2000"));
    EXPECT_TRUE(wait_exit(*p).ok());
    // Destroyed at once, without last_lines(): the pipes must still be read to the end.
  }
  auto lines = sink.lines(0, OutputStream::kStdout);
  ASSERT_EQ(lines.size(), 2000u);
  EXPECT_EQ(lines.back(), "2000");
}

TEST(ProcessSpawner, DestroyingARunningWorkerKillsIt) {
  CapturingSink sink;
  ProcessSpawner spawner(sink);
  int pid = 0;
  {
    auto p = spawner.spawn(sh(0, "sleep 30"));
    pid = p->pid();
  }
  EXPECT_EQ(::kill(pid, 0), -1);  // reaped, so the pid no longer exists
}

}  // namespace
}  // namespace dnallm::launcher
