// Multi-process tests of the real backends: gloo ranks spawned here (this process hosts
// the store), MPI ranks started by mpirun. See comm_worker_main.cpp for what each rank does.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "comm/communicator.hpp"
#include "comm/make_communicator.hpp"
#include "coordinator/store_server.hpp"
#include "tests/support/process.hpp"

extern char** environ;

namespace dnallm::comm {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// A loopback port the kernel just handed out and released, for a rank 0 that hosts the store
// at MASTER_PORT (a port derived from the pid collided once with another program's).
std::string free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  if (fd >= 0) ::close(fd);
  EXPECT_TRUE(ok) << "no free loopback port";
  return std::to_string(ntohs(addr.sin_port));
}

using dnallm::testing::kBin;
using dnallm::testing::read_text;
using dnallm::testing::run_command;
using dnallm::testing::run_shell;

const std::string kWorker = kBin + "comm_test_worker";

struct RankResult {
  int exit_code = -1;  // -signal when killed
  Clock::time_point ended;
  std::string output;
};

// Runs `world` workers with the given extra environment; kills all at `limit`.
std::vector<RankResult> run_ranks(int world, uint16_t port,
                                  const std::vector<std::string>& extra_env,
                                  std::chrono::seconds limit) {
  std::vector<pid_t> pids(static_cast<size_t>(world));
  std::vector<std::string> logs;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env = {
        "RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world), "MASTER_ADDR=127.0.0.1",
        "MASTER_PORT=" + std::to_string(port), "DNALLM_TEST_BACKEND=gloo"};
    for (char** e = environ; *e; ++e) {
      std::string s(*e);
      if (s.rfind("RANK=", 0) != 0 && s.rfind("WORLD_SIZE=", 0) != 0) env.push_back(s);
    }
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    logs.push_back(::testing::TempDir() + "/comm_rank" + std::to_string(r) + "_" +
                   std::to_string(::getpid()) + ".log");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::string bin = kWorker;
    char* argv[] = {bin.data(), nullptr};
    int rc =
        posix_spawn(&pids[static_cast<size_t>(r)], bin.c_str(), &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    EXPECT_EQ(rc, 0) << "cannot start " << bin;
  }
  std::vector<RankResult> results(static_cast<size_t>(world));
  const auto deadline = Clock::now() + limit;
  int running = world;
  while (running > 0) {
    for (int r = 0; r < world; ++r) {
      auto& pid = pids[static_cast<size_t>(r)];
      if (pid <= 0) continue;
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        auto& res = results[static_cast<size_t>(r)];
        res.ended = Clock::now();
        res.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        pid = 0;
        --running;
      }
    }
    if (Clock::now() > deadline) {
      for (auto pid : pids)
        if (pid > 0) ::kill(pid, SIGKILL);
      ADD_FAILURE() << "ranks still running after " << limit.count() << " s: killed";
      for (auto& pid : pids)
        if (pid > 0) ::waitpid(pid, nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(5ms);
  }
  for (int r = 0; r < world; ++r)
    results[static_cast<size_t>(r)].output = read_text(logs[static_cast<size_t>(r)]);
  return results;
}

// The store the spawned ranks bootstrap through (loopback, port 0, token "test-token").
std::unique_ptr<coordinator::StoreServer> start_store() {
  coordinator::StoreServerOptions o;
  o.host = "127.0.0.1";
  o.token = "test-token";
  auto server = std::make_unique<coordinator::StoreServer>(o);
  server->start();
  return server;
}

// Every rank exited 0 and printed `done` (the worker's line once its checks passed).
void expect_every_rank_ok(const std::vector<RankResult>& results, const std::string& done) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find(done), std::string::npos);
  }
}

// Every line of a dnallm-bench-comm --json sweep reports zero wrong elements (the bench also
// exits 1 otherwise).
void expect_nothing_wrong(const std::string& out) {
  for (size_t p = out.find("\"wrong\":"); p != std::string::npos; p = out.find("\"wrong\":", p + 1))
    EXPECT_EQ(out.compare(p, 10, "\"wrong\":0}"), 0) << out.substr(p, 20);
}

