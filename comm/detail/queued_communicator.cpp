#include "comm/detail/queued_communicator.hpp"

#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#include <spdlog/spdlog.h>

#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::comm::detail {

using Clock = std::chrono::steady_clock;

// Note [Spin wait]
// Work::wait() first polls (yielding) for up to kSpinWait before sleeping on the condition
// variable. On virtual machines an idle vCPU halts and is woken late (we measured gloo
// allreduce at a 4 ms floor, one scheduler tick, with blocking waits, and ~0.2 ms with a
// busy vCPU), so a waiter that keeps its CPU busy during a collective makes it several
// times faster. Past kSpinWait the waiter sleeps, so long waits cost no CPU. Backends whose
// library already busy-polls (MPI) turn it off: a second spinning thread per rank only
// steals the CPU from the one making progress when ranks share cores.
constexpr std::chrono::milliseconds kSpinWait{200};
// The completion thread of a spinning backend (Note [Posted transfers]) polls for the next
// transfer this long before sleeping: a ring exchange's send and recv then cost ~60 us on
// gloo instead of the 2-4 ms of waking a sleeping thread on a loaded VM (measured with
// dnallm-bench-comm --op sendrecv, 2 ranks on 2 vCPUs). Short, so that an idle
// communicator stops burning a CPU 2 ms after its last transfer.
constexpr std::chrono::milliseconds kCompletionSpin{2};

