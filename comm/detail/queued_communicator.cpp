#include "comm/detail/queued_communicator.hpp"

#include <atomic>
#include <cstring>
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
    : store_(std::move(store)), prefix_("comm/" + name + "/"), rank_(rank), world_(world) {
  if (store_)
    store_->set_owned(prefix_ + "alive/" + std::to_string(rank_),
                      coordinator::to_bytes(host_name()));
}

std::string PeerMonitor::diagnose(uint64_t seq) const {
  if (!store_) return "no coordinator store to name the missing rank(s)";
  try {
    store_->set(prefix_ + "failed/" + std::to_string(rank_),
                coordinator::to_bytes(std::to_string(seq)));
    // A rank that reported this same failure is a survivor even if it has exited since.
    auto reported = [&](int r) {
      auto v = store_->try_get(prefix_ + "failed/" + std::to_string(r));
      return v && coordinator::to_string(*v) == std::to_string(seq);
    };
    std::vector<int> dead;
    const auto deadline = Clock::now() + kDiagnosisWindow;
    while (true) {
      dead.clear();
      for (int r = 0; r < world_; ++r)
        if (r != rank_ && !store_->check({prefix_ + "alive/" + std::to_string(r)}) && !reported(r))
          dead.push_back(r);
      if (!dead.empty() || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!dead.empty())
      return fmt::format("rank(s) {} died (their coordinator connection closed)", join_ranks(dead));
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

// ---------------------------------------------------------------- Work

struct WorkState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;                   // guarded by mutex
  std::atomic<bool> done_flag{false};  // mirrors `done` for lock-free spinning
  std::exception_ptr error;            // guarded by mutex
  uint64_t seq = 0;
  std::string what;  // "gloo allreduce"
  int rank = 0;
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
           state_->monitor->diagnose(state_->seq));
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
      monitor_(std::make_shared<PeerMonitor>(options.store, options.name, rank, world_size)) {}

QueuedCommunicator::~QueuedCommunicator() { stop_worker(); }

void QueuedCommunicator::start_worker() {
  worker_ = std::thread([this] { worker_loop(); });
}

void QueuedCommunicator::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queue_changed_.notify_all();
  if (worker_.joinable()) worker_.join();
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
    std::exception_ptr error = broken_;
    if (!error) {
      try {
        task.fn();
      } catch (const std::exception& e) {
        std::string diagnosis = monitor_->diagnose(task.state->seq);
        auto first =
            Error(ExitCode::kPeerFailed,
                  fmt::format("{} #{} failed on rank {}@{}: {}; cause: {}", task.state->what,
                              task.state->seq, rank_, host_name(), diagnosis, e.what()));
        spdlog::error("{}", first.what());
        broken_ = std::make_exception_ptr(first);
        error = broken_;
        try {
          on_failure();
        } catch (const std::exception& e2) {
          spdlog::warn("cleanup after a failed collective: {}", e2.what());
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(task.state->mutex);
      task.state->done = true;
      task.state->error = error;
    }
    task.state->done_flag.store(true, std::memory_order_release);
    task.state->done_cv.notify_all();
  }
}

WorkPtr QueuedCommunicator::submit(const char* what, std::function<void()> fn) {
  auto state = std::make_shared<WorkState>();
  state->what = fmt::format("{} {}", backend_, what);
  state->rank = rank_;
  state->timeout = timeout_;
  state->spin = spin_wait_ ? kSpinWait : std::chrono::milliseconds(0);
  state->monitor = monitor_;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DNALLM_CHECK(!stopping_, ExitCode::kFailure, "{} issued on a communicator being destroyed",
                 state->what);
    state->seq = next_seq_++;
    queue_.push_back(Task{state, std::move(fn)});
  }
  queue_changed_.notify_one();
  return std::make_shared<QueuedWork>(state);
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

WorkPtr QueuedCommunicator::reduce_scatter(BufferView in, BufferView out, ReduceOp op) {
  check_cpu(in, "reduce_scatter", "input");
  check_cpu(out, "reduce_scatter", "output");
  auto shard = shard_range(in.count, world_, rank_);
  DNALLM_CHECK(out.count == shard.count && in.dtype == out.dtype, ExitCode::kFailure,
               "reduce_scatter on rank {}: output holds {} x {}, expected this rank's shard of "
               "{} x {} ({} elements)",
               rank_, out.count, dtype_name(out.dtype), in.count, dtype_name(in.dtype),
               shard.count);
  return submit("reduce_scatter", [this, in, out, op, shard] {
    if (world_ == 1) {
      if (in.data != out.data) std::memmove(out.data, in.data, in.bytes());
      return;
    }
    (void)shard;
    run_reduce_scatter(in, out, op, 0);
  });
}

WorkPtr QueuedCommunicator::allgather(BufferView in, BufferView out) {
  check_cpu(in, "allgather", "input");
  check_cpu(out, "allgather", "output");
  auto shard = shard_range(out.count, world_, rank_);
  DNALLM_CHECK(in.count == shard.count && in.dtype == out.dtype, ExitCode::kFailure,
               "allgather on rank {}: input holds {} x {}, expected this rank's shard of {} x {} "
               "({} elements)",
               rank_, in.count, dtype_name(in.dtype), out.count, dtype_name(out.dtype),
               shard.count);
  return submit("allgather", [this, in, out] {
    if (world_ == 1) {
      if (in.data != out.data) std::memmove(out.data, in.data, in.bytes());
      return;
    }
    run_allgather(in, out, 0);
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

}  // namespace dnallm::comm::detail