class GlooWorld : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!backend_available("gloo")) GTEST_SKIP() << "gloo not built";
    server_ = start_store();
  }
  std::unique_ptr<coordinator::StoreServer> server_;
};

TEST_P(GlooWorld, EveryCollectiveDtypeAndLayoutMatchesClosedForm) {
  const int world = GetParam();
  auto results = run_ranks(world, server_->port(), {"DNALLM_TEST_MODE=matrix"}, 100s);
  expect_every_rank_ok(results, "cases OK");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooWorld, ::testing::Values(1, 2, 3, 4));

// Sub-groups, all_to_all with uneven and empty blocks, send / recv (comm_worker_main.cpp's
// groups mode), every element checked.
class GlooGroups : public GlooWorld {};

TEST_P(GlooGroups, SplitAllToAllAndSendRecvMatchClosedForm) {
  const int world = GetParam();
  auto results = run_ranks(world, server_->port(), {"DNALLM_TEST_MODE=groups"}, 100s);
  expect_every_rank_ok(results, "groups OK");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooGroups, ::testing::Values(2, 3, 4));

TEST(GlooFailure, KilledRankIsNamedByTheOthersWithinTimeout) {
  if (!backend_available("gloo")) GTEST_SKIP();
  const auto server = start_store();
  const int world = 3;
  const auto timeout = 3s;
  auto results = run_ranks(
      world, server->port(),
      {"DNALLM_TEST_MODE=kill", "DNALLM_TEST_VICTIM=1", "DNALLM_TEST_TIMEOUT_MS=3000"}, 60s);
  ASSERT_EQ(results[1].exit_code, -SIGKILL) << results[1].output;
  for (int r : {0, 2}) {
    const auto& res = results[static_cast<size_t>(r)];
    EXPECT_EQ(res.exit_code, 4) << "rank " << r << ":\n" << res.output;
    EXPECT_NE(res.output.find("rank(s) 1 died"), std::string::npos) << res.output;
    auto after =
        std::chrono::duration_cast<std::chrono::milliseconds>(res.ended - results[1].ended);
    std::cout << "rank " << r << " failed " << after.count() << " ms after rank 1 died\n";
    // timeout + 1 s, plus process exit on a loaded machine.
    EXPECT_LT(after, timeout + 1s + 500ms);
  }
}

TEST(GlooFailure, StalledRankIsNamedAfterTheTimeout) {
  if (!backend_available("gloo")) GTEST_SKIP();
  const auto server = start_store();
  const auto t0 = Clock::now();
  auto results = run_ranks(3, server->port(),
                           {"DNALLM_TEST_MODE=kill", "DNALLM_TEST_STALL=1", "DNALLM_TEST_VICTIM=2",
                            "DNALLM_TEST_TIMEOUT_MS=3000"},
                           60s);
  EXPECT_EQ(results[2].exit_code, 0) << results[2].output;
  for (int r : {0, 1}) {
    const auto& res = results[static_cast<size_t>(r)];
    EXPECT_EQ(res.exit_code, 4) << "rank " << r << ":\n" << res.output;
    EXPECT_NE(res.output.find("rank(s) 2 did not arrive"), std::string::npos) << res.output;
    // They cannot know before the 3 s timeout; startup on a loaded machine adds a little.
    EXPECT_GE(res.ended - t0, 3s);
    EXPECT_LT(res.ended - t0, 3s + 1s + 4s);
  }
}

#ifdef DNALLM_TEST_HAVE_MPI
// How many times `what` stands in `text`.
size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

// The matrix of comm_test_worker under mpirun; its output goes to `out`.
int run_mpirun(int np, std::string* out) {
  return run_command("timeout 100 mpirun --allow-run-as-root --oversubscribe -np " +
                         std::to_string(np) + " -x DNALLM_TEST_MODE=matrix " + kWorker,
                     out);
}

class MpiWorld : public ::testing::TestWithParam<int> {};