namespace {

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace

// ---------------------------------------------------------------- PeerMonitor

PeerMonitor::PeerMonitor(std::shared_ptr<coordinator::Store> store, std::string name, int rank,
                         int world)
    : store_(std::move(store)), name_(name), rank_(rank), world_(world) {
  if (store_) store_->set_owned(alive_key(name_, rank_), coordinator::to_bytes(host_name()));
}

std::string PeerMonitor::failed_key(const std::string& name, int rank) {
  return "comm/" + name + "/failed/" + std::to_string(rank);
}

std::string PeerMonitor::alive_key(const std::string& name, int rank) {
  return "comm/" + name + "/alive/" + std::to_string(rank);
}

std::string PeerMonitor::diagnose(uint64_t seq) const {
  if (!store_) return "no coordinator store to name the missing rank(s)";
  try {
    store_->set(failed_key(name_, rank_), coordinator::to_bytes(std::to_string(seq)));
    // A rank that reported this same failure is a survivor even if it has exited since; one
    // that reported any failure (another collective, a transfer) and exited followed the
    // first loss, so it is not named as the culprit (Note [Peer failure]).
    auto failure_of = [&](int r) -> std::optional<std::string> {
      auto v = store_->try_get(failed_key(name_, r));
      if (!v) return std::nullopt;
      return coordinator::to_string(*v);
    };
    auto reported = [&](int r) { return failure_of(r) == std::to_string(seq); };
    std::vector<int> dead, followed;
    const auto deadline = Clock::now() + kDiagnosisWindow;
    while (true) {
      dead.clear();
      followed.clear();
      for (int r = 0; r < world_; ++r) {
        if (r == rank_ || store_->check({alive_key(name_, r)}) || reported(r)) continue;
        (failure_of(r) ? followed : dead).push_back(r);
      }
      if (!dead.empty() || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const std::string after =
        followed.empty()
            ? ""
            : fmt::format("; rank(s) {} failed after it and exited", join_ranks(followed));
    if (!dead.empty())
      return fmt::format("rank(s) {} died (their coordinator connection closed){}",
                         join_ranks(dead), after);
    if (!followed.empty())
      return fmt::format("rank(s) {} failed in another transfer and exited", join_ranks(followed));
    std::vector<int> absent;
    for (int r = 0; r < world_; ++r)
      if (r != rank_ && !reported(r)) absent.push_back(r);
    if (absent.empty()) return "every rank saw this failure; see the transport error";
    return fmt::format("rank(s) {} did not arrive (alive but not in this collective)",
                       join_ranks(absent));
  } catch (const std::exception& e) {
    return fmt::format("the coordinator could not be asked which rank failed ({})", e.what());
  }
}

std::string PeerMonitor::diagnose_peer(int peer, const char* counterpart) const {
  if (!store_) return fmt::format("no coordinator store to tell whether rank {} is alive", peer);
  try {
    const std::string key = alive_key(name_, peer);
    const auto deadline = Clock::now() + kDiagnosisWindow;
    while (store_->check({key})) {
      if (Clock::now() >= deadline)
        return fmt::format("rank {} is alive but posted no matching {}", peer, counterpart);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    // A dead peer is recorded as a collective's failure is (Note [In-process recovery] reads
    // it); a transfer that is only slow records nothing.
    store_->set(failed_key(name_, rank_), coordinator::to_bytes(fmt::format("peer {}", peer)));
    return fmt::format("rank {} died (its coordinator connection closed)", peer);
  } catch (const std::exception& e) {
    return fmt::format("the coordinator could not be asked whether rank {} is alive ({})", peer,
                       e.what());
  }
}

// ---------------------------------------------------------------- Work

struct WorkState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;                   // guarded by mutex
  std::atomic<bool> done_flag{false};  // mirrors `done` for lock-free spinning
  std::exception_ptr error;            // guarded by mutex
  uint64_t seq = 0;
  std::string what;  // "gloo allreduce", "gloo send to rank 1 tag 3"
  int rank = 0;
  int peer = -1;                 // send / recv: the other rank
  const char* counterpart = "";  // send / recv: what the peer must post

  std::chrono::milliseconds timeout{0};
  std::chrono::milliseconds spin{0};  // Note [Spin wait]
  std::shared_ptr<PeerMonitor> monitor;
};

namespace {

class QueuedWork final : public Work {
 public:
  explicit QueuedWork(std::shared_ptr<WorkState> s) : state_(std::move(s)) {}
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->done;
  }
  void wait() override { wait(state_->timeout + kDiagnosisGrace); }
  void wait(std::chrono::milliseconds timeout) override {
    // See Note [Spin wait].
    const auto spin_until = Clock::now() + std::min(timeout, state_->spin);
    while (!state_->done_flag.load(std::memory_order_acquire) && Clock::now() < spin_until)
      std::this_thread::yield();
    std::unique_lock<std::mutex> lock(state_->mutex);
    if (!state_->done_cv.wait_for(lock, timeout, [&] { return state_->done; })) {
      lock.unlock();
      fail(ExitCode::kPeerFailed, "{} #{} did not complete within {} ms on rank {}@{}: {}",
           state_->what, state_->seq, timeout.count(), state_->rank, host_name(),
           state_->peer >= 0 ? state_->monitor->diagnose_peer(state_->peer, state_->counterpart)
                             : state_->monitor->diagnose(state_->seq));
    }
    if (state_->error) std::rethrow_exception(state_->error);
  }

 private:
  std::shared_ptr<WorkState> state_;
};

}  // namespace

// ---------------------------------------------------------------- QueuedCommunicator

QueuedCommunicator::QueuedCommunicator(const CommOptions& options, int rank, int world_size,
                                       const char* backend, bool spin_wait)
    : rank_(rank),
      world_(world_size),
      backend_(backend),
      timeout_(options.timeout),
      spin_wait_(spin_wait),
      options_(options),
      monitor_(std::make_shared<PeerMonitor>(options.store, options.name, rank, world_size)) {}

QueuedCommunicator::~QueuedCommunicator() { stop_worker(); }

void QueuedCommunicator::set_parent_ranks(const std::vector<int>& parent_ranks) {
  group_label_ =
      fmt::format(" (group {} of parent ranks {})", options_.name, join_ranks(parent_ranks));
}

void QueuedCommunicator::start_worker() {
  worker_ = std::thread([this] { worker_loop(); });
  completer_ = std::thread([this] { completion_loop(); });
}

void QueuedCommunicator::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queue_changed_.notify_all();
  if (worker_.joinable()) worker_.join();
  // The completion thread finishes the transfers posted so far (each within its deadline).
  {
    std::lock_guard<std::mutex> lock(mutex_);
    worker_done_ = true;
  }
  posted_changed_.notify_all();
  if (completer_.joinable()) completer_.join();
}

std::exception_ptr QueuedCommunicator::broken() const {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  return broken_;
}

std::exception_ptr QueuedCommunicator::break_on(const WorkState& state, const std::exception& e) {
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    if (broken_) return broken_;
  }
  const std::string diagnosis = state.peer >= 0
                                    ? monitor_->diagnose_peer(state.peer, state.counterpart)
                                    : monitor_->diagnose(state.seq);
  auto first = Error(ExitCode::kPeerFailed,
                     fmt::format("{} #{} failed on rank {}@{}: {}; cause: {}", state.what,
                                 state.seq, rank_, host_name(), diagnosis, e.what()));
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    if (broken_) return broken_;  // the other thread failed meanwhile: keep the first error
    broken_ = std::make_exception_ptr(first);
  }
  spdlog::error("{}", first.what());
  try {
    on_failure();
  } catch (const std::exception& e2) {
    spdlog::warn("cleanup after a failed {}: {}", state.what, e2.what());
  }
  return broken();
}

