// dnallm-launch end to end with real worker processes (/bin/sh scripts).
#include <signal.h>

#include <algorithm>
#include <map>
#include <regex>
#include <tuple>

#include <gtest/gtest.h>

#include "launch_runner.hpp"
#include "tests/support/process.hpp"

namespace dnallm::launcher {
namespace {

using testing::LaunchResult;
using testing::run_launch;
using testing::split_lines;
using testing::TempDir;
using testing::wait_for_files;

std::vector<std::string> with_sh(std::vector<std::string> args, const std::string& script) {
  args.insert(args.end(), {"--", "/bin/sh", "-c", script});
  return args;
}

using dnallm::testing::contains;

TEST(LaunchCli, HelpExitsZero) {
  LaunchResult r = run_launch({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt :
       {"--nproc-per-node", "--config", "--set", "--metrics-file", "--master-addr", "--master-port",
        "--max-restarts", "--dry-run", "--log-level", "--grace-period"}) {
    EXPECT_TRUE(contains(r.out, opt)) << opt;
  }
}

TEST(LaunchCli, BadUsageExitsTwoWithOneLine) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--no-such-flag"},
           {"--nproc-per-node", "zero", "--", "/bin/true"},
           {"--nproc-per-node", "2", "--max-restarts", "-1", "--", "/bin/true"},
           {"--master-port", "70000", "--", "/bin/true"},
           {"--log-level", "loud", "--", "/bin/true"},
           {"--", "dnallm-no-such-command"},
           {"--set", "nosuchsection.key=1", "--", "/bin/true"},
           {"--config", "/nonexistent/run.toml", "--", "/bin/true"}}) {
    LaunchResult r = run_launch(args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << ": " << r.err;
    EXPECT_EQ(split_lines(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

// Note [Shrink and grow]: DDP only; the refusal says why and what to do instead.
TEST(LaunchCli, ShrinkUnderZeroOrContextParallelismIsRefused) {
  for (const char* set : {"parallel.zero_stage=1", "parallel.context_parallel=2"}) {
    LaunchResult r = run_launch(
        {"--nproc-per-node", "2", "--set", "elastic.shrink=true", "--set", set, "--", "/bin/true"});
    EXPECT_EQ(r.exit_code, 2) << set << ": " << r.err;
    EXPECT_EQ(split_lines(r.err).size(), 1u) << r.err;
    EXPECT_NE(r.err.find("elastic.shrink"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("spares keep"), std::string::npos) << r.err;
  }
}

TEST(LaunchCli, PrintsResolvedConfig) {
  LaunchResult r = run_launch({"--set", "parallel.backend=gloo", "--print-config"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "[parallel]")) << r.out;
  EXPECT_TRUE(contains(r.out, "gloo")) << r.out;
}

TEST(LaunchCli, DryRunPrintsPlanAndStartsNothing) {
  TempDir dir;
  LaunchResult r =
      run_launch(with_sh({"--nproc-per-node", "3", "--master-port", "29123", "--dry-run"},
                         "touch " + dir.path() + "/started"),
                 {"DNALLM_JOB_TOKEN=secret"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "ranks per node : 3")) << r.out;
  EXPECT_TRUE(contains(r.out, "127.0.0.1:29123")) << r.out;
  EXPECT_TRUE(contains(r.out, "job token      : from DNALLM_JOB_TOKEN")) << r.out;
  EXPECT_FALSE(contains(r.out, "secret")) << "the token itself is never printed";
  EXPECT_FALSE(dir.exists("started"));
}

TEST(LaunchCli, ExportsTheWorkerEnvironment) {
  const std::string script =
      "echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK "
      "A=$MASTER_ADDR P=$MASTER_PORT RC=$TORCHELASTIC_RESTART_COUNT "
      "MR=$TORCHELASTIC_MAX_RESTARTS ID=$TORCHELASTIC_RUN_ID GEN=$DNALLM_GENERATION "
      "TOK=$DNALLM_JOB_TOKEN OMP=$OMP_NUM_THREADS\"";
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "2", "--master-port", "29777",
                                       "--master-addr", "10.9.8.7", "--run-id", "abc"},
                                      script),
                              {"DNALLM_JOB_TOKEN=tok123"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = split_lines(r.out);
  std::sort(lines.begin(), lines.end());
  ASSERT_EQ(lines.size(), 2u) << r.out;
  for (int i = 0; i < 2; ++i) {
    std::string expected =
        "[rank " + std::to_string(i) + "] R=" + std::to_string(i) + " L=" + std::to_string(i) +
        " W=2 LW=2 G=0 A=10.9.8.7 P=29777 RC=0 MR=0 ID=abc GEN=0 TOK=tok123 OMP=";
    EXPECT_EQ(lines[i].rfind(expected, 0), 0u) << lines[i];
    EXPECT_NE(lines[i].back(), '=') << "OMP_NUM_THREADS must be set: " << lines[i];
  }
}

TEST(LaunchCli, KeepsUserOmpThreadsAndGeneratesAToken) {
  LaunchResult r =
      run_launch(with_sh({"--nproc-per-node", "1"},
                         "echo \"$OMP_NUM_THREADS ${#DNALLM_JOB_TOKEN} $MASTER_PORT\""),
                 {"OMP_NUM_THREADS=3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(\[rank 0\] 3 32 (\d+)\n)"))) << r.out;
  int port = std::stoi(m[1]);
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
}

TEST(LaunchCli, PrefixesEveryLineWithoutMixing) {
  // Each rank writes 200 long lines to stdout and 50 to stderr at the same time.
  const std::string script =
      "i=0; while [ $i -lt 200 ]; do "
      "echo \"r$RANK-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"; "
      "[ $((i % 4)) = 0 ] && echo \"e$RANK-$i\" >&2; i=$((i+1)); done";
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "3"}, script));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<int, int> out_count, err_count;
  const std::regex out_line(R"(\[rank (\d)\] r(\d)-\d+-x{68})");
  for (const auto& line : split_lines(r.out)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, out_line)) << line;
    EXPECT_EQ(m[1], m[2]) << line;
    ++out_count[std::stoi(m[1])];
  }
  const std::regex err_line(R"(\[rank (\d)\] e(\d)-\d+)");
  for (const auto& line : split_lines(r.err)) {
    std::smatch m;
    if (!std::regex_match(line, m, err_line)) continue;  // the launcher's own log lines
    EXPECT_EQ(m[1], m[2]) << line;
    ++err_count[std::stoi(m[1])];
  }
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(out_count[rank], 200) << rank;
    EXPECT_EQ(err_count[rank], 50) << rank;
  }
}

