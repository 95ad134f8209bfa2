// Our own logic around the backends (issue order, Work handles, broken state, diagnosis),
// driven by a scripted backend: no Gloo or MPI here (those are in comm_process_test).
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "comm/detail/queued_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::comm {
namespace {

using dnallm::testing::expect_error;

using namespace std::chrono_literals;

class ScriptedBackend final : public detail::QueuedCommunicator {
 public:
  explicit ScriptedBackend(const CommOptions& o, const std::vector<int>& parent_ranks = {})
      : QueuedCommunicator(o, o.rank, o.world_size, "fake", true) {
    if (!parent_ranks.empty()) set_parent_ranks(parent_ranks);
    start_worker();
  }
  ~ScriptedBackend() override {
    release();
    release_transfers(1 << 30);
    stop_worker();
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocked_ = false;
    }
    cv_.notify_all();
  }
  // Transfers posted so far with index < n complete (the n-th fails if fail_transfer == it).
  void release_transfers(int n) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      transfers_released_ = n;
    }
    cv_.notify_all();
  }
  std::atomic<int> fail_at{-1};  // throw in the n-th collective (0-based)
  bool block = false;            // the next collective blocks until release()
  std::vector<int> order;        // worker thread only; read after wait()
  int failures_cleaned = 0;
  std::atomic<int> fail_transfer{-1};    // the n-th transfer (0-based) fails
  std::vector<std::string> posted;       // guarded by mutex_: "send 1 3" = send to 1, tag 3
  std::vector<std::string> split_names;  // worker thread only; read after split()

  std::vector<std::string> posted_so_far() {
    std::lock_guard<std::mutex> lock(mutex_);
    return posted;
  }

 protected:
  void step(const BufferView& b) {
    const int n = calls_++;
    if (block) {
      std::unique_lock<std::mutex> lock(mutex_);
      blocked_ = true;
      cv_.wait(lock, [&] { return !blocked_; });
    }
    if (n == fail_at) throw std::runtime_error("transport says: connection reset");
    if (b.data) order.push_back(*static_cast<int*>(b.data));
  }
  void run_allreduce(const BufferView& in, const BufferView&, ReduceOp, uint32_t) override {
    step(in);
  }
  void run_reduce_scatter(const BufferView& in, const BufferView&, ReduceOp, uint32_t) override {
    step(in);
  }
  void run_allgather(const BufferView& in, const BufferView&, uint32_t) override { step(in); }
  void run_broadcast(const BufferView& b, int, uint32_t) override { step(b); }
  void run_barrier(uint32_t) override { step(BufferView{}); }
  void run_all_to_all(const BufferView& in, const BufferView&, const AllToAllLayout&,
                      uint32_t) override {
    step(in);
  }

  class ScriptedTransfer final : public PostedTransfer {
   public:
    ScriptedTransfer(ScriptedBackend& owner, int index) : owner_(owner), index_(index) {}
    void wait_until(std::chrono::steady_clock::time_point deadline) override {
      std::unique_lock<std::mutex> lock(owner_.mutex_);
      if (!owner_.cv_.wait_until(lock, deadline,
                                 [&] { return owner_.transfers_released_ > index_; }))
        throw std::runtime_error("scripted transfer timed out");
      if (owner_.fail_transfer == index_) throw std::runtime_error("transport says: peer reset");
    }

   private:
    ScriptedBackend& owner_;
    int index_;
  };
  std::unique_ptr<PostedTransfer> post(const char* what, const BufferView& b, int peer, int tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    posted.push_back(fmt::format("{} {} {}", what, peer, tag));
    if (b.data) order.push_back(*static_cast<int*>(b.data));
    return std::make_unique<ScriptedTransfer>(*this, static_cast<int>(posted.size()) - 1);
  }
  std::unique_ptr<PostedTransfer> post_send(const BufferView& b, int peer, int tag) override {
    return post("send", b, peer, tag);
  }
  std::unique_ptr<PostedTransfer> post_recv(const BufferView& b, int peer, int tag) override {
    return post("recv", b, peer, tag);
  }
  std::unique_ptr<Communicator> run_split(int color, int, const std::string& name) override {
    split_names.push_back(name);
    if (color < 0) return nullptr;
    CommOptions o = options();
    o.name = name;
    o.rank = 0;
    o.world_size = 2;
    return std::make_unique<ScriptedBackend>(o, std::vector<int>{rank(), rank() + 1});
  }
  void on_failure() override { ++failures_cleaned; }

 private:
  int calls_ = 0;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool blocked_ = false;        // guarded by mutex_
  int transfers_released_ = 0;  // guarded by mutex_
};

