#include "launcher/worker_group.hpp"

#include <csignal>

#include <gtest/gtest.h>

#include "fake_spawner.hpp"

namespace dnallm::launcher {
namespace {

using testing::FakeBehaviour;
using testing::FakeSpawner;
using testing::FakeStopSignals;

std::vector<WorkerSpec> specs(int n, int restart = 0) {
  std::vector<WorkerSpec> out;
  for (int i = 0; i < n; ++i) {
    WorkerSpec s;
    s.rank = i;
    s.local_rank = i;
    s.argv = {"worker"};
    s.env = {"RESTART=" + std::to_string(restart)};
    out.push_back(s);
  }
  return out;
}

GroupOptions fast() {
  GroupOptions o;
  o.grace = std::chrono::milliseconds(20);
  o.tick = std::chrono::milliseconds(1);
  return o;
}

FakeBehaviour exits_after(int ticks, int code) {
  FakeBehaviour b;
  b.ticks = ticks;
  b.exit = WorkerExit{false, code};
  return b;
}

FakeBehaviour runs_forever() { return FakeBehaviour{}; }

FakeBehaviour killed_after(int ticks, int sig) {
  FakeBehaviour b;
  b.ticks = ticks;
  b.exit = WorkerExit{true, sig};
  return b;
}

// At most `max_restarts` restarts, each generation's group polled fast().
RestartOptions restart_options(int max_restarts) {
  RestartOptions o;
  o.max_restarts = max_restarts;
  o.group = fast();
  return o;
}

// One generation of `n` workers (specs(n)) polled fast(), with the stop signals `signals` (by
// default none).
GenerationResult run_generation(FakeSpawner& spawner, int n, FakeStopSignals signals = {}) {
  LocalWorkerGroup group(spawner, signals, fast());
  return group.run(specs(n));
}

// A generation that ended as `outcome` without a failure, and the launcher's exit code for it.
void expect_ended_without_failure(const GenerationResult& r, GenerationOutcome outcome,
                                  int exit_code) {
  EXPECT_EQ(r.outcome, outcome);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(exit_code_for(r), exit_code);
}

// Generations of 2 workers (specs(2, restart)), at most `max_restarts` restarts.
RestartLoop two_worker_loop(FakeSpawner& spawner, FakeStopSignals& signals, int max_restarts) {
  return RestartLoop(spawner, signals, restart_options(max_restarts),
                     [](int restart, const std::string&) { return specs(2, restart); });
}

TEST(LocalWorkerGroup, AllWorkersSucceed) {
  FakeSpawner spawner([](const WorkerSpec& s, int) { return exits_after(s.rank + 1, 0); });
  GenerationResult r = run_generation(spawner, 3);
  expect_ended_without_failure(r, GenerationOutcome::kSucceeded, 0);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(spawner.record(i).signals.empty());
}

TEST(LocalWorkerGroup, ShouldStopEndsTheGenerationWithSigterm) {
  FakeSpawner spawner([](const WorkerSpec&, int) { return runs_forever(); });
  FakeStopSignals signals;
  GroupOptions o = fast();
  int asked = 0;
  o.should_stop = [&] { return ++asked == 3; };  // e.g. the coordinator opened a new round
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs(2));
  EXPECT_EQ(r.outcome, GenerationOutcome::kStopped);
  EXPECT_EQ(asked, 3);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(exit_code_for(r), 4);
  EXPECT_FALSE(should_restart(r, 0, 5));
  for (std::size_t i = 0; i < 2; ++i)
    EXPECT_EQ(spawner.record(i).signals, std::vector<int>{SIGTERM});
}

TEST(LocalWorkerGroup, AFailureInTheSameTickWinsOverShouldStop) {
  FakeSpawner spawner(
      [](const WorkerSpec& s, int) { return s.rank == 0 ? exits_after(0, 9) : runs_forever(); });
  FakeStopSignals signals;
  GroupOptions o = fast();
  const bool stop = true;
  o.should_stop = [&stop] { return stop; };
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs(2));
  EXPECT_EQ(r.outcome, GenerationOutcome::kWorkerFailed);
  ASSERT_EQ(r.failures.size(), 1u);
  EXPECT_EQ(r.failures[0].rank, 0);
}

