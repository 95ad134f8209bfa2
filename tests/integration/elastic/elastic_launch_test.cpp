// Elastic jobs end to end: two (or three) dnallm-launch agents on loopback form one job;
// workers are /bin/sh scripts that print their environment, write pid and progress files,
// sleep and exit with chosen codes. Every wait is bounded; every expected value is exact.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "coordinator/protocol.hpp"
#include "tests/integration/elastic/agent_process.hpp"
#include "tests/support/process.hpp"

namespace dnallm::elastic_testing {
namespace {

using namespace std::chrono_literals;

using dnallm::testing::kBin;
using dnallm::testing::kSrc;

std::string launch_binary() { return kBin + "dnallm-launch"; }

std::string host_name() {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// Both agents of a job that ended with `code`: each exits with it, and each one's stderr has
// every one of `needles` (the root cause, what ended the job, the worker's last lines).
void expect_both_exit_naming(AgentProcess& a, AgentProcess& b, int code,
                             const std::vector<std::string>& needles) {
  EXPECT_EQ(a.wait(30s), code) << a.log();
  EXPECT_EQ(b.wait(30s), code) << b.log();
  for (AgentProcess* p : {&a, &b}) {
    const std::string err = p->err();
    for (const std::string& needle : needles) {
      EXPECT_TRUE(contains(err, needle)) << "no \"" << needle << "\" in\n" << err;
    }
  }
}

// Every worker prints this line first.
const char* kEnvLine =
    "echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE G=$GROUP_RANK N=$GROUP_WORLD_SIZE "
    "gen=$DNALLM_GENERATION rc=$TORCHELASTIC_RESTART_COUNT ext=$DNALLM_EXTERNAL_COORDINATOR\"; "
    "echo $$ > $T/pid_g${DNALLM_GENERATION}_r$RANK; ";

class ElasticLaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dnallm-elastic-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    port_ = free_port();
  }
  void TearDown() override {
    agents_.clear();  // kills what still runs
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // Starts an agent of a two-node job on 127.0.0.1:port_. `script`: the worker's sh script.
  AgentProcess& agent(const std::string& name, int node_rank, const std::string& nnodes,
                      const std::string& script, std::vector<std::string> extra = {},
                      const std::string& token = "tok") {
    std::vector<std::string> argv = {launch_binary(),
                                     "--nnodes",
                                     nnodes,
                                     "--nproc-per-node",
                                     "2",
                                     "--rdzv-endpoint",
                                     "127.0.0.1:" + std::to_string(port_),
                                     "--rdzv-id",
                                     "test",
                                     "--node-rank",
                                     std::to_string(node_rank),
                                     "--node-id",
                                     name,
                                     "--monitor-interval",
                                     "0.1",
                                     "--rdzv-settle",
                                     "0.3",
                                     "--heartbeat-timeout",
                                     "3",
                                     "--grace-period",
                                     "1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), {"--", "/bin/sh", "-c", script});
    agents_.push_back(std::make_unique<AgentProcess>(
        argv, std::vector<std::string>{"DNALLM_JOB_TOKEN=" + token, "T=" + dir_},
        dir_ + "/" + name));
    return *agents_.back();
  }
  // The agents a (node rank 0, with `a_extra`) and b (node rank 1) of a two-node job running
  // `script`.
  std::pair<AgentProcess&, AgentProcess&> two_agents(const std::string& script,
                                                     std::vector<std::string> a_extra = {}) {
    AgentProcess& a = agent("a", 0, "2", script, std::move(a_extra));
    return {a, agent("b", 1, "2", script)};
  }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  pid_t read_pid(const std::string& name) const { return std::atoi(slurp(file(name)).c_str()); }

  std::string dir_;
  int port_ = 0;
  std::vector<std::unique_ptr<AgentProcess>> agents_;
};

TEST_F(ElasticLaunchTest, TwoAgentsFormOneJobOfWorldFour) {
  const std::string script = std::string(kEnvLine) + "exit 0";
  auto [a, b] = two_agents(script);
  ASSERT_EQ(a.wait(30s), 0) << a.log();
  ASSERT_EQ(b.wait(30s), 0) << b.log();
  // Node ranks follow the join order of the first round: either agent may be node 0.
  const bool a_first = contains(a.out(), "G=0");
  AgentProcess& n0 = a_first ? a : b;
  AgentProcess& n1 = a_first ? b : a;
  EXPECT_TRUE(contains(n0.out(), "[rank 0] R=0 L=0 W=4 G=0 N=2 gen=1 rc=0 ext=1\n")) << n0.out();
  EXPECT_TRUE(contains(n0.out(), "[rank 1] R=1 L=1 W=4 G=0 N=2 gen=1 rc=0 ext=1\n")) << n0.out();
  EXPECT_TRUE(contains(n1.out(), "[rank 2] R=2 L=0 W=4 G=1 N=2 gen=1 rc=0 ext=1\n")) << n1.out();
  EXPECT_TRUE(contains(n1.out(), "[rank 3] R=3 L=1 W=4 G=1 N=2 gen=1 rc=0 ext=1\n")) << n1.out();
}

// Generation 1 waits for a kill; generation 2 finishes. Returns the recovery time: the kill
// to the moment the last restarted worker was running.
double kill_one_worker_and_recover(ElasticLaunchTest* t, AgentProcess& a, AgentProcess& b,
                                   const std::string& dir) {
  (void)t;
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(wait_for_file(dir + "/pid_g1_r" + std::to_string(r), 20s)) << a.log() << b.log();
  }
  std::this_thread::sleep_for(200ms);  // every worker is in its sleep
  const pid_t victim = std::atoi(slurp(dir + "/pid_g1_r3").c_str());
  struct timespec killed_at {};
  ::clock_gettime(CLOCK_REALTIME, &killed_at);
  EXPECT_EQ(::kill(victim, SIGKILL), 0);
  EXPECT_EQ(a.wait(30s), 0) << a.log();
  EXPECT_EQ(b.wait(30s), 0) << b.log();
  double last_start = 0;
  for (int r = 0; r < 4; ++r) {
    last_start =
        std::max(last_start, std::atof(slurp(dir + "/start_g2_r" + std::to_string(r)).c_str()));
  }
  return last_start - (static_cast<double>(killed_at.tv_sec) + killed_at.tv_nsec * 1e-9);
}

const char* kKillScript =
    "if [ \"$DNALLM_GENERATION\" = 1 ]; then exec sleep 30; fi; "
    "date +%s.%N > $T/start_g${DNALLM_GENERATION}_r$RANK; echo finished; exit 0";

TEST_F(ElasticLaunchTest, KilledWorkerRestartsTheWholeGroupAsGenerationTwo) {
  const std::string script = std::string(kEnvLine) + kKillScript;
  auto [a, b] = two_agents(script, {"--max-restarts", "1"});
  double recovery = kill_one_worker_and_recover(this, a, b, dir_);
  const bool a_first = contains(a.out(), "G=0");
  for (int r = 0; r < 4; ++r) {
    // Generation 2 keeps generation 1's node order.
    AgentProcess& owner = (r < 2) == a_first ? a : b;
    EXPECT_TRUE(contains(owner.out(), "[rank " + std::to_string(r) + "] R=" + std::to_string(r)))
        << owner.out();
    EXPECT_TRUE(contains(owner.out(), "W=4 G=" + std::to_string(r / 2) + " N=2 gen=2 rc=1"))
        << owner.out();
  }
  EXPECT_EQ(count(a.out() + b.out(), "finished"), 4);
  EXPECT_TRUE(contains(a.err(), "rank 3 on " + host_name() + ": killed by SIGKILL")) << a.err();
  EXPECT_EQ(count(a.out() + b.out(), "gen=3"), 0);
  std::printf("recovery time (worker SIGKILLed -> 4 restarted workers running): %.3f s\n",
              recovery);
}

TEST_F(ElasticLaunchTest, KilledAgentLeavesTheSurvivorRunningAtWorldTwo) {
  const std::string script =
      std::string(kEnvLine) + "if [ \"$DNALLM_GENERATION\" = 1 ]; then exec sleep 30; fi; exit 0";
  AgentProcess& a = agent("a", 0, "1:2", script);
  AgentProcess& b = agent("b", 1, "1:2", script);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(wait_for_file(file("pid_g1_r" + std::to_string(r)), 20s)) << a.log() << b.log();
  }
  ::kill(b.pid(), SIGKILL);
  EXPECT_EQ(b.wait(5s), 128 + SIGKILL);
  ASSERT_EQ(a.wait(30s), 0) << a.log();
  EXPECT_TRUE(contains(a.out(), "[rank 0] R=0 L=0 W=2 G=0 N=1 gen=2 rc=1 ext=1\n")) << a.out();
  EXPECT_TRUE(contains(a.out(), "[rank 1] R=1 L=1 W=2 G=0 N=1 gen=2 rc=1 ext=1\n")) << a.out();
  EXPECT_TRUE(contains(a.err(), "node " + host_name() + ": no heartbeat")) << a.err();
}

TEST_F(ElasticLaunchTest, LosingTheHostingAgentFailsTheOthersWithExitFour) {
  const std::string script = std::string(kEnvLine) + "exec sleep 30";
  auto [a, b] = two_agents(script);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(wait_for_file(file("pid_g1_r" + std::to_string(r)), 20s)) << a.log() << b.log();
  }
  ::kill(a.pid(), SIGKILL);  // the coordinator dies with it
  EXPECT_EQ(a.wait(5s), 128 + SIGKILL);
  EXPECT_EQ(b.wait(20s), 4) << b.log();
  EXPECT_TRUE(contains(b.err(), "coordinator 127.0.0.1:" + std::to_string(port_))) << b.err();
  // No worker is left behind (a's died with it, b stopped its own); a's are reaped by
  // init, so allow it a moment.
  for (int r = 0; r < 4; ++r) {
    const pid_t pid = read_pid("pid_g1_r" + std::to_string(r));
    auto deadline = std::chrono::steady_clock::now() + 3s;
    while (::kill(pid, 0) == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(20ms);
    }
    EXPECT_NE(::kill(pid, 0), 0) << "rank " << r << " (pid " << pid << ") still exists";
  }
}