void QueuedCommunicator::complete(WorkState& state, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.done = true;
    state.error = std::move(error);
  }
  state.done_flag.store(true, std::memory_order_release);
  state.done_cv.notify_all();
}

void QueuedCommunicator::worker_loop() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queue_changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything issued has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error = broken();
    if (!error) {
      try {
        task.fn();
        // A posted transfer (Note [Posted transfers]) completes on the completion thread.
        if (task.state->peer >= 0) continue;
      } catch (const std::exception& e) {
        error = break_on(*task.state, e);
      }
    }
    complete(*task.state, error);
  }
}

void QueuedCommunicator::completion_loop() {
  uint64_t taken = 0;  // transfers taken from posted_ so far
  while (true) {
    Posted p;
    if (spin_wait_) {  // See kCompletionSpin.
      const auto spin_until = Clock::now() + kCompletionSpin;
      while (posted_count_.load(std::memory_order_acquire) == taken && Clock::now() < spin_until)
        std::this_thread::yield();
    }
    {
      std::unique_lock<std::mutex> lock(mutex_);
      posted_changed_.wait(lock, [&] { return worker_done_ || !posted_.empty(); });
      if (posted_.empty()) return;  // the worker stopped and everything posted completed
      p = std::move(posted_.front());
      posted_.pop_front();
      ++taken;
    }
    std::exception_ptr error = broken();
    if (!error) {
      try {
        p.transfer->wait_until(p.deadline);
      } catch (const std::exception& e) {
        error = break_on(*p.state, e);
      }
    }
    p.transfer.reset();  // the backend's handle dies before the Work reports completion
    complete(*p.state, error);
  }
}

std::shared_ptr<WorkState> QueuedCommunicator::new_state(const std::string& what, int peer) {
  auto state = std::make_shared<WorkState>();
  state->what = fmt::format("{} {}{}", backend_, what, group_label_);
  state->rank = rank_;
  state->peer = peer;
  state->timeout = timeout_;
  state->spin = spin_wait_ ? kSpinWait : std::chrono::milliseconds(0);
  state->monitor = monitor_;
  return state;
}

WorkPtr QueuedCommunicator::enqueue(const std::shared_ptr<WorkState>& state, uint64_t& next_seq,
                                    std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DNALLM_CHECK(!stopping_, ExitCode::kFailure, "{} issued on a communicator being destroyed",
                 state->what);
    state->seq = next_seq++;
    queue_.push_back(Task{state, std::move(fn)});
  }
  queue_changed_.notify_one();
  return std::make_shared<QueuedWork>(state);
}

