#include "worker/parallel/device_group.hpp"

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include <spdlog/spdlog.h>

#include "cluster/gpu_placement.hpp"
#include "core/error.hpp"
#include "worker/tensor_buffer.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::parallel {

RankDevice select_rank_device(const Config& config, int local_rank, int local_world_size,
                              bool scheduler_binds_gpus) {
  const torch::Device base = train::pick_device(config.training.device);
  if (!base.is_cuda()) return RankDevice{base, false};
  const int visible = static_cast<int>(torch::cuda::device_count());
  const auto placement =
      cluster::place_on_gpu(local_rank, local_world_size, visible, config.parallel.share_gpus);
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(placement.device_index));
  // Once, at start: every later CUDA call of this process (LibTorch's allocations, NCCL,
  // the staging streams) defaults to this GPU.
  c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).setDevice(device);
  if (placement.shared) {
    spdlog::warn(
        "local rank {} shares cuda:{} with other ranks ({} ranks, {} visible GPU(s), "
        "parallel.share_gpus = true): gradients reduce through host memory",
        local_rank, placement.device_index, local_world_size, visible);
  }
  return RankDevice{device, placement.shared};
}

Device comm_device(const torch::Device& device) {
  if (!device.is_cuda()) return Device{};
  return Device{DeviceType::kCUDA, device.has_index() ? static_cast<int>(device.index()) : 0};
}

namespace {

using Clock = std::chrono::steady_clock;

torch::Device torch_device(const Device& d) {
  if (!d.is_cuda()) return torch::kCPU;
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(d.index));
}

// A tensor over memory owned elsewhere (no copy, no ownership).
torch::Tensor wrap(const BufferView& v) {
  return torch::from_blob(
      v.data, {static_cast<int64_t>(v.count)},
      torch::TensorOptions().dtype(torch_dtype(v.dtype)).device(torch_device(v.device)));
}

void wait_event(const c10::Event& e) {
  while (!e.query()) std::this_thread::sleep_for(std::chrono::microseconds(20));
}

// Completion state of one queued collective, shared by its Work and the staging thread.
struct OpState {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;         // guarded by mutex
  std::exception_ptr error;  // guarded by mutex
  std::string what;
  uint64_t seq = 0;
};

class StagedWork final : public comm::Work {
 public:
  explicit StagedWork(std::shared_ptr<OpState> s) : s_(std::move(s)) {}
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(s_->mutex);
    return s_->done;
  }
  // The staging thread bounds every step (the inner Work's own timeout and diagnosis), so
  // waiting for it without a deadline still ends.
  void wait() override {
    std::unique_lock<std::mutex> lock(s_->mutex);
    s_->cv.wait(lock, [&] { return s_->done; });
    if (s_->error) std::rethrow_exception(s_->error);
  }
  void wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(s_->mutex);
    if (!s_->cv.wait_for(lock, timeout, [&] { return s_->done; })) {
      fail(ExitCode::kPeerFailed, "staged {} #{} did not complete within {} ms", s_->what, s_->seq,
           timeout.count());
    }
    if (s_->error) std::rethrow_exception(s_->error);
  }
  // Note [Stream-ordered wait]: a staged result reaches the caller's buffer through the
  // staging thread's host-to-device copy, which no stream of the caller's can wait for, and a
  // direct one through a host backend: both wait on the host.
  void wait_stream() override { wait(); }

 private:
  std::shared_ptr<OpState> s_;
};

// One collective on its way through the staging thread.
struct StagedOp {
  std::shared_ptr<OpState> state;
  // Unstaged: the inner collective on the caller's own buffers.
  std::function<comm::WorkPtr()> direct;
  // Staged: the inner collective on `staging`; then `dst` <- staging[dst_from, +dst.count).
  std::function<comm::WorkPtr(const torch::Tensor& staging)> collective;
  torch::Tensor staging;
  std::optional<c10::Event> copied;  // device->host copy done (CUDA sources)
  torch::Tensor dst;
  int64_t dst_from = 0;
};