TEST(LocalWorkerGroup, FailureStopsTheOthersWithSigterm) {
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    if (s.rank != 1) return runs_forever();
    FakeBehaviour b = exits_after(2, 7);
    b.lines = {"loading", "boom"};
    return b;
  });
  GenerationResult r = run_generation(spawner, 3);
  ASSERT_EQ(r.outcome, GenerationOutcome::kWorkerFailed);
  ASSERT_EQ(r.failures.size(), 1u);
  EXPECT_EQ(r.failures[0].rank, 1);
  EXPECT_EQ(r.failures[0].pid, 1001);
  EXPECT_EQ(r.failures[0].exit.code, 7);
  EXPECT_EQ(r.failures[0].last_lines, (std::vector<std::string>{"loading", "boom"}));
  EXPECT_EQ(spawner.record(0).signals, std::vector<int>{SIGTERM});
  EXPECT_TRUE(spawner.record(1).signals.empty());
  EXPECT_EQ(spawner.record(2).signals, std::vector<int>{SIGTERM});
  EXPECT_EQ(exit_code_for(r), 4);
  std::string text = describe_failure(r.failures[0]);
  EXPECT_NE(text.find("rank 1 (local rank 1, pid 1001) exited with code 7"), std::string::npos);
  EXPECT_NE(text.find("\n    boom"), std::string::npos) << text;
}

TEST(LocalWorkerGroup, WorkerIgnoringSigtermIsKilledAfterGrace) {
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    if (s.rank == 0) return exits_after(0, 1);
    FakeBehaviour b;
    b.ignores_term = true;
    return b;
  });
  GenerationResult r = run_generation(spawner, 2);
  EXPECT_EQ(r.outcome, GenerationOutcome::kWorkerFailed);
  EXPECT_EQ(spawner.record(1).signals, (std::vector<int>{SIGTERM, SIGKILL}));
  EXPECT_EQ(spawner.record(1).exit->code, SIGKILL);
  // Workers we stopped are not failures.
  EXPECT_EQ(r.failures.size(), 1u);
}

TEST(LocalWorkerGroup, ForwardsStopSignalAndReportsIt) {
  FakeSpawner spawner([](const WorkerSpec&, int) { return runs_forever(); });
  GenerationResult r = run_generation(spawner, 2, FakeStopSignals(SIGINT, 3));
  EXPECT_EQ(r.outcome, GenerationOutcome::kInterrupted);
  EXPECT_EQ(r.stop_signal, SIGINT);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(spawner.record(0).signals, std::vector<int>{SIGINT});
  EXPECT_EQ(spawner.record(1).signals, std::vector<int>{SIGINT});
  EXPECT_EQ(exit_code_for(r), 128 + SIGINT);
}

TEST(LocalWorkerGroup, SecondStopSignalKillsAtOnce) {
  FakeSpawner spawner([](const WorkerSpec&, int) {
    FakeBehaviour b;
    b.ignores_term = true;
    return b;
  });
  // First SIGTERM at call 0 (forwarded), second at call 1 (during the grace period).
  class TwoSignals : public StopSignals {
   public:
    int wait(std::chrono::milliseconds) override { return calls_++ < 2 ? SIGTERM : 0; }
    int calls_ = 0;
  } signals;
  GroupOptions o = fast();
  o.grace = std::chrono::hours(1);  // would hang the test if the second signal were ignored
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs(1));
  EXPECT_EQ(r.outcome, GenerationOutcome::kInterrupted);
  EXPECT_EQ(spawner.record(0).signals, (std::vector<int>{SIGTERM, SIGKILL}));
}

// Note [Preemption]: SIGUSR1 is forwarded and the workers go on until they exit 75.
FakeBehaviour saves_and_exits_on_signal() {
  FakeBehaviour b;
  b.on_stop_signal = WorkerExit{false, 75};
  return b;
}