WorkPtr QueuedCommunicator::submit(const char* what, std::function<void()> fn) {
  return enqueue(new_state(what, -1), next_seq_, std::move(fn));
}

WorkPtr QueuedCommunicator::submit_transfer(bool is_send, BufferView buf, int peer, int tag) {
  auto state = new_state(
      fmt::format("{} rank {} tag {}", is_send ? "send to" : "recv from", peer, tag), peer);
  state->counterpart = is_send ? "recv" : "send";
  auto post = [this, is_send, buf, peer, tag, state] {
    auto transfer = is_send ? post_send(buf, peer, tag) : post_recv(buf, peer, tag);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      posted_.push_back(Posted{state, std::move(transfer), Clock::now() + timeout_});
      posted_count_.fetch_add(1, std::memory_order_release);
    }
    posted_changed_.notify_one();
  };
  return enqueue(state, next_p2p_seq_, std::move(post));
}

void QueuedCommunicator::check_cpu(const BufferView& b, const char* what, const char* arg) const {
  DNALLM_CHECK(!b.device.is_cuda(), ExitCode::kUsage,
               "{} {}: {} is a CUDA buffer; use the nccl backend for GPU tensors", backend_, what,
               arg);
  DNALLM_CHECK(b.data != nullptr || b.count == 0, ExitCode::kFailure, "{} {}: {} is null", backend_,
               what, arg);
}

WorkPtr QueuedCommunicator::allreduce(BufferView in, BufferView out, ReduceOp op) {
  check_cpu(in, "allreduce", "input");
  check_cpu(out, "allreduce", "output");
  DNALLM_CHECK(in.count == out.count && in.dtype == out.dtype, ExitCode::kFailure,
               "allreduce: input ({} x {}) and output ({} x {}) differ", in.count,
               dtype_name(in.dtype), out.count, dtype_name(out.dtype));
  return submit("allreduce", [this, in, out, op] {
    uint32_t tag = 0;
    if (world_ == 1) {
      if (in.data != out.data) std::memcpy(out.data, in.data, in.bytes());
      return;
    }
    run_allreduce(in, out, op, tag);
  });
}

// reduce_scatter's output and allgather's input (`shard`) must be this rank's shard of the other
// buffer, of the same dtype.
void QueuedCommunicator::check_shard(const char* what, const BufferView& in, const BufferView& out,
                                     ShardSide shard) const {
  check_cpu(in, what, "input");
  check_cpu(out, what, "output");
  const bool output = shard == ShardSide::kOutput;
  const BufferView& part = output ? out : in;
  const BufferView& whole = output ? in : out;
  auto range = shard_range(whole.count, world_, rank_);
  DNALLM_CHECK(part.count == range.count && part.dtype == whole.dtype, ExitCode::kFailure,
               "{} on rank {}: {} holds {} x {}, expected this rank's shard of {} x {} ({} "
               "elements)",
               what, rank_, output ? "output" : "input", part.count, dtype_name(part.dtype),
               whole.count, dtype_name(whole.dtype), range.count);
}

// One rank: a reduce_scatter or an allgather is a copy, none when in place. True if it was.
bool QueuedCommunicator::copied_alone(const BufferView& in, const BufferView& out) const {
  if (world_ != 1) return false;
  if (in.data != out.data) std::memmove(out.data, in.data, in.bytes());
  return true;
}

WorkPtr QueuedCommunicator::reduce_scatter(BufferView in, BufferView out, ReduceOp op) {
  check_shard("reduce_scatter", in, out, ShardSide::kOutput);
  return submit("reduce_scatter", [this, in, out, op] {
    if (!copied_alone(in, out)) run_reduce_scatter(in, out, op, 0);
  });
}

WorkPtr QueuedCommunicator::allgather(BufferView in, BufferView out) {
  check_shard("allgather", in, out, ShardSide::kInput);
  return submit("allgather", [this, in, out] {
    if (!copied_alone(in, out)) run_allgather(in, out, 0);
  });
}