class StagingCommunicator final : public comm::Communicator {
 public:
  StagingCommunicator(std::unique_ptr<comm::Communicator> inner, torch::Device device,
                      StagingOptions options)
      : inner_(std::move(inner)),
        device_(device),
        options_(options),
        inner_cuda_(std::string(inner_->backend()) == "nccl") {
    if (device_.is_cuda() && !inner_cuda_) {
      c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      try {
        copy_stream_ = guard.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
      } catch (const c10::Error&) {
        copy_stream_ = guard.getStream(device_);  // no pool: copies share the current stream
      }
    }
    thread_ = std::thread([this] { run(); });
  }

  ~StagingCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  const char* backend() const override { return inner_->backend(); }

  comm::WorkPtr allreduce(BufferView in, BufferView out, comm::ReduceOp op) override {
    if (!needs_staging(in) && !needs_staging(out))
      return direct("allreduce", [=, this] { return inner_->allreduce(in, out, op); });
    // In place on one staging copy of `in`, then into `out`.
    return staged("allreduce", in, 0, in.count, out, 0, [this, op](const torch::Tensor& s) {
      BufferView v = buffer_view(s, 0, s.numel(), dtype_of(s));
      return inner_->allreduce(v, v, op);
    });
  }
  using Communicator::allreduce;

  comm::WorkPtr reduce_scatter(BufferView in, BufferView out, comm::ReduceOp op) override {
    if (!needs_staging(in) && !needs_staging(out))
      return direct("reduce_scatter", [=, this] { return inner_->reduce_scatter(in, out, op); });
    const auto shard = comm::shard_range(in.count, world_size(), rank());
    return staged("reduce_scatter", in, 0, in.count, out, static_cast<int64_t>(shard.offset),
                  [this, op, shard](const torch::Tensor& s) {
                    const DType t = dtype_of(s);
                    return inner_->reduce_scatter(buffer_view(s, 0, s.numel(), t),
                                                  buffer_view(s, static_cast<int64_t>(shard.offset),
                                                              static_cast<int64_t>(shard.count), t),
                                                  op);
                  });
  }

  comm::WorkPtr allgather(BufferView in, BufferView out) override {
    if (!needs_staging(in) && !needs_staging(out))
      return direct("allgather", [=, this] { return inner_->allgather(in, out); });
    const auto shard = comm::shard_range(out.count, world_size(), rank());
    return staged("allgather", in, static_cast<int64_t>(shard.offset), out.count, out, 0,
                  [this, shard](const torch::Tensor& s) {
                    const DType t = dtype_of(s);
                    return inner_->allgather(buffer_view(s, static_cast<int64_t>(shard.offset),
                                                         static_cast<int64_t>(shard.count), t),
                                             buffer_view(s, 0, s.numel(), t));
                  });
  }

  comm::WorkPtr broadcast(BufferView buf, int root) override {
    if (!needs_staging(buf))
      return direct("broadcast", [=, this] { return inner_->broadcast(buf, root); });
    return staged("broadcast", buf, 0, buf.count, buf, 0, [this, root](const torch::Tensor& s) {
      return inner_->broadcast(buffer_view(s, 0, s.numel(), dtype_of(s)), root);
    });
  }

  comm::WorkPtr barrier() override {
    return direct("barrier", [this] { return inner_->barrier(); });
  }

  // One staging buffer holds `in` then `out`: the exchange runs between its two halves.
  comm::WorkPtr all_to_all(BufferView in, const std::vector<int64_t>& in_counts, BufferView out,
                           const std::vector<int64_t>& out_counts) override {
    if (!needs_staging(in) && !needs_staging(out)) {
      return direct("all_to_all",
                    [=, this] { return inner_->all_to_all(in, in_counts, out, out_counts); });
    }
    const auto n_in = static_cast<int64_t>(in.count);
    return staged("all_to_all", in, 0, in.count + out.count, out, n_in,
                  [this, in_counts, out_counts, n_in](const torch::Tensor& s) {
                    const DType t = dtype_of(s);
                    return inner_->all_to_all(buffer_view(s, 0, n_in, t), in_counts,
                                              buffer_view(s, n_in, s.numel() - n_in, t),
                                              out_counts);
                  });
  }