TEST_F(ElasticLaunchTest, LateAgentIsAdmittedAtTheNextRound) {
  const std::string script =
      std::string(kEnvLine) + "if [ \"$DNALLM_GENERATION\" = 1 ]; then exec sleep 30; fi; exit 0";
  AgentProcess& a = agent("a", 0, "1:2", script);
  ASSERT_TRUE(wait_for_file(file("pid_g1_r1"), 20s)) << a.log();
  EXPECT_TRUE(contains(a.out(), "W=2 G=0 N=1 gen=1")) << a.out();
  AgentProcess& b = agent("b", 1, "1:2", script);
  ASSERT_EQ(a.wait(30s), 0) << a.log();
  ASSERT_EQ(b.wait(30s), 0) << b.log();
  EXPECT_TRUE(contains(a.out(), "[rank 1] R=1 L=1 W=4 G=0 N=2 gen=2 rc=1 ext=1\n")) << a.out();
  EXPECT_TRUE(contains(b.out(), "[rank 3] R=3 L=1 W=4 G=1 N=2 gen=2 rc=1 ext=1\n")) << b.out();
  EXPECT_TRUE(contains(a.err(), "joined late")) << a.err();
}

TEST_F(ElasticLaunchTest, StoppedWorkerIsReportedAsAHangNamingRankAndHost) {
  // Workers advance a step every 0.1 s; rank 2 is SIGSTOPped. No restart is allowed, so the
  // hang ends the job and both agents print the root cause.
  const std::string script =
      std::string(kEnvLine) +
      "i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo $i > $DNALLM_PROGRESS_FILE; sleep 0.1; "
      "done; exit 0";
  auto [a, b] = two_agents(script, {"--hang-timeout", "2", "--max-restarts", "0"});
  ASSERT_TRUE(wait_for_file(file("pid_g1_r2"), 20s)) << a.log() << b.log();
  std::this_thread::sleep_for(500ms);
  ASSERT_EQ(::kill(read_pid("pid_g1_r2"), SIGSTOP), 0);
  expect_both_exit_naming(
      a, b, 4,
      {"root cause: rank 2 on " + host_name() + ": no progress for", "max_restarts = 0 exhausted"});
}