WorkPtr QueuedCommunicator::broadcast(BufferView buf, int root) {
  check_cpu(buf, "broadcast", "buffer");
  DNALLM_CHECK(root >= 0 && root < world_, ExitCode::kFailure,
               "broadcast: root {} outside world size {}", root, world_);
  return submit("broadcast", [this, buf, root] {
    if (world_ > 1) run_broadcast(buf, root, 0);
  });
}

WorkPtr QueuedCommunicator::barrier() {
  return submit("barrier", [this] {
    if (world_ > 1) run_barrier(0);
  });
}

WorkPtr QueuedCommunicator::all_to_all(BufferView in, const std::vector<int64_t>& in_counts,
                                       BufferView out, const std::vector<int64_t>& out_counts) {
  check_cpu(in, "all_to_all", "input");
  check_cpu(out, "all_to_all", "output");
  DNALLM_CHECK(in.dtype == out.dtype, ExitCode::kFailure,
               "{} all_to_all on rank {}: input is {}, output {}", backend_, rank_,
               dtype_name(in.dtype), dtype_name(out.dtype));
  AllToAllLayout layout =
      all_to_all_layout(backend_, world_, rank_, in.count, in_counts, out.count, out_counts);
  const auto* ib = static_cast<const uint8_t*>(in.data);
  const auto* ob = static_cast<const uint8_t*>(out.data);
  DNALLM_CHECK(
      in.bytes() == 0 || out.bytes() == 0 || ib + in.bytes() <= ob || ob + out.bytes() <= ib,
      ExitCode::kFailure,
      "{} all_to_all on rank {}: input and output overlap (no in-place all_to_all)", backend_,
      rank_);
  return submit("all_to_all", [this, in, out, layout = std::move(layout)] {
    if (world_ == 1) {
      if (in.bytes() > 0) std::memcpy(out.data, in.data, in.bytes());
      return;
    }
    run_all_to_all(in, out, layout, 0);
  });
}

std::unique_ptr<Communicator> QueuedCommunicator::split(int color, int key) {
  const std::string why = unsupported("split");
  DNALLM_CHECK(why.empty(), ExitCode::kUsage, "{} split: {}", backend_, why);
  auto result = std::make_shared<std::unique_ptr<Communicator>>();
  auto work = submit("split", [this, color, key, result] {
    *result = run_split(color, key, split_name(options_.name, ++splits_, color));
  });
  // The exchange of colors, then the new group's connection: each may take a timeout.
  work->wait(2 * timeout_ + kDiagnosisGrace);
  return std::move(*result);
}

void QueuedCommunicator::check_p2p(const BufferView& b, const char* what, int peer, int tag) const {
  const std::string why = unsupported(what);
  DNALLM_CHECK(why.empty(), ExitCode::kUsage, "{} {}: {}", backend_, what, why);
  check_cpu(b, what, "buffer");
  DNALLM_CHECK(peer >= 0 && peer < world_ && peer != rank_, ExitCode::kFailure,
               "{} {} on rank {}: peer {} is not another rank of this communicator (world size "
               "{})",
               backend_, what, rank_, peer, world_);
  DNALLM_CHECK(tag >= 0 && tag <= max_tag_, ExitCode::kFailure,
               "{} {} on rank {}: tag {} outside [0, {}]", backend_, what, rank_, tag, max_tag_);
}

WorkPtr QueuedCommunicator::send(BufferView buf, int peer, int tag) {
  check_p2p(buf, "send", peer, tag);
  return submit_transfer(true, buf, peer, tag);
}

WorkPtr QueuedCommunicator::recv(BufferView buf, int peer, int tag) {
  check_p2p(buf, "recv", peer, tag);
  return submit_transfer(false, buf, peer, tag);
}

}  // namespace dnallm::comm::detail
