// QueuedCommunicator: the part of a CPU backend (gloo, mpi) that is not backend-specific:
// argument checks, the per-communicator worker thread that runs collectives one at a time
// in issue order, Work handles, and failure diagnosis (Note [Peer failure] in
// comm/communicator.hpp).
//
// Note [Posted transfers]
// send / recv must not block the worker: a ring exchange (every rank sends right, then
// receives left) would deadlock if each rank's worker waited for its send before posting
// its recv. So the worker only posts a transfer (post_send / post_recv: gloo's unbound
// buffers, MPI_Isend / MPI_Irecv), in issue order, and hands it to a second thread, the
// completion thread, which waits for posted transfers one after the other (oldest first,
// each until the communicator's timeout after it was posted) and completes their Works.
// gloo cannot poll an unbound buffer without closing its pairs on a timeout, hence a
// thread that blocks rather than a poll in the worker's idle time. Destroying the
// communicator waits for the transfers already posted, each up to its deadline.
// Transfers have their own sequence numbers ("gloo send to rank 1 tag 0 #3"): they are
// not in every rank's collective order, which Note [Peer failure]'s diagnosis relies on;
// an unmatched one names its peer instead (PeerMonitor::diagnose_peer).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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
  // For a point-to-point transfer with `peer` that did not complete: whether the peer died
  // (polled up to kDiagnosisWindow) or is alive but did not post the matching `counterpart`
  // ("send" / "recv"). A dead peer is recorded at failed_key() as diagnose() records a failed
  // collective; a peer that is alive, nothing. Never throws.
  std::string diagnose_peer(int peer, const char* counterpart) const;
  // Where rank `rank` of communicator `name` records a failed transfer (diagnose*()):
  // "comm/<name>/failed/<rank>". In-process recovery reads it (ReformableCommunicator).
  static std::string failed_key(const std::string& name, int rank);
  // Where rank `rank` of communicator `name` says it is alive (owned by its store connection:
  // gone when the process is): "comm/<name>/alive/<rank>".
  static std::string alive_key(const std::string& name, int rank);

 private:
  std::shared_ptr<coordinator::Store> store_;
  std::string name_;
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
  WorkPtr all_to_all(BufferView in, const std::vector<int64_t>& in_counts, BufferView out,
                     const std::vector<int64_t>& out_counts) override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  WorkPtr send(BufferView buf, int peer, int tag) override;
  WorkPtr recv(BufferView buf, int peer, int tag) override;

  // A transfer that post_send / post_recv started (Note [Posted transfers]).
  class PostedTransfer {
   public:
    virtual ~PostedTransfer() = default;
    // Completion thread: returns once the transfer finished; throws (any exception) when
    // it failed or `deadline` passed first. Called at most once.
    virtual void wait_until(std::chrono::steady_clock::time_point deadline) = 0;
  };

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
  // Arguments checked (all_to_all_layout), world size > 1; in and out do not overlap.
  virtual void run_all_to_all(const BufferView& in, const BufferView& out,
                              const AllToAllLayout& layout, uint32_t tag) = 0;
  // Start the transfer without waiting for the peer (Note [Posted transfers]). `peer` is
  // another rank, `tag` in [0, max_tag()].
  virtual std::unique_ptr<PostedTransfer> post_send(const BufferView& buf, int peer, int tag) = 0;
  virtual std::unique_ptr<PostedTransfer> post_recv(const BufferView& buf, int peer, int tag) = 0;
  // The collective part of split(): exchange colors and keys, connect the new group as
  // communicator `name` (split_name()); null for a negative color.
  virtual std::unique_ptr<Communicator> run_split(int color, int key, const std::string& name) = 0;
  // Why `op` ("split", "send", "recv") cannot run on this backend here; "" when it can.
  // Checked before queueing: the error is Error(kUsage).
  virtual std::string unsupported(const char* /*op*/) const { return ""; }
  // Worker or completion thread, once, after the first failure: e.g. close connections so
  // that peers blocked on this rank fail fast instead of waiting for their timeout.
  virtual void on_failure() {}

  // Starts the worker; call at the end of the derived constructor.
  void start_worker();
  // Stops and joins the worker after the queued collectives ran. Idempotent.
  void stop_worker();

  std::chrono::milliseconds timeout() const { return timeout_; }
  // What this communicator was made with (a sub-group starts from a copy of it).
  const CommOptions& options() const { return options_; }
  // Largest tag send / recv accept (MPI: MPI_TAG_UB). Set before start_worker().
  void set_max_tag(int max_tag) { max_tag_ = max_tag; }
  // A sub-group names itself and the ranks it came from in its errors ("gloo allreduce
  // (group test.split1.c0 of parent ranks 1, 3) #4 failed ..."). Before start_worker().
  void set_parent_ranks(const std::vector<int>& parent_ranks);

 private:
  struct Task {
    std::shared_ptr<WorkState> state;
    std::function<void()> fn;
  };
  struct Posted {
    std::shared_ptr<WorkState> state;
    std::unique_ptr<PostedTransfer> transfer;
    std::chrono::steady_clock::time_point deadline;
  };
  std::shared_ptr<WorkState> new_state(const std::string& what, int peer);
  WorkPtr submit(const char* what, std::function<void()> fn);
  WorkPtr submit_transfer(bool is_send, BufferView buf, int peer, int tag);
  // Numbers `state` from `next_seq` (next_seq_ or next_p2p_seq_) and queues `fn` for the
  // worker thread; refuses once the destructor has begun.
  WorkPtr enqueue(const std::shared_ptr<WorkState>& state, uint64_t& next_seq,
                  std::function<void()> fn);
  void worker_loop();
  void completion_loop();
  // The first failure (of a collective or a transfer) breaks the communicator: records
  // it, runs on_failure() once, and returns it; a later one returns the first.
  std::exception_ptr break_on(const WorkState& state, const std::exception& e);
  std::exception_ptr broken() const;
  static void complete(WorkState& state, std::exception_ptr error);
  void check_cpu(const BufferView& b, const char* what, const char* arg) const;
  enum class ShardSide { kInput, kOutput };
  void check_shard(const char* what, const BufferView& in, const BufferView& out,
                   ShardSide shard) const;
  bool copied_alone(const BufferView& in, const BufferView& out) const;
  void check_p2p(const BufferView& b, const char* what, int peer, int tag) const;

  const int rank_;
  const int world_;
  const char* backend_;
  const std::chrono::milliseconds timeout_;
  const bool spin_wait_;
  const CommOptions options_;
  std::shared_ptr<PeerMonitor> monitor_;
  int max_tag_ = INT32_MAX;
  std::string group_label_;  // "" for a communicator made by make_communicator
  uint64_t splits_ = 0;      // worker thread only

  std::mutex mutex_;
  std::condition_variable queue_changed_;
  std::deque<Task> queue_;                 // guarded by mutex_
  bool stopping_ = false;                  // guarded by mutex_
  uint64_t next_seq_ = 1;                  // guarded by mutex_; collectives
  uint64_t next_p2p_seq_ = 1;              // guarded by mutex_; send / recv
  std::deque<Posted> posted_;              // guarded by mutex_; Note [Posted transfers]
  bool worker_done_ = false;               // guarded by mutex_; nothing more will be posted
  std::atomic<uint64_t> posted_count_{0};  // transfers ever posted (kCompletionSpin)
  std::condition_variable posted_changed_;
  mutable std::mutex broken_mutex_;
  std::exception_ptr broken_;  // guarded by broken_mutex_: the first failure
  std::thread worker_;
  std::thread completer_;
};

}  // namespace dnallm::comm::detail