TEST(LocalWorkerGroup, PreemptionNoticeIsForwardedAndEndsWithRequeue) {
  FakeSpawner spawner([](const WorkerSpec&, int) { return saves_and_exits_on_signal(); });
  FakeStopSignals signals(SIGUSR1, 2);
  RestartLoop loop = two_worker_loop(spawner, signals, 3);
  EXPECT_EQ(loop.run(), 75);
  EXPECT_EQ(loop.last_result().outcome, GenerationOutcome::kPreempted);
  EXPECT_EQ(loop.last_result().preempt_signal, SIGUSR1);
  EXPECT_TRUE(loop.last_result().failures.empty());
  EXPECT_EQ(spawner.spawned(), 2u) << "a preempted group is not restarted in-job";
  for (std::size_t i = 0; i < 2; ++i)
    EXPECT_EQ(spawner.record(i).signals, std::vector<int>{SIGUSR1});
}

TEST(LocalWorkerGroup, PreemptionNoticeDoesNotStopWorkersThatIgnoreIt) {
  // Workers without a handler keep running after SIGUSR1 and finish normally.
  FakeSpawner spawner([](const WorkerSpec&, int) { return exits_after(20, 0); });
  GenerationResult r = run_generation(spawner, 2, FakeStopSignals(SIGUSR1, 1));
  EXPECT_EQ(r.outcome, GenerationOutcome::kSucceeded);
  EXPECT_EQ(exit_code_for(r), 0);
  EXPECT_EQ(spawner.record(0).signals, std::vector<int>{SIGUSR1});
}

TEST(LocalWorkerGroup, SigtermAnsweredWithRequeueIsPreemption) {
  FakeSpawner spawner([](const WorkerSpec&, int) { return saves_and_exits_on_signal(); });
  GenerationResult r = run_generation(spawner, 2, FakeStopSignals(SIGTERM, 2));
  EXPECT_EQ(r.outcome, GenerationOutcome::kPreempted);
  EXPECT_EQ(r.stop_signal, SIGTERM);
  EXPECT_EQ(exit_code_for(r), 75);
  EXPECT_FALSE(should_restart(r, 0, 5));
}

TEST(LocalWorkerGroup, SigtermWithOneWorkerKilledIsAnInterrupt) {
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    if (s.rank == 0) return saves_and_exits_on_signal();
    FakeBehaviour b;
    b.ignores_term = true;  // killed after the grace period
    return b;
  });
  GenerationResult r = run_generation(spawner, 2, FakeStopSignals(SIGTERM, 2));
  EXPECT_EQ(r.outcome, GenerationOutcome::kInterrupted);
  EXPECT_EQ(exit_code_for(r), 128 + SIGTERM);
}

TEST(LocalWorkerGroup, AWorkerExiting75OnItsOwnIsNotAFailure) {
  FakeSpawner spawner([](const WorkerSpec& s, int) { return exits_after(s.rank + 1, 75); });
  GenerationResult r = run_generation(spawner, 2);
  expect_ended_without_failure(r, GenerationOutcome::kPreempted, 75);
}

TEST(LocalWorkerGroup, SpawnFailureStopsThoseStartedAndRethrows) {
  FakeSpawner spawner([](const WorkerSpec&, int) { return runs_forever(); });
  spawner.fail_at(2);
  FakeStopSignals signals;
  LocalWorkerGroup group(spawner, signals, fast());
  EXPECT_THROW(group.run(specs(3)), Error);
  ASSERT_EQ(spawner.spawned(), 2u);
  EXPECT_EQ(spawner.record(0).signals, std::vector<int>{SIGTERM});
  EXPECT_EQ(spawner.record(1).signals, std::vector<int>{SIGTERM});
}

GenerationResult failed(std::vector<WorkerExit> exits) {
  GenerationResult r;
  r.outcome = GenerationOutcome::kWorkerFailed;
  int rank = 0;
  for (const auto& e : exits) r.failures.push_back({rank++, 0, 0, e, {}});
  return r;
}

// Note [In-process recovery]: ranks 0..n-1, then spares with ids 0..k-1.
std::vector<WorkerSpec> specs_with_spares(int n, int k) {
  std::vector<WorkerSpec> out = specs(n);
  for (int i = 0; i < k; ++i) {
    WorkerSpec s;
    s.rank = n + i;
    s.local_rank = n + i;
    s.spare_id = i;
    s.argv = {"spare"};
    out.push_back(s);
  }
  return out;
}