TEST_F(ElasticLaunchTest, WrongTokenAndGarbageFramesAreRefusedAndTheJobIsUnaffected) {
  const std::string script =
      std::string(kEnvLine) + "while [ ! -e $T/go ]; do sleep 0.05; done; echo done; exit 0";
  auto [a, b] = two_agents(script);
  ASSERT_TRUE(wait_for_file(file("pid_g1_r3"), 20s)) << a.log() << b.log();
  AgentProcess& intruder = agent("intruder", 1, "2", "exit 0", {}, "wrong");
  EXPECT_EQ(intruder.wait(20s), 2) << intruder.log();
  EXPECT_TRUE(contains(intruder.err(), "token")) << intruder.err();
  auto raw = [&](const std::vector<uint8_t>& bytes) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port_));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[64];
    while (::recv(fd, buf, sizeof(buf), 0) > 0) {
    }  // until the server closes it
    ::close(fd);
  };
  raw({0xde, 0xad, 0xbe, 0xef, 0x00, 0x01, 0x02});  // garbage, no HELLO
  using coordinator::FrameWriter;
  using coordinator::Op;
  std::vector<uint8_t> oversized = FrameWriter()
                                       .u8(static_cast<uint8_t>(Op::kHello))
                                       .u32(coordinator::kProtocolVersion)
                                       .str("tok")
                                       .frame();
  for (uint8_t byte : {0xff, 0xff, 0xff, 0x7f, 0x20}) oversized.push_back(byte);
  raw(oversized);  // authenticated, then a 2 GiB frame
  std::ofstream(file("go")) << "1";
  ASSERT_EQ(a.wait(30s), 0) << a.log();
  ASSERT_EQ(b.wait(30s), 0) << b.log();
  EXPECT_EQ(count(a.out() + b.out(), "done"), 4);
  EXPECT_EQ(count(a.out() + b.out(), "gen=2"), 0);  // nothing restarted
  EXPECT_TRUE(contains(a.err(), "wrong job token")) << a.err();
  EXPECT_TRUE(contains(a.err(), "rejected")) << a.err();
}

