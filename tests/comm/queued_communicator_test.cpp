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

namespace dnallm::comm {
namespace {

using namespace std::chrono_literals;

class ScriptedBackend final : public detail::QueuedCommunicator {
 public:
  ScriptedBackend(const CommOptions& o)
      : QueuedCommunicator(o, o.rank, o.world_size, "fake", true) {
    start_worker();
  }
  ~ScriptedBackend() override {
    release();
    stop_worker();
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocked_ = false;
    }
    cv_.notify_all();
  }
  std::atomic<int> fail_at{-1};  // throw in the n-th collective (0-based)
  bool block = false;            // the next collective blocks until release()
  std::vector<int> order;        // worker thread only; read after wait()
  int failures_cleaned = 0;

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
  void on_failure() override { ++failures_cleaned; }

 private:
  int calls_ = 0;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool blocked_ = false;  // guarded by mutex_
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
  try {
    w2->wait();
    FAIL() << "the scripted failure did not surface";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kPeerFailed);
    std::string msg = e.what();
    EXPECT_NE(msg.find("fake broadcast #2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank(s) 2 did not arrive"), std::string::npos) << msg;
    EXPECT_NE(msg.find("connection reset"), std::string::npos) << msg;
  }
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

TEST(QueuedCommunicator, WaitTimeoutThrowsPeerFailed) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  store->set("comm/unit/alive/1", {});
  store->set("comm/unit/alive/2", {});
  ScriptedBackend comm(options(store));
  comm.block = true;
  auto w = comm.barrier();
  EXPECT_FALSE(w->is_completed());
  auto t0 = std::chrono::steady_clock::now();
  try {
    w->wait(300ms);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kPeerFailed);
    EXPECT_NE(std::string(e.what()).find("did not complete within 300 ms"), std::string::npos);
  }
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

}  // namespace
}  // namespace dnallm::comm