TEST(LocalWorkerGroup, ASpareTakesAKilledRanksPlace) {
  // Rank 1 is killed at tick 2; the spare (spawn 2) then trains as rank 1 and ends with 0.
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    if (s.spare_id >= 0) return exits_after(12, 0);
    if (s.rank == 1) return killed_after(2, SIGKILL);
    return exits_after(10, 0);
  });
  FakeStopSignals signals;
  GroupOptions o = fast();
  std::vector<std::pair<int, int>> handed;  // (rank, spare)
  o.hand_to_spare = [&](const WorkerFailure& f, int spare) {
    handed.emplace_back(f.rank, spare);
    return true;
  };
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs_with_spares(2, 1));
  EXPECT_EQ(r.outcome, GenerationOutcome::kSucceeded);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(handed, (std::vector<std::pair<int, int>>{{1, 1 - 1}}));
  EXPECT_TRUE(spawner.record(0).signals.empty());  // the survivor was never stopped
  EXPECT_TRUE(spawner.record(2).signals.empty());  // the spare ended on its own
}

TEST(LocalWorkerGroup, AnotherSpareStartsInTheStead) {
  FakeSpawner spawner([](const WorkerSpec& s, int index) {
    if (index == 1) return killed_after(2, SIGKILL);  // rank 1
    return s.spare_id >= 0 && index > 2 ? runs_forever() : exits_after(10, 0);
  });
  FakeStopSignals signals;
  GroupOptions o = fast();
  o.hand_to_spare = [](const WorkerFailure&, int) { return true; };
  o.replenish_spares = true;
  LocalWorkerGroup group(spawner, signals, o);
  std::vector<WorkerSpec> s = specs_with_spares(2, 1);
  s[2].env = {"DNALLM_SPARE_ID=0"};
  GenerationResult r = group.run(s);
  EXPECT_EQ(r.outcome, GenerationOutcome::kSucceeded);
  ASSERT_EQ(spawner.spawned(), 4u);
  EXPECT_EQ(spawner.record(3).spec.spare_id, 1);
  EXPECT_EQ(spawner.record(3).spec.env, std::vector<std::string>{"DNALLM_SPARE_ID=1"});
  EXPECT_EQ(spawner.record(3).signals, std::vector<int>{SIGTERM});  // unused: stopped at the end
}

TEST(LocalWorkerGroup, UnusedSparesAreStoppedOnceEveryRankEnded) {
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    return s.spare_id >= 0 ? runs_forever() : exits_after(3, 0);
  });
  FakeStopSignals signals;
  GroupOptions o = fast();
  o.hand_to_spare = [](const WorkerFailure&, int) { return true; };
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs_with_spares(2, 2));
  EXPECT_EQ(r.outcome, GenerationOutcome::kSucceeded);
  EXPECT_EQ(exit_code_for(r), 0);
  EXPECT_EQ(spawner.record(2).signals, std::vector<int>{SIGTERM});
  EXPECT_EQ(spawner.record(3).signals, std::vector<int>{SIGTERM});
}

TEST(LocalWorkerGroup, ASpareThatDiesWhileWaitingIsNoFailureAndIsNotUsed) {
  // The spare dies at tick 1; rank 0 fails at tick 4 with no spare left: a failure as usual.
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    if (s.spare_id >= 0) return killed_after(1, SIGKILL);
    return s.rank == 0 ? exits_after(4, 1) : runs_forever();
  });
  FakeStopSignals signals;
  GroupOptions o = fast();
  int asked = 0;
  o.hand_to_spare = [&](const WorkerFailure&, int) { return ++asked > 0; };
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs_with_spares(2, 1));
  EXPECT_EQ(asked, 0);
  ASSERT_EQ(r.outcome, GenerationOutcome::kWorkerFailed);
  ASSERT_EQ(r.failures.size(), 1u);
  EXPECT_EQ(r.failures[0].rank, 0);
  EXPECT_EQ(spawner.record(1).signals, std::vector<int>{SIGTERM});
}

TEST(LocalWorkerGroup, ARefusedHandOverIsAFailure) {
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    if (s.spare_id >= 0) return runs_forever();
    return s.rank == 1 ? exits_after(2, 3) : runs_forever();
  });
  FakeStopSignals signals;
  GroupOptions o = fast();
  o.hand_to_spare = [](const WorkerFailure&, int) { return false; };  // e.g. exit 3: bad data
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs_with_spares(2, 1));
  ASSERT_EQ(r.outcome, GenerationOutcome::kWorkerFailed);
  EXPECT_EQ(exit_code_for(r), 3);
  EXPECT_EQ(spawner.record(2).signals, std::vector<int>{SIGTERM});  // the spare was stopped too
}

