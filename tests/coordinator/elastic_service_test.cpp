// The elastic service over real TCP on loopback: ElasticClient <-> StoreServer +
// ElasticService, including the ticker thread (dead and hung nodes found without messages)
// and hostile clients on raw sockets.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include <gtest/gtest.h>

#include "coordinator/elastic_client.hpp"
#include "coordinator/elastic_service.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"
#include "expect_assignment.hpp"
#include "raw_socket.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::coordinator {
namespace {

using dnallm::testing::expect_error;

using namespace std::chrono_literals;

class ElasticServiceTest : public ::testing::Test {
 protected:
  void start(ElasticOptions state, std::chrono::milliseconds tick = 20ms) {
    StoreServerOptions so;
    so.host = "127.0.0.1";
    so.token = "secret";
    so.max_frame_bytes = 4096;
    server_ = std::make_unique<StoreServer>(so);
    ElasticServiceOptions eo;
    eo.state = state;
    eo.tick = tick;
    service_ = std::make_unique<ElasticService>(*server_, eo);
    server_->start();
    service_->start();
  }
  void TearDown() override {
    if (service_) service_->stop();
    if (server_) server_->stop();
    if (service_) service_->join();
    if (server_) server_->join();
  }
  TcpStoreClientOptions client_options(const std::string& token = "secret") const {
    TcpStoreClientOptions o;
    o.port = server_->port();
    o.token = token;
    o.connect_timeout = 5s;
    o.op_timeout = 5s;
    return o;
  }
  std::unique_ptr<ElasticClient> client(const std::string& token = "secret") {
    return std::make_unique<ElasticClient>(client_options(token));
  }
  static ElasticOptions two_nodes() {
    ElasticOptions o;
    o.min_nodes = 2;
    o.max_nodes = 2;
    o.settle = 100ms;
    return o;
  }
  // Polls join() until this node has an assignment newer than `known`.
  static JobView wait_assignment(ElasticClient& c, const NodeInfo& n, int64_t known) {
    auto deadline = std::chrono::steady_clock::now() + 5s;
    while (true) {
      JobView v = c.join(n, known);
      if (v.assignment && v.assignment->generation > known) return v;
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << n.node_id << " got no assignment";
        return v;
      }
      std::this_thread::sleep_for(10ms);
    }
  }
  // Starts the service with `state`, and a and b join and are both assigned generation 1.
  std::pair<std::unique_ptr<ElasticClient>, std::unique_ptr<ElasticClient>> start_generation_one(
      ElasticOptions state = two_nodes()) {
    start(state);
    auto ca = client();
    auto cb = client();
    ca->join(a_, 0);
    cb->join(b_, 0);
    wait_assignment(*ca, a_, 0);
    wait_assignment(*cb, b_, 0);
    return {std::move(ca), std::move(cb)};
  }
  // A failure of `rank` on `node` in generation 1 (the fields each test adds: its cause).
  static FailureReport failure_of(const NodeInfo& node, int rank) {
    FailureReport f;
    f.node_id = node.node_id;
    f.host = node.host;
    f.rank = rank;
    f.generation = 1;
    return f;
  }
  const NodeInfo a_{"a", "hosta", 2};
  const NodeInfo b_{"b", "hostb", 2};
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<ElasticService> service_;
};

TEST_F(ElasticServiceTest, TwoAgentsFormOneGenerationOfWorldFour) {
  start(two_nodes());
  auto ca = client();
  auto cb = client();
  JobView first = ca->join(a_, 0);
  EXPECT_EQ(first.phase, JobPhase::kRendezvous);
  EXPECT_FALSE(first.assignment);
  cb->join(b_, 0);
  JobView va = wait_assignment(*ca, a_, 0);
  JobView vb = wait_assignment(*cb, b_, 0);
  ASSERT_TRUE(va.assignment && vb.assignment);
  EXPECT_EQ(va.phase, JobPhase::kRunning);
  NodeAssignment want{.generation = 1,
                      .node_rank = 0,
                      .nnodes = 2,
                      .world_size = 4,
                      .rank_offset = 0,
                      .local_world_size = 2};
  testing::expect_assignment(*va.assignment, want);
  want.node_rank = 1;
  want.rank_offset = 2;  // after a's 2 ranks
  testing::expect_assignment(*vb.assignment, want);
  // A poll-join by a member that already knows generation 1 would be a rejoin; one that
  // does not yet know it is only a poll and leaves the generation running.
  JobView again = ca->join(a_, 0);
  EXPECT_EQ(again.phase, JobPhase::kRunning);
  EXPECT_EQ(again.generation, 1);
  EXPECT_EQ(again.membership_changes_used, 0);
}

