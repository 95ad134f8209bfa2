#include "coordinator/elastic_state.hpp"

#include <csignal>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace dnallm::coordinator {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

class ElasticStateTest : public ::testing::Test {
 protected:
  SteadyClock::time_point t0 = SteadyClock::time_point{} + std::chrono::hours(1);
  SteadyClock::time_point at(double s) {
    return t0 + std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(s));
  }
  static NodeInfo node(const std::string& id, int64_t nproc = 2) {
    return {id, id + "-host", nproc};
  }
  static bool has(const std::vector<ElasticEvent>& ev, ElasticEvent::Kind kind) {
    for (const auto& e : ev) {
      if (e.kind == kind) return true;
    }
    return false;
  }
  static ElasticOptions opts(int64_t min, int64_t max) {
    ElasticOptions o;
    o.min_nodes = min;
    o.max_nodes = max;
    o.settle = seconds(2);
    o.heartbeat_timeout = seconds(5);
    o.step_timeout = seconds(30);
    o.join_timeout = seconds(60);
    o.max_restarts = 2;
    o.max_membership_changes = 3;
    return o;
  }
};

TEST_F(ElasticStateTest, ClosesImmediatelyAtMaxNodesWithPrefixOffsets) {
  ElasticState s(opts(1, 3));
  s.join(node("a", 2), at(0));
  s.join(node("b", 4), at(0.1));
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous);
  EXPECT_FALSE(s.assignment("a"));
  auto ev = s.join(node("c", 1), at(0.2));
  EXPECT_TRUE(has(ev, ElasticEvent::Kind::kRoundClosed));
  ASSERT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_EQ(s.generation(), 1);
  auto a = *s.assignment("a");
  auto b = *s.assignment("b");
  auto c = *s.assignment("c");
  EXPECT_EQ(a.node_rank, 0);
  EXPECT_EQ(b.node_rank, 1);
  EXPECT_EQ(c.node_rank, 2);
  EXPECT_EQ(a.rank_offset, 0);
  EXPECT_EQ(b.rank_offset, 2);
  EXPECT_EQ(c.rank_offset, 6);
  EXPECT_EQ(c.world_size, 7);
  EXPECT_EQ(b.local_world_size, 4);
  EXPECT_EQ(a.nnodes, 3);
}

TEST_F(ElasticStateTest, ClosesAtMinNodesAfterSettle) {
  ElasticState s(opts(2, 4));
  s.join(node("a"), at(0));
  s.heartbeat("a", {}, at(4));
  s.heartbeat("a", {}, at(8));
  s.tick(at(10));
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous) << "one node is below min_nodes";
  EXPECT_EQ(s.waiting(), 1u);
  s.heartbeat("a", {}, at(10));
  s.join(node("b"), at(11));
  s.heartbeat("a", {}, at(12));
  s.tick(at(12.5));
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous) << "settle time not yet passed";
  s.tick(at(13.1));
  EXPECT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_EQ(s.assignment("b")->world_size, 4);
}

TEST_F(ElasticStateTest, FailureRestartsEveryoneKeepsRanksAndSpendsBudget) {
  ElasticState s(opts(2, 2));
  s.join(node("a"), at(0));
  s.join(node("b"), at(0));
  ASSERT_EQ(s.generation(), 1);
  FailureReport f{"b", "b-host", 3, 0, SIGKILL, "", {"last line"}, 1};
  auto ev = s.report_failure(f, at(5));
  EXPECT_TRUE(has(ev, ElasticEvent::Kind::kRoundOpened));
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous);
  EXPECT_EQ(s.generation_open(), 2);
  EXPECT_EQ(s.restarts_used(), 1);
  EXPECT_FALSE(s.assignment("a"));
  // A failure report from the same generation while regrouping is not counted twice.
  s.report_failure(FailureReport{"a", "a-host", 0, 4, 0, "peer failed", {}, 1}, at(5.1));
  EXPECT_EQ(s.restarts_used(), 1);
  // They rejoin in the other order; node ranks stay stable.
  s.join(node("b"), at(6));
  s.join(node("a"), at(6.5));
  ASSERT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_EQ(s.generation(), 2);
  EXPECT_EQ(s.assignment("a")->node_rank, 0);
  EXPECT_EQ(s.assignment("b")->node_rank, 1);
  // A stale report about generation 1 arriving now is ignored.
  s.report_failure(FailureReport{"a", "a-host", 0, 1, 0, "late", {}, 1}, at(7));
  EXPECT_EQ(s.phase(), JobPhase::kRunning);
}