CommOptions options(std::shared_ptr<coordinator::Store> store, int rank = 0, int world = 3) {
  CommOptions o;
  o.rank = rank;
  o.world_size = world;
  o.store = std::move(store);
  o.timeout = 2s;
  o.name = "unit";
  return o;
}

TEST(QueuedCommunicator, RunsInIssueOrderAndCompletesWorks) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  ScriptedBackend comm(options(store));
  EXPECT_TRUE(store->check({"comm/unit/alive/0"}));
  std::vector<int> values = {10, 11, 12, 13};
  std::vector<WorkPtr> works;
  for (auto& v : values)
    works.push_back(comm.allreduce(BufferView{&v, 1, DType::kInt32, {}}, ReduceOp::kSum));
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  for (auto& w : works) EXPECT_TRUE(w->is_completed());
  EXPECT_EQ(comm.order, values);
}

TEST(QueuedCommunicator, FailureNamesAbsentRanksAndBreaksTheCommunicator) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  // Rank 1 is alive and saw the same failure; rank 2 is alive but never reported.
  store->set("comm/unit/alive/1", {});
  store->set("comm/unit/alive/2", {});
  store->set("comm/unit/failed/1", coordinator::to_bytes("2"));
  ScriptedBackend comm(options(store));
  comm.fail_at = 1;
  int a = 1, b = 2, c = 3;
  auto w1 = comm.allreduce(BufferView{&a, 1, DType::kInt32, {}}, ReduceOp::kSum);
  auto w2 = comm.broadcast(BufferView{&b, 1, DType::kInt32, {}}, 0);
  auto w3 = comm.allreduce(BufferView{&c, 1, DType::kInt32, {}}, ReduceOp::kSum);
  w1->wait();
  expect_error([&] { w2->wait(); }, ExitCode::kPeerFailed,
               {"fake broadcast #2", "rank(s) 2 did not arrive", "connection reset"});
  // Later collectives fail with the first error without running.
  EXPECT_THROW(w3->wait(), Error);
  EXPECT_EQ(comm.order, std::vector<int>{1});
  EXPECT_EQ(comm.failures_cleaned, 1);
  EXPECT_EQ(coordinator::to_string(store->get("comm/unit/failed/0", 1s)), "2");
}

TEST(QueuedCommunicator, DeadRankIsNamedWhenItsAliveKeyIsGone) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  store->set("comm/unit/alive/1", {});  // rank 2 has no alive key: it died
  ScriptedBackend comm(options(store));
  comm.fail_at = 0;
  try {
    comm.barrier()->wait();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank(s) 2 died"), std::string::npos) << e.what();
  }
}

// Issue 57 item 10: rank 1 was killed; rank 0 failed one collective later (its failed key
// holds another collective's number) and exited. Rank 1 is the culprit; rank 0 followed.
TEST(QueuedCommunicator, ARankThatFailedAndExitedIsNotNamedAsTheCulprit) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  store->set("comm/unit/failed/1", coordinator::to_bytes("7"));  // rank 1: failed, then exited
  // rank 2 has no alive key and never reported: it died first.
  ScriptedBackend comm(options(store));
  comm.fail_at = 0;
  const std::string what = expect_error([&] { comm.barrier()->wait(); }, ExitCode::kPeerFailed,
                                        {"rank(s) 2 died", "rank(s) 1 failed after it and exited"});
  EXPECT_EQ(what.find("rank(s) 1, 2"), std::string::npos) << what;
}

// ... and where every rank gone had failed first, none is named as dead.
TEST(QueuedCommunicator, RanksThatAllFailedAndExitedAreNamedAsSuch) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  store->set("comm/unit/failed/1", coordinator::to_bytes("peer 2"));
  store->set("comm/unit/failed/2", coordinator::to_bytes("5"));
  ScriptedBackend comm(options(store));
  comm.fail_at = 0;
  const std::string what = expect_error([&] { comm.barrier()->wait(); }, ExitCode::kPeerFailed,
                                        {"rank(s) 1, 2 failed in another transfer and exited"});
  EXPECT_EQ(what.find("died"), std::string::npos) << what;
}