TEST_F(ElasticLaunchTest, ExhaustedRestartBudgetExitsFourWithTheRootCause) {
  const std::string script = std::string(kEnvLine) +
                             "if [ $RANK = 2 ]; then echo \"loading shard 2\"; "
                             "echo \"fatal: disk quota exceeded\" >&2; exit 7; fi; exec sleep 30";
  auto [a, b] = two_agents(script, {"--max-restarts", "1"});
  expect_both_exit_naming(a, b, 4,
                          {"root cause: rank 2 on " + host_name() + ": exited with code 7",
                           "max_restarts = 1 exhausted", "generation 2",
                           "fatal: disk quota exceeded", "loading shard 2"});
}

TEST_F(ElasticLaunchTest, BadDataExitOfOneWorkerEndsTheJobWithItsCodeAndNoRestart) {
  const std::string script = std::string(kEnvLine) +
                             "if [ $RANK = 1 ]; then echo \"bad record at line 3\" >&2; exit 3; "
                             "fi; exec sleep 30";
  auto [a, b] = two_agents(script, {"--max-restarts", "3"});
  expect_both_exit_naming(
      a, b, 3, {"rank 1 on " + host_name() + ": exited with code 3", "bad record at line 3"});
  EXPECT_EQ(count(a.out() + b.out(), "gen=2"), 0);
}

