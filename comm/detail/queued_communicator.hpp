// QueuedCommunicator: the part of a CPU backend (gloo, mpi) that is not backend-specific:
// argument checks, the per-communicator worker thread that runs collectives one at a time
// in issue order, Work handles, and failure diagnosis (Note [Peer failure] in
// comm/communicator.hpp).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/communicator.hpp"

namespace dnallm::comm::detail {

// Names the dead or missing ranks through the store (Note [Peer failure]). Thread-safe.
class PeerMonitor {
 public:
  // Publishes this rank's alive key (owned by the store connection). `store` may be null:
  // diagnosis then says that no rank can be named.
  PeerMonitor(std::shared_ptr<coordinator::Store> store, std::string name, int rank, int world);
  // Records that collective `seq` failed here and polls up to kDiagnosisWindow. Returns a
  // phrase such as "rank(s) 2 died (their coordinator connection closed)". Never throws.
  std::string diagnose(uint64_t seq) const;

 private:
  std::shared_ptr<coordinator::Store> store_;
  std::string prefix_;
  int rank_;
  int world_;
};

struct WorkState;

class QueuedCommunicator : public Communicator {
 public:
  // `spin_wait`: Work::wait polls before sleeping (Note [Spin wait] in the .cpp).
  QueuedCommunicator(const CommOptions& options, int rank, int world_size, const char* backend,
                     bool spin_wait);
  // Derived destructors must call stop_worker() first (the worker calls their run_*).
  ~QueuedCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return backend_; }

  WorkPtr allreduce(BufferView in, BufferView out, ReduceOp op) override;
  using Communicator::allreduce;
  WorkPtr reduce_scatter(BufferView in, BufferView out, ReduceOp op) override;
  WorkPtr allgather(BufferView in, BufferView out) override;
  WorkPtr broadcast(BufferView buf, int root) override;
  WorkPtr barrier() override;

 protected:
  // Run on the worker thread only, one at a time. Throw on failure (any exception).
  // `tag` is the collective's sequence number (truncated), the same on every rank.
  virtual void run_allreduce(const BufferView& in, const BufferView& out, ReduceOp op,
                             uint32_t tag) = 0;
  virtual void run_reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp op,
                                  uint32_t tag) = 0;
  virtual void run_allgather(const BufferView& in, const BufferView& out, uint32_t tag) = 0;
  virtual void run_broadcast(const BufferView& buf, int root, uint32_t tag) = 0;
  virtual void run_barrier(uint32_t tag) = 0;
  // Worker thread, once, after the first failure: e.g. close connections so that peers
  // blocked on this rank fail fast instead of waiting for their timeout.
  virtual void on_failure() {}

  // Starts the worker; call at the end of the derived constructor.
  void start_worker();
  // Stops and joins the worker after the queued collectives ran. Idempotent.
  void stop_worker();

  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  struct Task {
    std::shared_ptr<WorkState> state;
    std::function<void()> fn;
  };
  WorkPtr submit(const char* what, std::function<void()> fn);
  void worker_loop();
  void check_cpu(const BufferView& b, const char* what, const char* arg) const;

  const int rank_;
  const int world_;
  const char* backend_;
  const std::chrono::milliseconds timeout_;
  const bool spin_wait_;
  std::shared_ptr<PeerMonitor> monitor_;

  std::mutex mutex_;
  std::condition_variable queue_changed_;
  std::deque<Task> queue_;     // guarded by mutex_
  bool stopping_ = false;      // guarded by mutex_
  uint64_t next_seq_ = 1;      // guarded by mutex_
  std::exception_ptr broken_;  // worker thread only: the first failure
  std::thread worker_;
};

}  // namespace dnallm::comm::detail
