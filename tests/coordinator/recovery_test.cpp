// Note [In-process recovery]'s store side (coordinator/recovery.hpp): records round-trip and
// an unreadable one is refused, announcements are numbered and name their spare, a re-formed
// group's waits give way to the next recovery at once, and what a configuration without
// in-process recovery is told.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <nlohmann/json.hpp>

#include "coordinator/recovery.hpp"
#include "coordinator/store.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::coordinator {
namespace {

using namespace std::chrono_literals;

RecoveryRecord sample() {
  RecoveryRecord r;
  r.rank = 3;
  r.local_rank = 1;
  r.host = "node7";
  r.reason = "rank 3 was killed by signal 9 (SIGKILL)";
  r.spare_id = 2;
  r.progress_file = "/tmp/progress.1";
  r.detected_unix_ms = 1'764'000'000'123;
  return r;
}

// read_recovery waits for a record; try_read_recovery answers at once, nullopt before it is
// written.
TEST(RecoveryRecordTest, ReadWaitsAndTryReadDoesNot) {
  InMemoryStore store;
  EXPECT_FALSE(try_read_recovery(store, 4, 1).has_value());
  dnallm::testing::expect_error([&] { read_recovery(store, 4, 1, std::chrono::milliseconds(10)); },
                                ExitCode::kPeerFailed, {"recover/g4/1"});
  announce_recovery(store, 4, sample());
  const auto tried = try_read_recovery(store, 4, 1);
  ASSERT_TRUE(tried.has_value());
  EXPECT_EQ(tried->number, 1);
  EXPECT_EQ(tried->rank, 3);
  EXPECT_EQ(read_recovery(store, 4, 1).rank, 3);
  EXPECT_FALSE(try_read_recovery(store, 4, 2).has_value());
}

TEST(RecoveryRecordTest, RoundTripsThroughTheStore) {
  InMemoryStore store;
  const int64_t first = announce_recovery(store, 4, sample());
  const int64_t second = announce_recovery(store, 4, sample());
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 2);
  EXPECT_EQ(to_string(*store.try_get(recovery_count_key(4))), "2");
  EXPECT_EQ(to_string(*store.try_get(spare_key(4, 2))), "2");
  const auto r = RecoveryRecord::from_json(to_string(*store.try_get(recovery_key(4, 2))), "k");
  EXPECT_EQ(r.number, 2);
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.host, "node7");
  EXPECT_EQ(r.reason, sample().reason);
  EXPECT_EQ(r.spare_id, 2);
  EXPECT_EQ(r.progress_file, "/tmp/progress.1");
  EXPECT_EQ(r.detected_unix_ms, 1'764'000'000'123);
  EXPECT_EQ(r.kind, RecoveryKind::kSpare);
  EXPECT_EQ(recovery_comm_name(4, 2), "g4.r2");
}

// Note [Shrink and grow]: the kind round-trips; a record without one (an older launcher's) is a
// spare's; an unknown one is refused.
TEST(RecoveryRecordTest, KindsRoundTripAndAnUnknownOneIsRefused) {
  for (const auto kind : {RecoveryKind::kSpare, RecoveryKind::kShrink, RecoveryKind::kGrow}) {
    RecoveryRecord r = sample();
    r.kind = kind;
    EXPECT_EQ(RecoveryRecord::from_json(r.to_json(), "k").kind, kind) << recovery_kind_name(kind);
  }
  auto j = nlohmann::json::parse(sample().to_json());
  j.erase("kind");
  EXPECT_EQ(RecoveryRecord::from_json(j.dump(), "k").kind, RecoveryKind::kSpare);
  j["kind"] = "teleport";
  dnallm::testing::expect_error([&] { RecoveryRecord::from_json(j.dump(), "recover/g1/3"); },
                                ExitCode::kPeerFailed, {"recover/g1/3", "teleport"});
}

