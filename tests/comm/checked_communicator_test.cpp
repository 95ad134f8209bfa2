// Note [Collective check]: ranks that issue the same collectives get the backend's results
// unchanged; a rank that issues another op, another count, or one collective fewer is named
// with what it issued, on every rank, instead of a hang or a wrong reduction.
#include "comm/checked_communicator.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm/make_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "tests/comm/counting_communicator.hpp"

namespace dnallm::comm {
namespace {

using namespace std::chrono_literals;

enum class Mode { kStore, kInner };

struct RankResult {
  std::string error;
  ExitCode code = ExitCode::kOk;
};

// `world` in-process gloo ranks, each with a CheckedCommunicator that exchanges fingerprints
// through the store (kStore, as make_communicator builds it) or through the gloo
// communicator itself (kInner, as for MPI without a store).
std::vector<RankResult> run_ranks(int world, Mode mode, std::chrono::milliseconds timeout,
                                  const std::string& name,
                                  const std::function<void(int, Communicator&)>& body) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  std::vector<RankResult> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommOptions o;
        o.backend = "gloo";
        o.rank = r;
        o.world_size = world;
        o.store = store;
        o.loopback = true;
        o.timeout = timeout;
        o.name = name;
        std::unique_ptr<Communicator> comm;
        if (mode == Mode::kStore) {
          o.check_collectives = true;
          comm = make_communicator(o);
        } else {
          comm =
              std::make_unique<CheckedCommunicator>(make_communicator(o), nullptr, name, timeout);
        }
        body(r, *comm);
      } catch (const Error& e) {
        results[static_cast<size_t>(r)] = {e.what(), e.code()};
      } catch (const std::exception& e) {
        results[static_cast<size_t>(r)] = {e.what(), ExitCode::kFailure};
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

BufferView view(std::vector<float>& v) { return {v.data(), v.size(), DType::kFloat32, Device{}}; }

class CollectiveCheck : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    if (!backend_available("gloo")) GTEST_SKIP() << "gloo not built";
  }
  std::string name(const std::string& what) const {
    return what + (GetParam() == Mode::kStore ? "_store" : "_inner");
  }
};

TEST_P(CollectiveCheck, SameCollectivesPassWithTheBackendsResults) {
  constexpr int kWorld = 3;
  auto results = run_ranks(kWorld, GetParam(), 20s, name("same"), [](int r, Communicator& c) {
    std::vector<float> a(4, float(r + 1));
    c.allreduce(view(a), ReduceOp::kSum)->wait();
    for (float x : a) EXPECT_EQ(x, 6.0f);
    std::vector<float> in(6, float(r)), shard(2);
    c.reduce_scatter(view(in), view(shard), ReduceOp::kSum)->wait();
    for (float x : shard) EXPECT_EQ(x, 3.0f);
    std::vector<float> mine(2, float(r)), all(6);
    c.allgather(view(mine), view(all))->wait();
    EXPECT_EQ(all, (std::vector<float>{0, 0, 1, 1, 2, 2}));
    std::vector<float> b(3, float(r));
    c.broadcast(view(b), 2)->wait();
    for (float x : b) EXPECT_EQ(x, 2.0f);
    c.barrier()->wait();
    // Uneven all_to_all: block sizes differ by rank, which the check must allow.
    std::vector<int64_t> counts(kWorld, r + 1), out_counts;
    for (int p = 0; p < kWorld; ++p) out_counts.push_back(p + 1);
    std::vector<float> ain(size_t(kWorld * (r + 1)), float(r)), aout(6);
    c.all_to_all(view(ain), counts, view(aout), out_counts)->wait();
    EXPECT_EQ(aout, (std::vector<float>{0, 1, 1, 2, 2, 2}));
    // A sub-group is checked under its own name.
    auto sub = c.split(r == 0 ? 0 : 1, r);
    std::vector<float> s(2, 1.0f);
    sub->allreduce(view(s), ReduceOp::kSum)->wait();
    EXPECT_EQ(s[0], float(sub->world_size()));
    auto* checked = dynamic_cast<CheckedCommunicator*>(&c);
    ASSERT_NE(checked, nullptr);
    EXPECT_EQ(checked->checked(), 7u);
    EXPECT_EQ(dynamic_cast<CheckedCommunicator*>(sub.get())->checked(), 1u);
  });
  for (const auto& r : results) EXPECT_EQ(r.error, "");
}