TEST_P(MpiWorld, EveryCollectiveDtypeAndLayoutMatchesClosedForm) {
  const int world = GetParam();
  std::string out;
  EXPECT_EQ(run_mpirun(world, &out), 0) << out;
  // backend "auto" chose mpi under mpirun
  EXPECT_EQ(count_of(out, "backend mpi"), static_cast<size_t>(world)) << out;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MpiWorld, ::testing::Values(1, 2, 3, 4));

class MpiGroups : public ::testing::TestWithParam<int> {};

TEST_P(MpiGroups, SplitAllToAllAndSendRecvMatchClosedForm) {
  const int world = GetParam();
  std::string out;
  EXPECT_EQ(run_command("timeout 100 mpirun --allow-run-as-root --oversubscribe -np " +
                            std::to_string(world) + " -x DNALLM_TEST_MODE=groups " + kWorker,
                        &out),
            0)
      << out;
  EXPECT_EQ(count_of(out, "groups OK"), static_cast<size_t>(world)) << out;
  EXPECT_NE(out.find("backend mpi"), std::string::npos) << out;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MpiGroups, ::testing::Values(2, 3, 4));

TEST(BenchComm, MpiAndRawMpiSweepsCheckEveryElement) {
  const std::string bench = kBin + "dnallm-bench-comm";
  for (const std::string run : {"mpi", "mpi-raw", "mpi --op all_to_all", "mpi-raw --op all_to_all",
                                "mpi --op sendrecv", "mpi-raw --op sendrecv"}) {
    std::string out;
    const int rc = run_command("timeout 60 mpirun --allow-run-as-root --oversubscribe -np 3 " +
                                   bench + " --backend " + run +
                                   " --min-bytes 4 --max-bytes 65536 --iters 2 --warmup 1 --json",
                               &out);
    EXPECT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("\"bytes\":65536"), std::string::npos) << out;
    expect_nothing_wrong(out);
  }
}
#endif

TEST(BenchComm, HelpAndGlooSweepForEveryOp) {
  const std::string bench = kBin + "dnallm-bench-comm";
  EXPECT_EQ(run_command(bench + " --help"), 0);
  EXPECT_EQ(run_command(bench + " --op alltoall"), 2);
  if (!backend_available("gloo")) return;
  for (const char* op : {"allreduce", "reduce_scatter", "allgather", "broadcast", "all_to_all"}) {
    for (const char* dtype : {"fp32", "bf16"}) {
      const std::string port = free_loopback_port();
      std::string cmd = "RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                        " timeout 60 " + bench + " --backend gloo --op " + op + " --dtype " +
                        dtype + " --redop max --min-bytes 64 --max-bytes 4096 --iters 2 --warmup 1";
      std::string out;
      EXPECT_EQ(run_command(cmd, &out), 0) << op << " " << dtype << "\n" << out;
      EXPECT_NE(out.find("#wrong"), std::string::npos) << out;
    }
  }
}

// all_to_all and the send/recv ring at 3 ranks (uneven blocks), every element checked.
TEST(BenchComm, GlooAllToAllAndSendRecvSweepsCheckEveryElement) {
  if (!backend_available("gloo")) GTEST_SKIP();
  const std::string bench = kBin + "dnallm-bench-comm";
  for (const char* op : {"all_to_all", "sendrecv"}) {
    const std::string port = free_loopback_port();
    std::string cmd;
    for (int r = 2; r >= 0; --r)
      cmd += "RANK=" + std::to_string(r) +
             " WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " timeout 60 " + bench +
             " --backend gloo --op " + op +
             " --min-bytes 4 --max-bytes 65536 --iters 2 --warmup 1 --json" +
             (r > 0 ? " >/dev/null & " : "; rc=$?; wait; exit $rc");
    std::string out;
    EXPECT_EQ(run_command(cmd, &out), 0) << op << "\n" << out;
    EXPECT_NE(out.find("\"bytes\":65536"), std::string::npos) << out;
    expect_nothing_wrong(out);
  }
  // A ring needs neighbours.
  EXPECT_EQ(
      run_command("RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + free_loopback_port() +
                  " timeout 60 " + bench + " --backend gloo --op sendrecv"),
      2);
}

}  // namespace
}  // namespace dnallm::comm