// Note [Shrink and grow]: rank 1 is killed with no spare; the group goes on without it and
// starts a spare in its stead (its spec, with DNALLM_SPARE_ID), which is asked about every tick
// until it returns to place 1 and then ends with the group.
TEST(LocalWorkerGroup, WithoutASpareTheGroupShrinksAndAReturningSpareGrowsItBack) {
  FakeSpawner spawner([](const WorkerSpec& s, int index) {
    if (index == 1) return killed_after(2, SIGKILL);  // rank 1
    return s.spare_id >= 0 ? exits_after(20, 0) : exits_after(15, 0);
  });
  FakeStopSignals signals;
  GroupOptions o = fast();
  std::vector<int> shrunk;
  int asked = 0;
  std::vector<std::pair<int, int>> grown;  // (place, spare)
  o.shrink = [&](const WorkerFailure& f) {
    shrunk.push_back(f.rank);
    return true;
  };
  o.grow = [&](int place, int local_rank, int spare) {
    EXPECT_EQ(local_rank, 1);
    if (++asked < 3) return false;  // not warm yet
    grown.emplace_back(place, spare);
    return true;
  };
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs(2));
  EXPECT_EQ(r.outcome, GenerationOutcome::kSucceeded);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(shrunk, std::vector<int>{1});
  EXPECT_EQ(asked, 3);
  EXPECT_EQ(grown, (std::vector<std::pair<int, int>>{{1, 0}}));
  ASSERT_EQ(spawner.spawned(), 3u);
  EXPECT_EQ(spawner.record(2).spec.spare_id, 0);
  EXPECT_EQ(spawner.record(2).spec.env,
            (std::vector<std::string>{"RESTART=0", "DNALLM_SPARE_ID=0"}));
  // It was a rank when the others ended: the group waited for it instead of stopping it.
  EXPECT_TRUE(spawner.record(2).signals.empty());
  EXPECT_TRUE(spawner.record(0).signals.empty());
}

// A shrink refused (the store unreachable) is a failure as before.
TEST(LocalWorkerGroup, ARefusedShrinkIsAFailure) {
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    return s.rank == 1 ? killed_after(2, SIGKILL) : runs_forever();
  });
  FakeStopSignals signals;
  GroupOptions o = fast();
  o.shrink = [](const WorkerFailure&) { return false; };
  o.grow = [](int, int, int) { return true; };
  LocalWorkerGroup group(spawner, signals, o);
  GenerationResult r = group.run(specs(2));
  ASSERT_EQ(r.outcome, GenerationOutcome::kWorkerFailed);
  EXPECT_EQ(spawner.spawned(), 2u);
}

TEST(ExitCodePolicy, Table) {
  struct Case {
    std::vector<WorkerExit> exits;
    int code;
  };
  const std::vector<Case> cases = {
      {{{false, 1}}, 4},
      {{{false, 2}}, 2},
      {{{false, 3}}, 3},
      {{{false, 5}}, 5},
      {{{false, 4}}, 4},
      {{{false, 2}, {false, 2}}, 2},
      {{{false, 2}, {false, 3}}, 4},  // disagree: a peer failure
      {{{false, 4}, {false, 2}}, 2},  // the 4 saw the rank that refused leave
      {{{false, 2}, {false, 4}, {false, 2}}, 2},
      {{{false, 4}, {false, 2}, {false, 3}}, 4},
      {{{false, 4}, {false, 1}}, 4},
      {{{false, 4}, {false, 4}}, 4},
      {{{false, 3}, {true, 9}}, 4},  // a crash besides the data error
      {{{true, 11}}, 4},
      {{{true, 2}}, 4},  // killed by signal 2 is not exit code 2
  };
  for (const auto& c : cases) {
    EXPECT_EQ(exit_code_for(failed(c.exits)), c.code) << c.exits.size() << " " << c.exits[0].code;
  }
  GenerationResult ok;
  EXPECT_EQ(exit_code_for(ok), 0);
  GenerationResult stopped;
  stopped.outcome = GenerationOutcome::kInterrupted;
  stopped.stop_signal = SIGTERM;
  EXPECT_EQ(exit_code_for(stopped), 143);
}