TEST_P(CollectiveCheck, AnotherOpIsNamedOnEveryRankBeforeItRuns) {
  const auto start = std::chrono::steady_clock::now();
  auto results = run_ranks(3, GetParam(), 20s, name("op"), [](int r, Communicator& c) {
    std::vector<float> a(4, 1.0f);
    c.allreduce(view(a), ReduceOp::kSum)->wait();
    std::vector<float> b(4, float(r)), untouched = b;
    if (r == 1) {
      std::vector<float> out(12);
      c.allgather(view(b), view(out))->wait();
    } else {
      c.allreduce(view(b), ReduceOp::kSum)->wait();
    }
    ADD_FAILURE() << "rank " << r << " passed the mismatched collective";
  });
  // Found at once, not after the 20 s timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  for (size_t r = 0; r < results.size(); ++r) {
    const std::string& e = results[r].error;
    EXPECT_EQ(results[r].code, ExitCode::kFailure) << e;
    EXPECT_NE(e.find("collective #2 of communicator"), std::string::npos) << e;
    EXPECT_NE(e.find("rank(s) 0, 2 issued allreduce sum fp32 x4"), std::string::npos) << e;
    EXPECT_NE(e.find("rank(s) 1 issued allgather fp32 x12"), std::string::npos) << e;
  }
}

TEST_P(CollectiveCheck, AnotherCountOrDtypeIsNamed) {
  auto results = run_ranks(2, GetParam(), 20s, name("count"), [](int r, Communicator& c) {
    std::vector<float> a(r == 0 ? 4 : 5, 1.0f);
    c.allreduce(view(a), ReduceOp::kSum)->wait();
  });
  for (const auto& r : results) {
    EXPECT_NE(r.error.find("rank(s) 0 issued allreduce sum fp32 x4; rank(s) 1 issued "
                           "allreduce sum fp32 x5"),
              std::string::npos)
        << r.error;
  }
  auto dtypes = run_ranks(2, GetParam(), 20s, name("dtype"), [](int r, Communicator& c) {
    std::vector<double> d(4, 1.0);
    std::vector<float> f(4, 1.0f);
    BufferView v = r == 0 ? view(f) : BufferView{d.data(), d.size(), DType::kFloat64, Device{}};
    c.broadcast(v, 0)->wait();
  });
  for (const auto& r : dtypes) {
    EXPECT_NE(r.error.find("rank(s) 1 issued broadcast root 0 fp64 x4"), std::string::npos)
        << r.error;
  }
}

INSTANTIATE_TEST_SUITE_P(Exchange, CollectiveCheck, ::testing::Values(Mode::kStore, Mode::kInner),
                         [](const auto& info) {
                           return info.param == Mode::kStore ? "Store" : "ThroughTheCommunicator";
                         });