TEST(QueuedCommunicator, WaitTimeoutThrowsPeerFailed) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  store->set("comm/unit/alive/1", {});
  store->set("comm/unit/alive/2", {});
  ScriptedBackend comm(options(store));
  comm.block = true;
  auto w = comm.barrier();
  EXPECT_FALSE(w->is_completed());
  auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { w->wait(300ms); }, ExitCode::kPeerFailed, {"did not complete within 300 ms"});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 300ms + kDiagnosisWindow + 1s);
  comm.release();
  w->wait(5s);
}

TEST(QueuedCommunicator, ChecksShapesBeforeQueueing) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  ScriptedBackend comm(options(store, 1, 3));
  std::vector<float> in(7), out(7);
  // 7 over 3 ranks: rank 1 owns 2 elements.
  EXPECT_THROW(comm.reduce_scatter(BufferView{in.data(), 7, DType::kFloat32, {}},
                                   BufferView{out.data(), 3, DType::kFloat32, {}}, ReduceOp::kSum),
               Error);
  EXPECT_THROW(comm.allreduce(BufferView{in.data(), 7, DType::kFloat32, {}},
                              BufferView{out.data(), 7, DType::kBFloat16, {}}, ReduceOp::kSum),
               Error);
  EXPECT_THROW(
      comm.allreduce(BufferView{in.data(), 7, DType::kFloat32, Device{DeviceType::kCUDA, 0}},
                     ReduceOp::kSum),
      Error);
  EXPECT_THROW(comm.broadcast(BufferView{in.data(), 7, DType::kFloat32, {}}, 3), Error);
  comm.reduce_scatter(BufferView{in.data(), 7, DType::kFloat32, {}},
                      BufferView{out.data(), 2, DType::kFloat32, {}}, ReduceOp::kSum)
      ->wait();
}

// Note [Posted transfers]: the worker posts and goes on; the completion thread completes.
TEST(QueuedCommunicator, TransfersArePostedInIssueOrderAndDoNotHoldTheWorker) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  ScriptedBackend comm(options(store));
  int a = 1, b = 2, c = 3;
  auto s = comm.send(BufferView{&a, 1, DType::kInt32, {}}, 1, 3);
  auto r = comm.recv(BufferView{&b, 1, DType::kInt32, {}}, 2, 4);
  // A collective issued after them runs although neither transfer has completed.
  comm.allreduce(BufferView{&c, 1, DType::kInt32, {}}, ReduceOp::kSum)->wait(5s);
  EXPECT_EQ(comm.posted_so_far(), (std::vector<std::string>{"send 1 3", "recv 2 4"}));
  EXPECT_FALSE(s->is_completed());
  EXPECT_FALSE(r->is_completed());
  comm.release_transfers(1);
  s->wait(5s);
  EXPECT_FALSE(r->is_completed());
  comm.release_transfers(2);
  r->wait(5s);
  EXPECT_TRUE(r->is_completed());
  EXPECT_EQ(comm.order, (std::vector<int>{1, 2, 3}));  // posted in issue order
}

TEST(QueuedCommunicator, UnmatchedTransferNamesThePeerAndTag) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  store->set("comm/unit/alive/2", {});
  ScriptedBackend comm(options(store));
  int v = 0;
  auto r = comm.recv(BufferView{&v, 1, DType::kInt32, {}}, 2, 4);
  expect_error([&] { r->wait(200ms); }, ExitCode::kPeerFailed,
               {"fake recv from rank 2 tag 4 #1 did not complete within 200 ms on rank 0",
                "rank 2 is alive but posted no matching send"});
  // A short wait is not a failure: the transfer still completes.
  comm.release_transfers(1);
  r->wait(5s);
  // A slow transfer is no failure: its diagnosis records no failure key (a dead peer's does).
  EXPECT_FALSE(store->check({"comm/unit/failed/0"}));
}