TEST_F(ElasticServiceTest, FailureOpensTheNextGenerationWhichBothRejoin) {
  auto [ca, cb] = start_generation_one();
  ca->heartbeat("a", 1, {5, 6});
  FailureReport f = failure_of(a_, 1);
  f.signal = 9;
  f.reason = "worker died";
  JobView v = ca->report_failure(f);
  EXPECT_EQ(v.phase, JobPhase::kRendezvous);
  EXPECT_EQ(v.generation_open, 2);
  EXPECT_EQ(v.restarts_used, 1);
  EXPECT_NE(v.round_reason.find("rank 1 on hosta: killed by SIGKILL"), std::string::npos)
      << v.round_reason;
  // The same report again (a retry) is stale now and costs nothing.
  EXPECT_EQ(cb->report_failure(f).restarts_used, 1);
  EXPECT_EQ(cb->state("b").generation_open, 2);
  ca->join(a_, 1);
  cb->join(b_, 1);
  JobView va = wait_assignment(*ca, a_, 1);
  EXPECT_EQ(va.assignment->generation, 2);
  EXPECT_EQ(va.assignment->world_size, 4);
  EXPECT_EQ(va.assignment->node_rank, 0);  // previous members keep their order
}

TEST_F(ElasticServiceTest, KeysOfOlderGenerationsAreDeletedWhenTheNextOneStarts) {
  auto [ca, cb] = start_generation_one();
  TcpStoreClient store(client_options());
  // Generation 1's workers: communicator bootstrap and a liveness key.
  store.set("comm/g1/gloo/addr/0", to_bytes("x"));
  store.set_owned("comm/g1/alive/0", to_bytes("1"));
  store.set("comm/g10/kept", to_bytes("y"));  // another generation's prefix, not g1's
  store.set("user/key", to_bytes("z"));
  FailureReport f = failure_of(a_, 0);
  f.signal = 9;
  ca->report_failure(f);
  // Still there while the round is open (nothing is deleted before every member rejoined).
  EXPECT_TRUE(store.check({"comm/g1/gloo/addr/0", "comm/g1/alive/0"}));
  ca->join(a_, 1);
  cb->join(b_, 1);
  wait_assignment(*ca, a_, 1);
  store.set("comm/g2/gloo/addr/0", to_bytes("x"));
  // The erase runs on the io thread after the round closed; this client's requests are
  // served in order after it, but the close may come from the ticker: poll (bounded).
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (store.try_get("comm/g1/gloo/addr/0") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_FALSE(store.try_get("comm/g1/gloo/addr/0"));
  EXPECT_FALSE(store.try_get("comm/g1/alive/0"));
  EXPECT_TRUE(store.try_get("comm/g10/kept"));
  EXPECT_TRUE(store.try_get("comm/g2/gloo/addr/0"));
  EXPECT_TRUE(store.try_get("user/key"));
  EXPECT_EQ(store.num_keys(), 3);
}

TEST_F(ElasticServiceTest, SuccessOfEveryMemberEndsTheJobAndIsDelivered) {
  auto [ca, cb] = start_generation_one();
  EXPECT_EQ(ca->report_success("a", 1).phase, JobPhase::kRunning);
  EXPECT_FALSE(service_->wait_outcome_delivered(50ms));
  EXPECT_EQ(cb->report_success("b", 1).phase, JobPhase::kSucceeded);
  EXPECT_FALSE(service_->wait_outcome_delivered(50ms));  // a has not been told yet
  EXPECT_EQ(ca->state("a").phase, JobPhase::kSucceeded);
  EXPECT_TRUE(service_->wait_outcome_delivered(1s));
}

TEST_F(ElasticServiceTest, ExhaustedBudgetFailsTheJobWithTheRootCause) {
  ElasticOptions o = two_nodes();
  o.max_restarts = 0;
  auto [ca, cb] = start_generation_one(o);
  FailureReport f = failure_of(b_, 3);
  f.exit_code = 7;
  f.reason = "worker exited";
  f.last_lines = {"loading", "CUDA error: out of memory"};
  JobView v = cb->report_failure(f);
  EXPECT_EQ(v.phase, JobPhase::kFailed);
  for (const char* needle : {"rank 3 on hostb", "exited with code 7", "max_restarts = 0 exhausted",
                             "CUDA error: out of memory", "generation 1"}) {
    EXPECT_NE(v.root_cause.find(needle), std::string::npos) << needle << " in " << v.root_cause;
  }
  EXPECT_EQ(ca->state("a").root_cause, v.root_cause);
}

TEST_F(ElasticServiceTest, TickerFindsAHungRankWithoutAnyMessage) {
  ElasticOptions o = two_nodes();
  o.step_timeout = 300ms;
  auto [ca, cb] = start_generation_one(o);
  ca->heartbeat("a", 1, {1, 1});
  cb->heartbeat("b", 1, {1, 1});
  std::this_thread::sleep_for(600ms);  // no message: only the ticker can see it
  JobView v = service_->view("a");
  EXPECT_EQ(v.generation_open, 2);
  EXPECT_EQ(v.restarts_used, 1);
  EXPECT_NE(v.round_reason.find("no progress"), std::string::npos) << v.round_reason;
  EXPECT_NE(v.round_reason.find("rank 0 on hosta"), std::string::npos) << v.round_reason;
}

TEST_F(ElasticServiceTest, SilentNodeIsDeclaredDeadAndTheSurvivorContinuesAlone) {
  ElasticOptions o;
  o.min_nodes = 1;
  o.max_nodes = 2;
  o.settle = 100ms;
  o.heartbeat_timeout = 400ms;
  start(o);
  auto ca = client();
  auto cb = client();
  ca->join(a_, 0);
  cb->join(b_, 0);
  JobView va = wait_assignment(*ca, a_, 0);
  ASSERT_EQ(va.assignment->world_size, 4);
  auto deadline = std::chrono::steady_clock::now() + 3s;
  JobView v;
  do {  // only a keeps heartbeating
    std::this_thread::sleep_for(50ms);
    v = ca->heartbeat("a", 1, {});
  } while (v.generation_open == 1 && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(v.generation_open, 2);
  EXPECT_NE(v.round_reason.find("node hostb"), std::string::npos) << v.round_reason;
  va = wait_assignment(*ca, a_, 1);
  EXPECT_EQ(va.assignment->generation, 2);
  EXPECT_EQ(va.assignment->world_size, 2);
  EXPECT_EQ(va.membership_changes_used, 1);
}

TEST_F(ElasticServiceTest, LateNodeIsAdmittedAtTheNextRound) {
  ElasticOptions o;
  o.min_nodes = 1;
  o.max_nodes = 2;
  o.settle = 100ms;
  start(o);
  auto ca = client();
  auto cb = client();
  ca->join(a_, 0);
  JobView va = wait_assignment(*ca, a_, 0);
  EXPECT_EQ(va.assignment->world_size, 2);
  JobView vb = cb->join(b_, 0);
  EXPECT_EQ(vb.generation_open, 2);
  EXPECT_FALSE(vb.assignment);
  ca->join(a_, 1);
  va = wait_assignment(*ca, a_, 1);
  vb = wait_assignment(*cb, b_, 0);
  EXPECT_EQ(va.assignment->world_size, 4);
  EXPECT_EQ(vb.assignment->node_rank, 1);
  EXPECT_EQ(vb.assignment->generation, 2);
}

using testing::RawSocket;

TEST_F(ElasticServiceTest, HostileClientsAreRefusedAndTheJobIsUnaffected) {
  start(two_nodes());
  auto ca = client();
  ca->join(a_, 0);
  expect_error([&] { client("wrong"); }, ExitCode::kUsage);
  {  // an elastic op before HELLO
    RawSocket r(server_->port());
    r.send(FrameWriter().u8(static_cast<uint8_t>(Op::kElasticState)).str("a").frame());
    EXPECT_EQ(r.reply_status(), -1);
  }
  {  // an oversized frame
    RawSocket r(server_->port());
    r.hello("secret");
    EXPECT_EQ(r.reply_status(), 0);
    r.send({0xff, 0xff, 0xff, 0x7f, static_cast<uint8_t>(Op::kElasticJoin)});
    EXPECT_EQ(r.reply_status(), -1);
  }
  {  // garbage: a join whose fields do not parse
    RawSocket r(server_->port());
    r.hello("secret");
    EXPECT_EQ(r.reply_status(), 0);
    r.send(FrameWriter().u8(static_cast<uint8_t>(Op::kElasticJoin)).u32(1000).frame());
    EXPECT_EQ(r.reply_status(), -1);
  }
  {  // well-formed but out of range: answered kBadRequest
    RawSocket r(server_->port());
    r.hello("secret");
    EXPECT_EQ(r.reply_status(), 0);
    r.send(FrameWriter()
               .u8(static_cast<uint8_t>(Op::kElasticJoin))
               .str("evil")
               .str("h")
               .i64(0)
               .i64(0)
               .frame());
    EXPECT_EQ(r.reply_status(), static_cast<int>(Status::kBadRequest));
    r.send(FrameWriter()
               .u8(static_cast<uint8_t>(Op::kElasticHeartbeat))
               .str("")
               .i64(0)
               .u32(0)
               .frame());
    int status = r.reply_status();
    EXPECT_TRUE(status == static_cast<int>(Status::kBadRequest) || status == -1) << status;
  }
  auto cb = client();
  cb->join(b_, 0);
  JobView v = wait_assignment(*ca, a_, 0);
  EXPECT_EQ(v.assignment->world_size, 4);  // "evil" never joined
  EXPECT_EQ(v.assignment->nnodes, 2);
}

}  // namespace
}  // namespace dnallm::coordinator