// A rank that issues one collective fewer (and goes on to finish) is named within the
// timeout with the op the others wait in and the last collective it did issue.
TEST(CollectiveCheckStore, ASkippedCollectiveNamesTheRankWithinTheTimeout) {
  if (!backend_available("gloo")) GTEST_SKIP() << "gloo not built";
  const auto start = std::chrono::steady_clock::now();
  auto results = run_ranks(3, Mode::kStore, 1500ms, "skipped", [](int r, Communicator& c) {
    std::vector<float> a(4, 1.0f);
    c.allreduce(view(a), ReduceOp::kSum)->wait();
    if (r == 2) return;  // skips the reduce_scatter below
    std::vector<float> in(6, 1.0f), out(2);
    c.reduce_scatter(view(in), view(out), ReduceOp::kMax)->wait();
  });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 1500ms);
  EXPECT_LT(took, 10s);
  EXPECT_EQ(results[2].error, "");
  for (int r : {0, 1}) {
    const std::string& e = results[static_cast<size_t>(r)].error;
    EXPECT_EQ(results[static_cast<size_t>(r)].code, ExitCode::kPeerFailed) << e;
    EXPECT_NE(e.find("rank(s) 2 did not issue collective #2"), std::string::npos) << e;
    EXPECT_NE(e.find("issued reduce_scatter max fp32 x6"), std::string::npos) << e;
    EXPECT_NE(e.find("their last was collective #1 (allreduce sum fp32 x4)"), std::string::npos)
        << e;
  }
}

// Note [Stream-ordered wait]: the check hands out the backend's own Work, so a stream-ordered
// wait reaches it (a wrapped Work would have to forward it) and nothing waits on the host.
TEST(CollectiveCheckStreamWait, TheBackendsWorkReceivesWaitStream) {
  auto inner = std::make_unique<testing::CountingCommunicator>("nccl", 0, 1);
  auto counts = inner->counts();
  CheckedCommunicator checked(std::move(inner), std::make_shared<coordinator::InMemoryStore>(),
                              "stream_wait", 5s);
  Communicator& c = checked;
  std::vector<float> a(4, 1.0f), shard(4);
  Device gpu{DeviceType::kCUDA, 0};  // never dereferenced by the fake
  BufferView va{a.data(), a.size(), DType::kFloat32, gpu};
  BufferView vs{shard.data(), shard.size(), DType::kFloat32, gpu};
  c.allreduce(va, ReduceOp::kSum)->wait_stream();
  c.reduce_scatter(va, vs, ReduceOp::kSum)->wait_stream();
  c.allgather(vs, va)->wait_stream();
  c.broadcast(va, 0)->wait_stream();
  c.barrier()->wait_stream();
  EXPECT_EQ(counts->issued.load(), 5);
  EXPECT_EQ(counts->stream.load(), 5);
  EXPECT_EQ(counts->host.load(), 0);
  EXPECT_EQ(checked.checked(), 5u);
}

// On a host backend wait_stream() is wait(): the result is there when it returns.
TEST(CollectiveCheckStreamWait, OnAHostBackendItWaitsForTheResult) {
  if (!backend_available("gloo")) GTEST_SKIP() << "gloo not built";
  auto results = run_ranks(2, Mode::kStore, 20s, "host_stream_wait", [](int r, Communicator& c) {
    for (int i = 0; i < 20; ++i) {
      std::vector<float> a(1 << 16, float(r + i));
      c.allreduce(view(a), ReduceOp::kSum)->wait_stream();
      EXPECT_EQ(a.front(), float(1 + 2 * i));
      EXPECT_EQ(a.back(), float(1 + 2 * i));
    }
  });
  for (const auto& r : results) EXPECT_EQ(r.error, "");
}

TEST(CollectiveCheckMessage, GroupsRanksByWhatTheyIssued) {
  const std::string m = describe_mismatch("g0", 9, {"a", "b", "a", "c"});
  EXPECT_EQ(m.rfind("collective #9 of communicator 'g0' differs across ranks: rank(s) 0, 2 "
                    "issued a; rank(s) 1 issued b; rank(s) 3 issued c (",
                    0),
            0u)
      << m;
  CollectiveFingerprint fp{"broadcast", "root 3", DType::kBFloat16, 10};
  EXPECT_EQ(fp.describe(), "broadcast root 3 bf16 x10");
  EXPECT_EQ((CollectiveFingerprint{"barrier", "", DType::kUInt8, -1, false}).describe(), "barrier");
  EXPECT_EQ((CollectiveFingerprint{"all_to_all", "", DType::kInt64, -1}).describe(),
            "all_to_all int64");
}

}  // namespace
}  // namespace dnallm::comm