TEST(QueuedCommunicator, FailedTransferBreaksTheCommunicatorNamingTheDeadPeer) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  ScriptedBackend comm(options(store));  // no alive key for rank 1: it died
  comm.fail_transfer = 0;
  int a = 1, c = 3;
  auto s = comm.send(BufferView{&a, 1, DType::kInt32, {}}, 1, 0);
  comm.release_transfers(1);
  expect_error([&] { s->wait(5s); }, ExitCode::kPeerFailed,
               {"fake send to rank 1 tag 0 #1 failed on rank 0@",
                "rank 1 died (its coordinator connection closed)", "peer reset"});
  // Broken: later collectives and transfers fail with that first error, without running.
  try {
    comm.allreduce(BufferView{&c, 1, DType::kInt32, {}}, ReduceOp::kSum)->wait(5s);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fake send to rank 1 tag 0 #1 failed"), std::string::npos);
  }
  EXPECT_THROW(comm.recv(BufferView{&c, 1, DType::kInt32, {}}, 2, 0)->wait(5s), Error);
  EXPECT_EQ(comm.order, std::vector<int>{1});
  EXPECT_EQ(comm.failures_cleaned, 1);
  // Recorded as a failed collective is: in-process recovery takes it for a peer's failure.
  EXPECT_TRUE(store->check({"comm/unit/failed/0"}));
}

TEST(QueuedCommunicator, ChecksTransferAndAllToAllArgumentsBeforeQueueing) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  ScriptedBackend comm(options(store, 1, 3));
  std::vector<float> buf(8);
  const BufferView v{buf.data(), 4, DType::kFloat32, {}};
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message([&] { comm.send(v, 1, 0); })
                .find("fake send on rank 1: peer 1 is not "
                      "another rank of this communicator (world "
                      "size 3)"),
            std::string::npos);
  EXPECT_NE(message([&] { comm.recv(v, 3, 0); }).find("peer 3 is not another rank"),
            std::string::npos);
  EXPECT_NE(message([&] { comm.recv(v, 0, -2); }).find("fake recv on rank 1: tag -2 outside"),
            std::string::npos);
  EXPECT_THROW(
      comm.send(BufferView{buf.data(), 4, DType::kFloat32, Device{DeviceType::kCUDA, 0}}, 0, 0),
      Error);
  // all_to_all: one count per rank; no overlap between input and output.
  EXPECT_NE(
      message([&] {
        comm.all_to_all(v, {2, 2}, BufferView{buf.data() + 4, 4, DType::kFloat32, {}}, {2, 2});
      }).find("fake all_to_all on rank 1: in_counts has 2 counts, expected one per rank (3)"),
      std::string::npos);
  EXPECT_NE(message([&] {
              comm.all_to_all(v, {1, 2, 1}, BufferView{buf.data() + 2, 4, DType::kFloat32, {}},
                              {1, 2, 1});
            }).find("input and output overlap"),
            std::string::npos);
  EXPECT_TRUE(comm.posted_so_far().empty());
  EXPECT_TRUE(comm.order.empty());
  // Well-formed: queued and run.
  std::vector<int> ints(8, 7);
  comm.all_to_all(BufferView{ints.data(), 4, DType::kInt32, {}}, {1, 2, 1},
                  BufferView{ints.data() + 4, 4, DType::kInt32, {}}, {1, 2, 1})
      ->wait(5s);
  EXPECT_EQ(comm.order, std::vector<int>{7});
}

TEST(QueuedCommunicator, SplitNamesItsGroupsAndTheirErrorsNameTheParentRanks) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  ScriptedBackend comm(options(store, 1, 3));
  auto sub = comm.split(3, 0);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(comm.split(-1, 0), nullptr);
  EXPECT_EQ(comm.split_names, (std::vector<std::string>{"unit.split1.c3", "unit.split2.c-1"}));
  // The sub-group publishes its own alive key, under its own name.
  EXPECT_TRUE(store->check({"comm/unit.split1.c3/alive/0"}));
  auto& scripted = dynamic_cast<ScriptedBackend&>(*sub);
  scripted.fail_at = 0;
  try {
    sub->barrier()->wait(5s);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "fake barrier (group unit.split1.c3 of parent ranks 1, 2) #1 failed on rank 0"),
              std::string::npos)
        << e.what();
  }
  // The parent is not broken by its sub-group's failure.
  int x = 5;
  comm.broadcast(BufferView{&x, 1, DType::kInt32, {}}, 0)->wait(5s);
}

}  // namespace
}  // namespace dnallm::comm