  // Point to point completes in issue order here, like every staged operation: a rank whose
  // send waits for a peer that first waits for its own send deadlocks, so post receives
  // before sends (a chain, as causal_halo in context_parallel.hpp does).
  comm::WorkPtr send(BufferView buf, int peer, int tag) override {
    if (!needs_staging(buf)) {
      return direct("send", [=, this] { return inner_->send(buf, peer, tag); });
    }
    BufferView nothing = buf;
    nothing.count = 0;  // nothing comes back
    return staged("send", buf, 0, buf.count, nothing, 0, [this, peer, tag](const torch::Tensor& s) {
      return inner_->send(buffer_view(s, 0, s.numel(), dtype_of(s)), peer, tag);
    });
  }

  comm::WorkPtr recv(BufferView buf, int peer, int tag) override {
    if (!needs_staging(buf)) {
      return direct("recv", [=, this] { return inner_->recv(buf, peer, tag); });
    }
    BufferView nothing = buf;
    nothing.count = 0;  // nothing to send
    return staged("recv", nothing, 0, buf.count, buf, 0, [this, peer, tag](const torch::Tensor& s) {
      return inner_->recv(buffer_view(s, 0, s.numel(), dtype_of(s)), peer, tag);
    });
  }

  // A collective like the others: issued after everything queued before it (the staging
  // thread runs it), the new group staged the same way.
  std::unique_ptr<comm::Communicator> split(int color, int key) override {
    std::unique_ptr<comm::Communicator> group;
    direct("split", [&, this] {
      group = inner_->split(color, key);
      return inner_->barrier();  // a Work to wait for; every rank of the parent issues it
    })->wait();
    if (!group) return nullptr;
    return stage_for_device(std::move(group), device_, options_);
  }

 private:
  // A byte view of a type we do not carry (bool) as uint8, as the collectives only copy it.
  static DType dtype_of(const torch::Tensor& t) {
    return dnallm::dtype_of(t.scalar_type()).value_or(DType::kUInt8);
  }

  bool needs_staging(const BufferView& v) const {
    if (inner_cuda_) return !v.device.is_cuda();
    return v.device.is_cuda() || options_.stage_host_buffers;
  }

  std::shared_ptr<OpState> new_state(const char* what) {
    auto s = std::make_shared<OpState>();
    s->what = std::string(inner_->backend()) + " " + what;
    s->seq = next_seq_++;
    return s;
  }

  comm::WorkPtr direct(const char* what, std::function<comm::WorkPtr()> call) {
    std::lock_guard<std::mutex> issue(issue_mutex_);
    // NCCL: staged host buffers complete synchronously at issue, so issuing the rest at
    // once keeps the caller's order (and NCCL's own stream-ordered Work).
    if (inner_cuda_) return call();
    StagedOp op;
    op.state = new_state(what);
    op.direct = std::move(call);
    return push(std::move(op));
  }