TEST(LaunchCli, FailingRankIsNamedAndTheOthersAreStopped) {
  TempDir dir;
  const std::string d = dir.path();
  // Rank 1 fails once all ranks are up; the others run until stopped and record SIGTERM
  // (the trap is set before "up" is announced, so the SIGTERM cannot come first).
  const std::string script = "if [ $RANK = 1 ]; then while [ ! -e " + d + "/up.0 ] || [ ! -e " + d +
                             "/up.2 ]; do "
                             "sleep 0.02; done; echo step 1; echo 'out of memory' >&2; exit 7; fi; "
                             "trap 'touch " +
                             d + "/term.$RANK; exit 0' TERM; touch " + d +
                             "/up.$RANK; "
                             "while :; do sleep 0.02; done";
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "3", "--grace-period", "5"}, script));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_TRUE(contains(r.err, "rank 1 (local rank 1, pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "exited with code 7; its last 2 line(s):")) << r.err;
  // stdout and stderr are read by separate threads: their relative order is not kept.
  EXPECT_TRUE(contains(r.err, "\n    step 1") && contains(r.err, "\n    out of memory")) << r.err;
  EXPECT_TRUE(dir.exists("term.0"));
  EXPECT_TRUE(dir.exists("term.2"));
  EXPECT_FALSE(dir.exists("term.1"));
}

TEST(LaunchCli, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir dir;
  const std::string d = dir.path();
  const std::string script = "if [ $RANK = 0 ]; then while [ ! -e " + d +
                             "/up.1 ]; do sleep 0.02; done; exit 1; fi; "
                             "trap 'echo ignoring TERM' TERM; touch " +
                             d + "/up.1; while :; do sleep 0.02; done";
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "2", "--grace-period", "0.3"}, script));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 1] ignoring TERM")) << r.out;
  EXPECT_TRUE(contains(r.err, "rank 1 (pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "sending SIGKILL")) << r.err;
}

// dnallm-launch forwards `sig` (`name` in the shell's trap) to every worker, each of which says
// so and exits 0; the launcher exits 128 + sig.
void expect_forwarded_to_every_worker(int sig, const std::string& name) {
  TempDir dir;
  const std::string d = dir.path();
  const std::string script = "trap 'echo got " + name + "; exit 0' " + name + "; touch " + d +
                             "/up.$RANK; while :; do sleep 0.02; done";
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "2"}, script), {}, [&](pid_t pid) {
    ASSERT_TRUE(wait_for_files(dir, {"up.0", "up.1"}));
    ::kill(pid, sig);
  });
  EXPECT_EQ(r.exit_code, 128 + sig) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] got " + name)) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 1] got " + name)) << r.out;
}