TEST_F(ElasticStateTest, ExhaustedRestartBudgetFailsWithRootCause) {
  ElasticState s(opts(1, 1));
  for (int i = 0; i < 2; ++i) {
    s.join(node("a"), at(i * 10));
    ASSERT_EQ(s.phase(), JobPhase::kRunning);
    s.report_failure(FailureReport{"a", "a-host", 1, 137, 0, "", {}, s.generation()},
                     at(i * 10 + 1));
  }
  s.join(node("a"), at(30));
  auto ev =
      s.report_failure(FailureReport{"a", "a-host", 1, 0, SIGSEGV, "", {}, s.generation()}, at(31));
  EXPECT_TRUE(has(ev, ElasticEvent::Kind::kJobFailed));
  EXPECT_EQ(s.phase(), JobPhase::kFailed);
  ASSERT_TRUE(s.root_cause());
  std::string why = s.root_cause()->describe();
  EXPECT_NE(why.find("rank 1 on a-host"), std::string::npos) << why;
  EXPECT_NE(why.find("SIGSEGV"), std::string::npos) << why;
  EXPECT_NE(why.find("max_restarts = 2 exhausted"), std::string::npos) << why;
  // A failed job accepts nothing more.
  s.join(node("z"), at(40));
  EXPECT_EQ(s.phase(), JobPhase::kFailed);
}

TEST_F(ElasticStateTest, DeadNodeShrinksToSurvivorsWithinMinNodes) {
  ElasticState s(opts(1, 2));
  s.join(node("a"), at(0));
  s.join(node("b"), at(0));
  ASSERT_EQ(s.assignment("b")->world_size, 4);
  s.heartbeat("a", {0, 0}, at(4));
  auto ev = s.tick(at(6));  // b silent for 6 s > 5 s
  EXPECT_TRUE(has(ev, ElasticEvent::Kind::kNodeDead));
  EXPECT_EQ(s.membership_changes_used(), 1);
  EXPECT_EQ(s.restarts_used(), 0);
  s.join(node("a"), at(7));
  s.tick(at(8));
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous) << "settle";
  s.tick(at(9.1));
  ASSERT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_EQ(s.assignment("a")->world_size, 2);
  EXPECT_FALSE(s.assignment("b"));
}

TEST_F(ElasticStateTest, LateJoinerAdmittedAtNextRound) {
  ElasticState s(opts(1, 2));
  s.join(node("a"), at(0));
  s.tick(at(3));
  ASSERT_EQ(s.phase(), JobPhase::kRunning);
  ASSERT_EQ(s.assignment("a")->world_size, 2);
  auto ev = s.join(node("late"), at(10));
  EXPECT_TRUE(has(ev, ElasticEvent::Kind::kRoundOpened));
  EXPECT_EQ(s.generation_open(), 2);
  s.join(node("a"), at(11));  // a's agent stops its workers and rejoins: max reached
  ASSERT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_EQ(s.assignment("a")->node_rank, 0);
  EXPECT_EQ(s.assignment("late")->node_rank, 1);
  EXPECT_EQ(s.assignment("late")->world_size, 4);
}