  // Copies `src` into staging[src_at, +src.count) of a `count`-element staging buffer, runs
  // `collective` on the staging buffer, copies staging[dst_from, +dst.count) into `dst`.
  comm::WorkPtr staged(const char* what, const BufferView& src, int64_t src_at, size_t count,
                       const BufferView& dst, int64_t dst_from,
                       std::function<comm::WorkPtr(const torch::Tensor&)> collective) {
    std::lock_guard<std::mutex> issue(issue_mutex_);
    StagedOp op;
    op.state = new_state(what);
    op.collective = std::move(collective);
    op.dst = wrap(dst);
    op.dst_from = dst_from;
    const torch::Tensor source = wrap(src);
    const auto n = static_cast<int64_t>(count);
    if (inner_cuda_) {
      // Host buffers for NCCL (Note [Staged collectives]): synchronous, on the caller.
      op.staging =
          torch::empty({n}, torch::TensorOptions().dtype(source.scalar_type()).device(device_));
      op.staging.narrow(0, src_at, source.numel()).copy_(source);
      op.collective(op.staging)->wait();
      op.dst.copy_(op.staging.narrow(0, dst_from, op.dst.numel()));
      std::lock_guard<std::mutex> lock(op.state->mutex);
      op.state->done = true;
      return std::make_shared<StagedWork>(op.state);
    }
    auto host = torch::TensorOptions().dtype(source.scalar_type());
    if (source.is_cuda() || op.dst.is_cuda()) host = host.pinned_memory(true);
    op.staging = torch::empty({n}, host);
    if (source.is_cuda()) {
      // Step 1: after everything the caller's stream did so far, on the copy stream.
      c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      const c10::Stream current = guard.getStream(source.device());
      c10::Event ready(c10::DeviceType::CUDA);
      ready.record(current);
      ready.block(*copy_stream_);
      {
        c10::StreamGuard on_copy(*copy_stream_);
        op.staging.narrow(0, src_at, source.numel()).copy_(source, /*non_blocking=*/true);
      }
      op.copied.emplace(c10::DeviceType::CUDA);
      op.copied->record(*copy_stream_);
    } else {
      op.staging.narrow(0, src_at, source.numel()).copy_(source);
    }
    return push(std::move(op));
  }

  comm::WorkPtr push(StagedOp op) {
    auto work = std::make_shared<StagedWork>(op.state);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(op));
    }
    cv_.notify_all();
    return work;
  }

  // Step 2, in issue order.
  void run() {
    std::optional<c10::DeviceGuard> on_device;
    if (device_.is_cuda()) on_device.emplace(device_);
    while (true) {
      StagedOp op;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything issued has completed
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error = broken_;
      if (!error) {
        try {
          complete(op);
        } catch (...) {
          error = std::current_exception();
          broken_ = error;  // Communicator contract: later collectives fail with the first error
        }
      }
      std::lock_guard<std::mutex> lock(op.state->mutex);
      op.state->error = error;
      op.state->done = true;
      op.state->cv.notify_all();
    }
  }

  void complete(StagedOp& op) {
    if (op.direct) {
      op.direct()->wait();
      return;
    }
    if (op.copied) wait_event(*op.copied);
    op.collective(op.staging)->wait();
    const torch::Tensor result = op.staging.narrow(0, op.dst_from, op.dst.numel());
    if (op.dst.is_cuda()) {
      c10::Event back(c10::DeviceType::CUDA);
      {
        c10::StreamGuard on_copy(*copy_stream_);
        op.dst.copy_(result, /*non_blocking=*/true);
      }
      back.record(*copy_stream_);
      wait_event(back);  // the caller's later kernels run after Work::wait() returned
    } else {
      op.dst.copy_(result);
    }
  }

  std::unique_ptr<comm::Communicator> inner_;
  torch::Device device_;
  StagingOptions options_;
  bool inner_cuda_;
  std::optional<c10::Stream> copy_stream_;

  std::mutex issue_mutex_;  // serialises issuing: staging copies and queue order agree
  uint64_t next_seq_ = 1;   // guarded by issue_mutex_

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<StagedOp> queue_;  // guarded by mutex_
  bool stopping_ = false;       // guarded by mutex_
  std::exception_ptr broken_;   // staging thread only
  std::thread thread_;
};

}  // namespace

std::unique_ptr<comm::Communicator> stage_for_device(std::unique_ptr<comm::Communicator> inner,
                                                     const torch::Device& device,
                                                     StagingOptions options) {
  const bool nccl = std::string(inner->backend()) == "nccl";
  // nccl: host scalars go to the GPU; gloo/mpi: GPU buffers go to the host.
  const bool needed = nccl || device.is_cuda() || options.stage_host_buffers;
  if (!needed) return inner;
  if (!nccl && device.is_cuda()) {
    spdlog::info("{} backend on {}: collectives are staged through pinned host memory",
                 inner->backend(), device.str());
  } else if (options.stage_host_buffers) {
    spdlog::info("{} backend: host buffers are staged too (test mode)", inner->backend());
  }
  return std::make_unique<StagingCommunicator>(std::move(inner), device, options);
}

}  // namespace dnallm::parallel