TEST(ExitCodePolicy, RestartOnlyCrashesWithBudgetLeft) {
  EXPECT_TRUE(should_restart(failed({{false, 1}}), 0, 1));
  EXPECT_FALSE(should_restart(failed({{false, 1}}), 1, 1));
  EXPECT_TRUE(should_restart(failed({{true, 9}}), 2, 3));
  EXPECT_FALSE(should_restart(failed({{false, 2}}), 0, 3));
  EXPECT_FALSE(should_restart(failed({{false, 3}}), 0, 3));
  EXPECT_FALSE(should_restart(failed({{false, 5}}), 0, 3));
  GenerationResult stopped;
  stopped.outcome = GenerationOutcome::kInterrupted;
  EXPECT_FALSE(should_restart(stopped, 0, 3));
  // A crash after a preemption notice: the job is going away; restarting would swallow it.
  GenerationResult preempted_crash = failed({{true, SIGUSR1}});
  preempted_crash.preempt_signal = SIGUSR1;
  EXPECT_FALSE(should_restart(preempted_crash, 0, 3));
}

TEST(WorkerExit, Describes) {
  EXPECT_EQ((WorkerExit{false, 3}).describe(), "exited with code 3");
  EXPECT_EQ((WorkerExit{true, SIGKILL}).describe(), "was killed by signal 9 (SIGKILL)");
  EXPECT_EQ((WorkerExit{true, SIGSEGV}).describe(), "was killed by signal 11 (SIGSEGV)");
}

TEST(RestartLoop, RestartsUntilSuccessWithIncreasingCount) {
  // Rank 1 fails in restarts 0 and 1, everything succeeds in restart 2.
  FakeSpawner spawner([](const WorkerSpec& s, int) {
    bool fail = s.rank == 1 && s.env[0] != "RESTART=2";
    return fail ? exits_after(1, 1) : exits_after(3, 0);
  });
  FakeStopSignals signals;
  std::vector<int> asked;
  std::vector<std::string> reasons;
  RestartLoop loop(spawner, signals, restart_options(3),
                   [&](int restart, const std::string& reason) {
                     asked.push_back(restart);
                     reasons.push_back(reason);
                     return specs(2, restart);
                   });
  EXPECT_EQ(loop.run(), 0);
  EXPECT_EQ(loop.restarts(), 2);
  EXPECT_EQ(asked, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(reasons, (std::vector<std::string>{"", "rank 1 exited with code 1",
                                               "rank 1 exited with code 1"}));
  EXPECT_EQ(spawner.spawned(), 6u);
}

TEST(RestartLoop, GivesUpWhenRestartsAreSpent) {
  FakeSpawner spawner(
      [](const WorkerSpec& s, int) { return s.rank == 0 ? exits_after(0, 1) : runs_forever(); });
  FakeStopSignals signals;
  RestartLoop loop = two_worker_loop(spawner, signals, 2);
  EXPECT_EQ(loop.run(), 4);
  EXPECT_EQ(loop.restarts(), 2);
  EXPECT_EQ(spawner.spawned(), 6u);
  EXPECT_EQ(loop.last_result().failures.at(0).rank, 0);
}

TEST(RestartLoop, UsageErrorIsNotRestarted) {
  FakeSpawner spawner([](const WorkerSpec&, int) { return exits_after(0, 2); });
  FakeStopSignals signals;
  RestartLoop loop = two_worker_loop(spawner, signals, 5);
  EXPECT_EQ(loop.run(), 2);
  EXPECT_EQ(loop.restarts(), 0);
  EXPECT_EQ(spawner.spawned(), 2u);
}

TEST(RestartLoop, InterruptIsNotRestarted) {
  FakeSpawner spawner([](const WorkerSpec&, int) { return runs_forever(); });
  FakeStopSignals signals(SIGTERM, 2);
  RestartLoop loop = two_worker_loop(spawner, signals, 5);
  EXPECT_EQ(loop.run(), 143);
  EXPECT_EQ(spawner.spawned(), 2u);
}

}  // namespace
}  // namespace dnallm::launcher