TEST_F(ElasticStateTest, JoinerWaitsWhenJobIsFull) {
  ElasticState s(opts(1, 1));
  s.join(node("a"), at(0));
  ASSERT_EQ(s.phase(), JobPhase::kRunning);
  s.join(node("spare"), at(1));
  EXPECT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_EQ(s.waiting(), 1u);
  EXPECT_FALSE(s.assignment("spare"));
  // When a dies, the spare takes its place at the next round.
  s.heartbeat("spare", {}, at(5));
  s.tick(at(6.5));
  s.heartbeat("spare", {}, at(6.6));
  s.tick(at(9));
  ASSERT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_TRUE(s.assignment("spare"));
}

TEST_F(ElasticStateTest, HangIsDetectedAndNamesRank) {
  ElasticState s(opts(1, 1));
  s.join(node("a", 2), at(0));
  for (int t = 1; t <= 40; ++t) {
    // local rank 0 progresses, local rank 1 is stuck at step 3
    s.heartbeat("a", {t, std::min(t, 3)}, at(t));
    auto ev = s.tick(at(t));
    if (has(ev, ElasticEvent::Kind::kHang)) {
      EXPECT_GE(t, 33);
      EXPECT_NE(ev.front().message.find("rank 1 on a-host"), std::string::npos)
          << ev.front().message;
      EXPECT_EQ(s.restarts_used(), 1);
      return;
    }
  }
  FAIL() << "hang not detected";
}

// Note [Hang culprit]: one rank of two nodes stops; every other rank stalls in the next
// collective at the same step. Named: the stopped one, not the first in node order.
TEST_F(ElasticStateTest, HangNamesTheStoppedRankNotTheFirstWaiting) {
  for (int culprit = 0; culprit < 4; ++culprit) {
    ElasticState s(opts(2, 2));
    s.join(node("a", 2), at(0));
    s.join(node("b", 2), at(0));
    for (int t = 1; t <= 40; ++t) {
      const int step = std::min(t, 5);
      std::vector<bool> stopped_a(2, false), stopped_b(2, false);
      if (t > 5) (culprit < 2 ? stopped_a : stopped_b)[culprit % 2] = true;
      s.heartbeat("a", {step, step}, at(t), stopped_a);
      s.heartbeat("b", {step, step}, at(t), stopped_b);
      auto ev = s.tick(at(t));
      if (has(ev, ElasticEvent::Kind::kHang)) {
        const std::string host = culprit < 2 ? "a-host" : "b-host";
        EXPECT_NE(ev.front().message.find(fmt::format("rank {} on {}", culprit, host)),
                  std::string::npos)
            << ev.front().message;
        EXPECT_NE(ev.front().message.find("process is stopped"), std::string::npos)
            << ev.front().message;
        break;
      }
      ASSERT_LT(t, 40) << "hang not detected";
    }
  }
}

// Without a stopped process, the rank behind the others is named.
TEST_F(ElasticStateTest, HangNamesTheRankBehindTheOthers) {
  ElasticState s(opts(2, 2));
  s.join(node("a", 2), at(0));
  s.join(node("b", 2), at(0));
  for (int t = 1; t <= 40; ++t) {
    // rank 3 never completed step 6; the others did and wait in step 7's collective.
    s.heartbeat("a", {std::min(t, 6), std::min(t, 6)}, at(t));
    s.heartbeat("b", {std::min(t, 6), std::min(t, 5)}, at(t));
    auto ev = s.tick(at(t));
    if (has(ev, ElasticEvent::Kind::kHang)) {
      EXPECT_NE(ev.front().message.find("rank 3 on b-host"), std::string::npos)
          << ev.front().message;
      EXPECT_NE(ev.front().message.find("other ranks completed step 6"), std::string::npos)
          << ev.front().message;
      return;
    }
  }
  FAIL() << "hang not detected";
}