TEST_F(ElasticLaunchTest, StandaloneCoordinatorServesAgentsAndExitsWithTheJob) {
  AgentProcess coordinator(
      {kBin + "dnallm-coordinator", "--host", "127.0.0.1", "--port", "0", "--min-nodes", "2",
       "--max-nodes", "2", "--rdzv-settle", "0.3", "--heartbeat-timeout", "3"},
      {"DNALLM_JOB_TOKEN=tok"}, file("coordinator"));
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!contains(coordinator.out(), "\n") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(coordinator.out().rfind("port ", 0), 0u) << coordinator.log();
  port_ = std::atoi(coordinator.out().c_str() + 5);
  // Without --node-rank (and outside Slurm) an agent joins and hosts nothing.
  const std::string script = std::string(kEnvLine) + "exit 0";
  std::vector<std::string> common = {launch_binary(),
                                     "--nnodes",
                                     "2",
                                     "--nproc-per-node",
                                     "2",
                                     "--rdzv-endpoint",
                                     "127.0.0.1:" + std::to_string(port_),
                                     "--monitor-interval",
                                     "0.1",
                                     "--",
                                     "/bin/sh",
                                     "-c",
                                     script};
  AgentProcess a(common, {"DNALLM_JOB_TOKEN=tok", "T=" + dir_}, file("a"));
  AgentProcess b(common, {"DNALLM_JOB_TOKEN=tok", "T=" + dir_}, file("b"));
  ASSERT_EQ(a.wait(30s), 0) << a.log();
  ASSERT_EQ(b.wait(30s), 0) << b.log();
  EXPECT_EQ(count(a.out() + b.out(), " W=4 "), 4) << a.out() << b.out();
  EXPECT_EQ(coordinator.wait(15s), 0) << coordinator.log();
  EXPECT_TRUE(contains(coordinator.err(), "all 2 nodes finished")) << coordinator.err();
}

// Whether a TCP connection to address:port is accepted.
bool accepts(const std::string& address, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, address.c_str(), &a.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A loopback address other than `address` (every 127/8 address reaches this host, but a
// socket bound to one of them accepts on that one only).
std::string other_loopback(const std::string& address) {
  return address == "127.0.0.2"          ? "127.0.0.3"
         : address.rfind("127.", 0) == 0 ? "127.0.0.2"
                                         : "127.0.0.1";
}

// Waits for "<needle>HOST:PORT" in the agent's or coordinator's stderr; returns HOST, PORT.
std::pair<std::string, int> bound_address(AgentProcess& p, const std::string& needle) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string err = p.err();
    const auto at = err.find(needle);
    const auto colon = at == std::string::npos ? at : err.find(':', at + needle.size());
    const auto end =
        colon == std::string::npos ? colon : err.find_first_not_of("0123456789", colon + 1);
    if (end != std::string::npos) {
      return {err.substr(at + needle.size(), colon - at - needle.size()),
              std::atoi(err.c_str() + colon + 1)};
    }
    std::this_thread::sleep_for(10ms);
  }
  ADD_FAILURE() << "no '" << needle << "' in the log:\n" << p.log();
  return {"", 0};
}

TEST_F(ElasticLaunchTest, HostingAgentBindsTheEndpointHostOnly) {
  // Node rank 0 of an endpoint on 127.0.0.2: the coordinator listens there and nowhere else.
  AgentProcess a({launch_binary(), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint",
                  "127.0.0.2:" + std::to_string(port_), "--node-rank", "0", "--rdzv-settle", "0.1",
                  "--", "/bin/sh", "-c", "echo \"M=$MASTER_ADDR\"; sleep 2"},
                 {"DNALLM_JOB_TOKEN=tok"}, file("a"));
  const auto [host, port] = bound_address(a, "coordinator: store listening on ");
  EXPECT_EQ(host, "127.0.0.2");
  EXPECT_EQ(port, port_);
  EXPECT_TRUE(accepts("127.0.0.2", port_));
  EXPECT_FALSE(accepts("127.0.0.1", port_)) << "the coordinator listens beyond its address";
  EXPECT_TRUE(contains(a.err(), "hosting the coordinator on 127.0.0.2:")) << a.err();
  ASSERT_EQ(a.wait(30s), 0) << a.log();
  EXPECT_TRUE(contains(a.out(), "M=127.0.0.2")) << a.out();
}

TEST_F(ElasticLaunchTest, StandaloneCoordinatorWithoutHostBindsThisHostsAddressNotEveryInterface) {
  AgentProcess coordinator(
      {kBin + "dnallm-coordinator", "--port", "0", "--min-nodes", "1", "--max-nodes", "1"},
      {"DNALLM_JOB_TOKEN=tok", "MASTER_ADDR="}, file("coordinator"));
  const auto [host, port] = bound_address(coordinator, "coordinator: store listening on ");
  EXPECT_NE(host, "0.0.0.0");
  EXPECT_FALSE(host.empty());
  EXPECT_TRUE(accepts(host, port)) << host << ":" << port;
  EXPECT_FALSE(accepts(other_loopback(host), port)) << "listening on every interface";
  EXPECT_TRUE(contains(coordinator.err(), "binding " + host) ||
              contains(coordinator.err(), "listening on 127.0.0.1 only"))
      << coordinator.err();
  ::kill(coordinator.pid(), SIGTERM);
  EXPECT_EQ(coordinator.wait(15s), 0) << coordinator.log();
}