// Note [Shrink and grow]: a shrink drops a place, a grow appends it, a spare keeps it where it
// was; ranks are the places' indices.
TEST(MembershipTest, ReplaysShrinksSparesAndGrowsInOrder) {
  InMemoryStore store;
  const auto announce = [&](RecoveryKind kind, int place) {
    RecoveryRecord r = sample();
    r.kind = kind;
    r.rank = place;
    return announce_recovery(store, 1, r);
  };
  EXPECT_EQ(membership_after(store, 1, 4, 0).places, (std::vector<int>{0, 1, 2, 3}));
  announce(RecoveryKind::kShrink, 0);  // rank 0 died, no spare: 1, 2, 3 become ranks 0-2
  auto m = membership_after(store, 1, 4, 1);
  EXPECT_EQ(m.places, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(m.world(), 3);
  EXPECT_EQ(m.rank_of(1), 0);
  EXPECT_EQ(m.rank_of(0), -1);
  announce(RecoveryKind::kSpare, 2);  // place 2's process died; a spare holds rank 1 now
  EXPECT_EQ(membership_after(store, 1, 4, 2).places, (std::vector<int>{1, 2, 3}));
  announce(RecoveryKind::kGrow, 0);  // place 0 returns, last
  m = membership_after(store, 1, 4, 3);
  EXPECT_EQ(m.places, (std::vector<int>{1, 2, 3, 0}));
  EXPECT_EQ(m.rank_of(0), 3);
  // Up to a record: the ones after it do not count.
  EXPECT_EQ(membership_after(store, 1, 4, 1).places, (std::vector<int>{1, 2, 3}));
}

TEST(MembershipTest, AccumulationKeepsTheGlobalBatchWhereAWholeNumberDoes) {
  EXPECT_EQ(accum_for_world(3, 4, 3), 4);  // 12 micro-batches a step either way
  EXPECT_EQ(accum_for_world(3, 4, 4), 3);
  EXPECT_EQ(accum_for_world(1, 2, 1), 2);
  EXPECT_EQ(accum_for_world(1, 4, 3), 1);  // no whole number: the batch changes
  EXPECT_EQ(accum_for_world(2, 3, 6), 1);  // a group larger than it began
}

TEST(RecoveryRecordTest, AnUnreadableRecordIsRefusedNamingItsKey) {
  dnallm::testing::expect_error(
      [] { RecoveryRecord::from_json("{\"number\": 1}", "recover/g1/1"); }, ExitCode::kPeerFailed,
      {"recover/g1/1", "unreadable"});
  dnallm::testing::expect_error([] { RecoveryRecord::from_json("not json", "recover/g1/1"); },
                                ExitCode::kPeerFailed, {"recover/g1/1"});
}

TEST(UntilNextRecoveryTest, AWaitReturnsWhenItsKeyComes) {
  auto inner = std::make_shared<InMemoryStore>();
  auto store = until_next_recovery(inner, 1, 1);
  std::thread later([&] {
    std::this_thread::sleep_for(150ms);
    inner->set("comm/g1.r1/gloo/1", to_bytes("addr"));
  });
  EXPECT_EQ(to_string(store->get("comm/g1.r1/gloo/1", 10s)), "addr");
  later.join();
}

TEST(UntilNextRecoveryTest, AWaitGivesWayToALaterRecoveryAtOnce) {
  auto inner = std::make_shared<InMemoryStore>();
  announce_recovery(*inner, 1, sample());  // recovery 1: the group being formed
  auto store = until_next_recovery(inner, 1, 1);
  std::thread later([&] {
    std::this_thread::sleep_for(150ms);
    announce_recovery(*inner, 1, sample());  // its spare died: recovery 2
  });
  const auto start = std::chrono::steady_clock::now();
  dnallm::testing::expect_error([&] { store->wait({"comm/g1.r1/gloo/1"}, 30s); },
                                ExitCode::kPeerFailed,
                                {"recovery 1 of generation 1", "recovery 2"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  later.join();
}

TEST(UntilNextRecoveryTest, AWaitStillTimesOutWithoutALaterRecovery) {
  auto store = until_next_recovery(std::make_shared<InMemoryStore>(), 1, 1);
  EXPECT_THROW(store->wait({"never"}, 300ms), Error);
}

TEST(InProcessRecoveryUnsupportedTest, SaysWhyForWhatItCannotRecover) {
  Config c;
  EXPECT_EQ(in_process_recovery_unsupported(c), "");
  for (int zero : {1, 2, 3}) {
    c.parallel.zero_stage = zero;
    EXPECT_EQ(in_process_recovery_unsupported(c), "") << zero;  // Note [Buddy copies]
  }
  c.parallel.context_parallel = 2;  // the context groups are split again
  EXPECT_EQ(in_process_recovery_unsupported(c), "");
  c = Config{};
  c.parallel.backend = cfg::Backend::kMpi;
  EXPECT_NE(in_process_recovery_unsupported(c).find("mpi"), std::string::npos);
  c = Config{};
  c.training.batch_size = cfg::BatchSize::kAuto;
  EXPECT_NE(in_process_recovery_unsupported(c).find("auto"), std::string::npos);
}

// Note [Shrink and grow]: DDP only; a shard or a context group cannot change shape in process.
TEST(InProcessRecoveryUnsupportedTest, ShrinkSaysWhyForZeroAndContextParallelism) {
  Config c;
  EXPECT_EQ(shrink_unsupported(c), "");
  c.parallel.zero_stage = 1;
  EXPECT_NE(shrink_unsupported(c).find("zero_stage = 1"), std::string::npos);
  c = Config{};
  c.parallel.context_parallel = 2;
  EXPECT_NE(shrink_unsupported(c).find("context_parallel"), std::string::npos);
  c = Config{};
  c.parallel.backend = cfg::Backend::kMpi;
  EXPECT_NE(shrink_unsupported(c).find("mpi"), std::string::npos);
}

}  // namespace
}  // namespace dnallm::coordinator