TEST(LaunchCli, ForwardsSigtermToEveryWorker) { expect_forwarded_to_every_worker(SIGTERM, "TERM"); }

TEST(LaunchCli, ForwardsSigintToEveryWorker) { expect_forwarded_to_every_worker(SIGINT, "INT"); }

// True once /proc says `pid` is gone or a zombie (nobody may reap it in a container).
bool process_gone(const std::string& pid) {
  std::string stat = testing::read_file("/proc/" + pid + "/stat");
  if (stat.empty()) return true;
  auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
}

TEST(LaunchCli, WorkersDieWithAKilledLauncher) {
  TempDir dir;
  const std::string d = dir.path();
  // The worker records its pid (exec replaces the shell, so the pid is the worker's).
  const std::string script =
      "echo $$ > " + d + "/pid.tmp; mv " + d + "/pid.tmp " + d + "/pid.$RANK; exec sleep 30";
  std::string pid;
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "1"}, script), {}, [&](pid_t launcher) {
    ASSERT_TRUE(wait_for_files(dir, {"pid.0"}));
    pid = testing::split_lines(testing::read_file(d + "/pid.0")).at(0);
    ::kill(launcher, SIGKILL);
  });
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  ASSERT_FALSE(pid.empty());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!process_gone(pid) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(process_gone(pid)) << "worker " << pid << " outlived its launcher";
  if (!process_gone(pid)) ::kill(std::stoi(pid), SIGKILL);
}

TEST(LaunchCli, RestartsTheGroupWithIncreasingCounts) {
  // Rank 1 fails until the second restart.
  const std::string script =
      "echo \"gen=$DNALLM_GENERATION restart=$TORCHELASTIC_RESTART_COUNT "
      "why=${DNALLM_RESTART_REASON-none}\"; "
      "[ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT -lt 2 ] && exit 9; exit 0";
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "2", "--max-restarts", "3"}, script));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (int g = 0; g < 3; ++g) {
    for (int rank = 0; rank < 2; ++rank) {
      std::string line = "[rank " + std::to_string(rank) + "] gen=" + std::to_string(g) +
                         " restart=" + std::to_string(g) +
                         (g == 0 ? " why=none" : " why=rank 1 exited with code 9") + "\n";
      EXPECT_TRUE(contains(r.out, line)) << line << " in\n" << r.out;
    }
  }
  EXPECT_FALSE(contains(r.out, "gen=3"));
  EXPECT_TRUE(contains(r.err, "restarting the local worker group (2 of 3 restarts)")) << r.err;
}

TEST(LaunchCli, GivesUpWhenRestartsAreSpent) {
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "2", "--max-restarts", "1"},
                                      "echo try $TORCHELASTIC_RESTART_COUNT; exit 1"));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] try 1")) << r.out;
  EXPECT_FALSE(contains(r.out, "try 2")) << r.out;
  EXPECT_TRUE(contains(r.err, "job failed after 1 restart(s)")) << r.err;
}

// A configuration file holding `toml`, in `dir`.
std::string write_config(const TempDir& dir, const std::string& toml) {
  const std::string path = dir.path() + "/run.toml";
  std::ofstream(path) << toml;
  return path;
}

TEST(LaunchCli, TheConfigsRestartBudgetIsObeyedAndTheFlagOverridesIt) {
  TempDir dir;
  const std::string config = write_config(dir, "[elastic]\nmax_restarts = 2\n");
  const std::string always_fails = "echo try $TORCHELASTIC_RESTART_COUNT; exit 1";
  LaunchResult r = run_launch(with_sh({"--nproc-per-node", "1", "--config", config}, always_fails));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] try 2")) << r.out;
  EXPECT_FALSE(contains(r.out, "try 3")) << r.out;
  EXPECT_TRUE(contains(r.err, "job failed after 2 restart(s)")) << r.err;

  r = run_launch(
      with_sh({"--nproc-per-node", "1", "--config", config, "--max-restarts", "1"}, always_fails));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] try 1")) << r.out;
  EXPECT_FALSE(contains(r.out, "try 2")) << r.out;
  EXPECT_TRUE(contains(r.err, "job failed after 1 restart(s)")) << r.err;

  // --set reaches the launcher's [elastic] too; the flag still wins over it.
  r = run_launch({"--nproc-per-node", "1", "--config", config, "--set", "elastic.max_restarts=5",
                  "--dry-run"});
  EXPECT_TRUE(contains(r.out, "max restarts   : 5")) << r.out;
  r = run_launch({"--nproc-per-node", "1", "--set", "elastic.max_restarts=5", "--max-restarts", "0",
                  "--dry-run"});
  EXPECT_TRUE(contains(r.out, "max restarts   : 0")) << r.out;
}