TEST_F(ElasticLaunchTest, MultiNodeJobsNeedASharedTokenAndAnEndpoint) {
  const std::string ep = "127.0.0.1:" + std::to_string(port_);
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> env;
    const char* needle;
  };
  for (const Case& c : std::vector<Case>{
           {{"--nnodes", "2", "--rdzv-endpoint", ep}, {"DNALLM_JOB_TOKEN="}, "DNALLM_JOB_TOKEN"},
           {{"--nnodes", "1:2", "--rdzv-id", "x"}, {"DNALLM_JOB_TOKEN=t"}, "--rdzv-endpoint"},
           {{"--nnodes", "3:2", "--rdzv-endpoint", ep}, {"DNALLM_JOB_TOKEN=t"}, "MIN"},
           {{"--rdzv-endpoint", "nohost"}, {"DNALLM_JOB_TOKEN=t"}, "HOST:PORT"},
           {{"--rdzv-endpoint", ep, "--token-file", dir_ + "/missing"}, {}, "--token-file"}}) {
    std::vector<std::string> argv = {launch_binary()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    argv.insert(argv.end(), {"--", "/bin/true"});
    AgentProcess p(argv, c.env, file("usage"));
    EXPECT_EQ(p.wait(10s), 2) << c.args[1] << ": " << p.log();
    EXPECT_TRUE(contains(p.err(), c.needle)) << p.err();
  }
}

// Two network namespaces joined by a veth pair, 10.77.0.1/24 and 10.77.0.2/24 (only
// inside the namespaces this test creates, deleted in its teardown): the agents talk over
// a real (virtual) link instead of loopback.
class ElasticNetnsTest : public ElasticLaunchTest {
 protected:
  void SetUp() override {
    ElasticLaunchTest::SetUp();
    if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
    if (::access("/usr/sbin/ip", X_OK) != 0 && ::access("/sbin/ip", X_OK) != 0) {
      GTEST_SKIP() << "the ip command (iproute2) is missing";
    }
    ip_ = ::access("/usr/sbin/ip", X_OK) == 0 ? "/usr/sbin/ip" : "/sbin/ip";
    const std::string id = std::to_string(::getpid());
    ns_a_ = "dnallm-ea-" + id;
    ns_b_ = "dnallm-eb-" + id;
    const std::string veth_a = "dnea" + id, veth_b = "dneb" + id;
    for (const std::string& cmd :
         {ip_ + " netns add " + ns_a_, ip_ + " netns add " + ns_b_,
          ip_ + " link add " + veth_a + " type veth peer name " + veth_b,
          ip_ + " link set " + veth_a + " netns " + ns_a_,
          ip_ + " link set " + veth_b + " netns " + ns_b_,
          ip_ + " -n " + ns_a_ + " addr add 10.77.0.1/24 dev " + veth_a,
          ip_ + " -n " + ns_b_ + " addr add 10.77.0.2/24 dev " + veth_b,
          ip_ + " -n " + ns_a_ + " link set " + veth_a + " up",
          ip_ + " -n " + ns_b_ + " link set " + veth_b + " up",
          ip_ + " -n " + ns_a_ + " link set lo up", ip_ + " -n " + ns_b_ + " link set lo up"}) {
      ASSERT_EQ(std::system((cmd + " 2>&1").c_str()), 0) << cmd;
    }
  }
  void TearDown() override {
    ElasticLaunchTest::TearDown();
    // Deleting a namespace deletes the veth end inside it, and with it the pair.
    if (!ns_a_.empty()) std::system((ip_ + " netns del " + ns_a_ + " 2>/dev/null").c_str());
    if (!ns_b_.empty()) std::system((ip_ + " netns del " + ns_b_ + " 2>/dev/null").c_str());
  }
  AgentProcess& agent_in(const std::string& ns, const std::string& name,
                         std::vector<std::string> args, const std::string& script) {
    std::vector<std::string> argv = {ip_, "netns", "exec", ns, launch_binary()};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--", "/bin/sh", "-c", script});
    agents_.push_back(std::make_unique<AgentProcess>(
        argv, std::vector<std::string>{"DNALLM_JOB_TOKEN=tok", "T=" + dir_}, file(name)));
    return *agents_.back();
  }
  std::string ip_, ns_a_, ns_b_;
};