TEST_F(ElasticStateTest, TicksBeforeTheFirstJoinDoNotTimeTheJoinOut) {
  ElasticState s(opts(2, 2));
  EXPECT_TRUE(s.tick(at(1000)).empty());  // long after the clock's epoch, nobody joined yet
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous);
  s.join(node("a", 1), at(1001));
  s.join(node("b", 1), at(1002));
  EXPECT_EQ(s.phase(), JobPhase::kRunning);
}

TEST_F(ElasticStateTest, AWorkersOwnDiagnosisFailsTheJobAtOnce) {
  for (int code : {2, 3, 5}) {
    ElasticState s(opts(1, 1));  // max_restarts = 2 left unused
    s.join(node("a", 2), at(0));
    FailureReport f{"a", "a-host", 1, code, 0, "bad input", {"line"}};
    f.generation = 1;
    auto ev = s.report_failure(f, at(1));
    EXPECT_TRUE(has(ev, ElasticEvent::Kind::kJobFailed)) << code;
    EXPECT_EQ(s.phase(), JobPhase::kFailed);
    EXPECT_EQ(s.restarts_used(), 0);
    ASSERT_TRUE(s.root_cause());
    EXPECT_EQ(s.root_cause()->exit_code, code);
    EXPECT_NE(s.root_cause()->reason.find("not restarted"), std::string::npos);
  }
  // A code of its own that is not a diagnosis (7), or a signal, is restarted.
  ElasticState s(opts(1, 1));
  s.join(node("a", 2), at(0));
  FailureReport f{"a", "a-host", 1, 7, 0, "", {}};
  s.report_failure(f, at(1));
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous);
  EXPECT_EQ(s.restarts_used(), 1);
}

TEST_F(ElasticStateTest, RanksWithoutProgressAreNotHangs) {
  ElasticState s(opts(1, 1));
  s.join(node("a", 2), at(0));
  for (int t = 1; t <= 100; ++t) {
    s.heartbeat("a", {-1, -1}, at(t));  // workers that write no progress file
    EXPECT_FALSE(has(s.tick(at(t)), ElasticEvent::Kind::kHang)) << "at " << t << " s";
  }
  EXPECT_EQ(s.phase(), JobPhase::kRunning);
  EXPECT_EQ(s.restarts_used(), 0);
}

TEST_F(ElasticStateTest, SuccessWhenAllNodesFinish) {
  ElasticState s(opts(2, 2));
  s.join(node("a"), at(0));
  s.join(node("b"), at(0));
  s.report_success("a", at(1));
  EXPECT_EQ(s.phase(), JobPhase::kRunning);
  auto ev = s.report_success("b", at(2));
  EXPECT_TRUE(has(ev, ElasticEvent::Kind::kJobSucceeded));
  EXPECT_EQ(s.phase(), JobPhase::kSucceeded);
}

TEST_F(ElasticStateTest, RendezvousBelowMinTimesOut) {
  ElasticState s(opts(3, 3));
  s.join(node("a"), at(0));
  for (int t = 1; t <= 61; ++t) {
    s.heartbeat("a", {}, at(t));
    s.tick(at(t));
  }
  EXPECT_EQ(s.phase(), JobPhase::kFailed);
  EXPECT_NE(s.root_cause()->describe().find("only 1 of at least 3 nodes"), std::string::npos);
}

TEST_F(ElasticStateTest, SilentJoinerLeavesTheRound) {
  ElasticState s(opts(2, 3));
  s.join(node("a"), at(0));
  s.join(node("b"), at(0.5));
  s.heartbeat("a", {}, at(4));
  s.tick(at(5.8));  // b silent for 5.3 s: gone, a alone is below min_nodes
  EXPECT_EQ(s.phase(), JobPhase::kRendezvous);
  EXPECT_EQ(s.waiting(), 1u);
}

TEST(ElasticOptionsTest, RejectsMinAboveMax) {
  ElasticOptions o;
  o.min_nodes = 3;
  o.max_nodes = 2;
  EXPECT_THROW(ElasticState{o}, std::exception);
}

}  // namespace
}  // namespace dnallm::coordinator