TEST(LaunchCli, AFlagStandingForAKeyIsCheckedAsTheKey) {
  LaunchResult r = run_launch(with_sh({"--monitor-interval", "0", "--standalone"}, "exit 0"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--monitor-interval 0")) << r.err;
  EXPECT_TRUE(contains(r.err, "elastic.heartbeat_interval_s")) << r.err;
  EXPECT_EQ(split_lines(r.err).size(), 1u) << r.err;
}

TEST(LaunchCli, TheConfigsNodeRangeMakesTheJobElasticUnlessNnodesSaysOtherwise) {
  TempDir dir;
  const std::string config = write_config(dir, "[elastic]\nmin_nodes = 1\nmax_nodes = 2\n");
  // 1..2 nodes is elastic (as --nnodes 1:2): it needs the coordinator's address.
  LaunchResult r = run_launch(with_sh({"--config", config}, "exit 0"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "an elastic job needs the coordinator's address")) << r.err;
  // --nnodes 1 overrides the range: one static node.
  r = run_launch(with_sh({"--config", config, "--nnodes", "1"}, "echo world=$WORLD_SIZE"));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] world=1")) << r.out;
}

TEST(LaunchCli, AnElasticJobTakesItsBudgetAndHeartbeatFromTheConfig) {
  TempDir dir;
  const std::string config =
      write_config(dir, "[elastic]\nmax_restarts = 1\nheartbeat_interval_s = 0.1\n");
  LaunchResult r = run_launch(with_sh({"--standalone", "--nproc-per-node", "1", "--config", config},
                                      "echo gen=$DNALLM_GENERATION; exit 1"),
                              {}, nullptr, std::chrono::seconds(30));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_TRUE(contains(r.err, "max restarts 1)")) << r.err;  // the hosted coordinator's log
  EXPECT_TRUE(contains(r.err, "max_restarts = 1 exhausted")) << r.err;
  EXPECT_TRUE(contains(r.out, "gen=2")) << r.out;
  EXPECT_FALSE(contains(r.out, "gen=3")) << r.out;
}

// dnallm-coordinator on a free loopback port with `args`; its stdout goes to `out_path` (the
// first line is "port N").
pid_t start_coordinator(const std::vector<std::string>& args, const std::string& out_path) {
  std::vector<std::string> argv_s = {std::string(DNALLM_BINARY_DIR) + "/bin/dnallm-coordinator",
                                     "--host", "127.0.0.1", "--port", "0"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = ::open((out_path + ".err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::setenv("DNALLM_JOB_TOKEN", "tok", 1);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// The coordinator's exit code, waiting at most `limit` (then it is killed: -1).
int wait_exit(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// One agent joins a dnallm-coordinator started with `args`; returns (agent, coordinator) exit
// codes and the agent's stderr.
std::tuple<int, int, std::string> one_agent_job(const TempDir& dir,
                                                const std::vector<std::string>& args) {
  static int jobs = 0;  // a file per job: an old one would name a port nobody serves
  const std::string out = dir.path() + "/coordinator" + std::to_string(++jobs) + ".out";
  const pid_t coordinator = start_coordinator(args, out);
  std::string port;
  for (int i = 0; i < 1000 && port.empty(); ++i) {
    const std::string text = testing::read_file(out);
    if (text.rfind("port ", 0) == 0 && text.find('\n') != std::string::npos) {
      port = text.substr(5, text.find('\n') - 5);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_FALSE(port.empty()) << testing::read_file(out + ".err");
  LaunchResult agent = run_launch(
      with_sh({"--rdzv-endpoint", "127.0.0.1:" + port, "--monitor-interval", "0.1"}, "exit 0"),
      {"DNALLM_JOB_TOKEN=tok"}, nullptr, std::chrono::seconds(30));
  return {agent.exit_code, wait_exit(coordinator, std::chrono::seconds(20)), agent.err};
}

TEST(LaunchCli, AStandaloneCoordinatorReadsElasticFromTheConfigAndFlagsOverrideIt) {
  TempDir dir;
  const std::string config = write_config(
      dir, "[elastic]\nmin_nodes = 2\nmax_nodes = 2\njoin_timeout_s = 1\nsettle_s = 0.1\n");
  // Two nodes wanted, one joins: after join_timeout_s the job fails.
  auto [agent, coordinator, err] = one_agent_job(dir, {"--config", config});
  EXPECT_EQ(agent, 4) << err;
  EXPECT_EQ(coordinator, 4);
  EXPECT_TRUE(contains(err, "only 1 of at least 2 nodes joined within 1 s")) << err;
  // --min-nodes 1 overrides the configuration: the one node runs the job.
  std::tie(agent, coordinator, err) = one_agent_job(dir, {"--config", config, "--min-nodes", "1"});
  EXPECT_EQ(agent, 0) << err;
  EXPECT_EQ(coordinator, 0);
}

TEST(LaunchCli, WorkersAgreeingOnBadDataGiveExitCodeThree) {
  LaunchResult r = run_launch(
      with_sh({"--nproc-per-node", "2", "--max-restarts", "2"}, "echo bad record >&2; exit 3"));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_FALSE(contains(r.err, "restarting")) << r.err;
}

TEST(LaunchCli, DefaultCommandIsDnallmTrainWithPassThroughOptions) {
  TempDir dir;
  const std::string config = dir.path() + "/run.toml";
  { std::ofstream(config) << "# defaults only\n"; }
  LaunchResult r =
      run_launch({"--nproc-per-node", "1", "--config", config, "--set", "training.max_steps=5",
                  "--metrics-file", "m.jsonl", "--log-level", "warn", "--dry-run"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "/bin/dnallm-train --config " + config +
                                  " --set training.max_steps=5 --metrics-file m.jsonl "
                                  "--log-level warn\n"))
      << r.out;
}

TEST(LaunchCli, AutoNprocFollowsCudaVisibleDevices) {
  LaunchResult r = run_launch({"--nproc-per-node", "auto", "--", "/bin/sh", "-c", "echo $RANK"},
                              {"CUDA_VISIBLE_DEVICES=0,1,2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = split_lines(r.out);
  std::sort(lines.begin(), lines.end());
  EXPECT_EQ(lines, (std::vector<std::string>{"[rank 0] 0", "[rank 1] 1", "[rank 2] 2"}));
}

TEST(LaunchCli, StaticNodePlacementNumbersRanksAcrossNodes) {
  LaunchResult r = run_launch(with_sh(
      {"--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "1", "--master-addr", "head",
       "--master-port", "29400"},
      "echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR:$MASTER_PORT\""));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 2] R=2 L=0 W=6 G=1 A=head:29400\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "[rank 3] R=3 L=1 W=6 G=1 A=head:29400\n")) << r.out;
}

TEST(LaunchCli, SeveralNodesNeedAnAgreedCoordinator) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--nnodes", "2", "--master-port", "29400", "--", "/bin/true"},
           {"--nnodes", "2", "--master-addr", "head", "--", "/bin/true"},
           {"--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1", "--",
            "/bin/true"},
           {"--nnodes", "2", "--master-addr", "h", "--master-port", "1", "--max-restarts", "1",
            "--", "/bin/true"}}) {
    LaunchResult r = run_launch(args);
    EXPECT_EQ(r.exit_code, 2) << args[1] << " " << args[2] << ": " << r.err;
    EXPECT_EQ(split_lines(r.err).size(), 1u) << r.err;
  }
}

TEST(LaunchCli, DryRunUnderASlurmStep) {
  LaunchResult r = run_launch(
      {"--nproc-per-node", "4", "--dry-run", "--", "/bin/true"},
      {"SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_NODEID=1", "SLURM_LOCALID=0",
       "SLURM_STEP_NODELIST=gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE=1(x2)", "SLURM_JOB_ID=123456"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* needle :
       {"nodes          : 2 (this node: rank 1; from slurm)", "hosts          : gpu[07-08]",
        "world size     : 8", "ranks here     : 4..7",
        "coordinator    : gpu07:23456 (port from the Slurm job id)", "run id         : 123456"}) {
    EXPECT_TRUE(contains(r.out, needle)) << needle << " in\n" << r.out;
  }
}

}  // namespace
}  // namespace dnallm::launcher