TEST_F(ElasticNetnsTest, TwoNodesOverAVethLinkRecoverFromAKilledWorker) {
  std::vector<std::string> common = {
      "--nnodes",           "2",   "--nproc-per-node", "2",   "--rdzv-endpoint", "10.77.0.1:29400",
      "--monitor-interval", "0.1", "--rdzv-settle",    "0.3", "--grace-period",  "1"};
  std::vector<std::string> a_args = common;
  a_args.insert(a_args.end(), {"--node-rank", "0", "--max-restarts", "1"});
  const std::string script =
      std::string(kEnvLine) + "echo \"M=$MASTER_ADDR:$MASTER_PORT\"; " + kKillScript;
  AgentProcess& a = agent_in(ns_a_, "a", a_args, script);
  AgentProcess& b = agent_in(ns_b_, "b", common, script);
  double recovery = kill_one_worker_and_recover(this, a, b, dir_);
  EXPECT_EQ(count(a.out() + b.out(), "gen=2"), 4) << a.out() << b.out();
  EXPECT_EQ(count(a.out() + b.out(), "M=10.77.0.1:29400"), 8) << a.out() << b.out();
  EXPECT_EQ(count(a.out() + b.out(), "finished"), 4);
  std::printf("recovery time over veth: %.3f s\n", recovery);
}

// The same two namespaces, real dnallm-train workers: 4 ranks over Gloo across the veth
// link (rank 0's coordinator store on 10.77.0.1, Gloo pairs between 10.77.0.1 and
// 10.77.0.2) train a tiny model to the end, and rank 0's metrics report world size 4.
TEST_F(ElasticNetnsTest, TwoNodesOverAVethLinkTrainWithGloo) {
  std::vector<std::string> common = {
      "--nnodes",           "2",   "--nproc-per-node", "2",   "--rdzv-endpoint", "10.77.0.1:29400",
      "--monitor-interval", "0.1", "--rdzv-settle",    "0.3", "--grace-period",  "1"};
  std::vector<std::string> a_args = common;
  a_args.insert(a_args.end(), {"--node-rank", "0"});
  const std::string metrics = file("metrics.jsonl");
  const std::string script = fmt::format(
      "cd {src} && exec {bin}dnallm-train --set model.hidden=32 --set model.layers=1 "
      "--set model.heads=2 --set model.ffn=64 --set model.max_seq_length=64 "
      "--set 'data.train_files=[\"data/ecoli_k12_mg1655.fa.gz\"]' --set training.max_steps=6 "
      "--set training.micro_batch_size=3 --set training.logging_steps=1 "
      "--set parallel.backend=gloo --set checkpoint.dir={dir}/ckpt --set checkpoint.save_steps=3 "
      "--metrics-file {metrics}",
      fmt::arg("src", kSrc), fmt::arg("bin", kBin), fmt::arg("dir", dir_),
      fmt::arg("metrics", metrics));
  AgentProcess& a = agent_in(ns_a_, "a", a_args, script);
  AgentProcess& b = agent_in(ns_b_, "b", common, script);
  ASSERT_EQ(a.wait(90s), 0) << a.log() << b.log();
  ASSERT_EQ(b.wait(30s), 0) << b.log();
  const std::string m = slurp(metrics);
  for (int step = 1; step <= 6; ++step) {
    EXPECT_TRUE(contains(m, fmt::format("{{\"step\":{},\"loss\":", step))) << step << "\n" << m;
  }
  EXPECT_TRUE(contains(m, "\"event\":\"summary\"")) << m;
  EXPECT_TRUE(contains(m, "\"world_size\":4")) << m;
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ckpt/step_000000006/manifest.json")) << a.log();
}

}  // namespace
}  // namespace dnallm::elastic_testing
