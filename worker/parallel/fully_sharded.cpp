#include "worker/parallel/fully_sharded.hpp"

#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <set>

#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "worker/models/lora_linear.hpp"
#include "worker/parallel/fully_sharded_detail.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::parallel {

using namespace detail;

FullyShardedSync::FullyShardedSync(comm::Communicator& comm, FullyShardedOptions options)
    : comm_(comm),
      options_(options),
      alive_(std::make_shared<bool>(true)),
      trace_(std::getenv("DNALLM_TRACE_ZERO3") != nullptr) {}

FullyShardedSync::~FullyShardedSync() {
  *alive_ = false;
  if (hooks_) hooks_->detach();
  try {
    complete_all();
  } catch (...) {  // a failed peer: nothing left to reduce into
  }
}

double FullyShardedSync::sum_scalar(double value) {
  double v = value;
  comm_.allreduce(BufferView{&v, 1, DType::kFloat64, Device{}}, comm::ReduceOp::kSum)->wait();
  return v;
}

void FullyShardedSync::launch_gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.gathered || unit.gathering) return;
  const int64_t chunk = unit.shard.chunk;
  if (unit.full.storage().nbytes() == 0) add_live(bytes_of(unit.full), "P+", u);
  allocate_storage(unit.full);
  torch::Tensor mine = shard_params_.narrow(0, unit.shard.local_offset, chunk);
  if (param_dtype_ != torch::kFloat32) {
    // Note [Fully sharded mixed precision]: the chunk is cast before it goes on the wire.
    unit.gather_in = mine.to(param_dtype_);
    mine = unit.gather_in;
  }
  unit.gathering =
      comm_.allgather(view_of(mine, 0, chunk), view_of(unit.full, 0, unit.full.numel()));
  launch_frozen_gather(u);
}

void FullyShardedSync::launch_frozen_gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.frozen_full.defined() && !unit.frozen_gathered && !unit.frozen_gathering) {
    // Note [Fully sharded frozen base]
    if (unit.frozen_full.storage().nbytes() == 0) add_live(bytes_of(unit.frozen_full), "F+", u);
    allocate_storage(unit.frozen_full);
    unit.frozen_gathering =
        comm_.allgather(view_of(unit.frozen_shard, 0, unit.frozen_shard.numel()),
                        view_of(unit.frozen_full, 0, unit.frozen_full.numel()));
  }
}

void FullyShardedSync::gather_whole(size_t u) {
  Unit& unit = units_[u];
  if (unit.whole.storage().nbytes() == 0) add_live(bytes_of(unit.whole), "W+", u);
  allocate_storage(unit.whole);
  comm_
      .allgather(view_of(shard_params_, unit.shard.local_offset, unit.shard.chunk),
                 view_of(unit.whole, 0, unit.whole.numel()))
      ->wait();
  point_params(u, unit.whole);
}

void FullyShardedSync::release_whole(size_t u) {
  Unit& unit = units_[u];
  if (!unit.whole.defined() || unit.whole.storage().nbytes() == 0) return;
  add_live(-bytes_of(unit.whole), "W-", u);
  release_storage(unit.whole);
  // Views are made within a storage's bounds: `full` holds its bytes for that moment (after
  // `whole` gave its twice as many back).
  allocate_storage(unit.full);
  point_params(u, unit.full);
  release_storage(unit.full);
  unit.gathered = false;
  rehook_ = true;
}

void FullyShardedSync::point_params(size_t u, const torch::Tensor& buffer) {
  Unit& unit = units_[u];
  for (size_t k = 0; k < unit.params.size(); ++k) {
    unit.params[k].set_data(
        buffer.narrow(0, unit.offsets[k], unit.params[k].numel()).view(unit.shapes[k]));
  }
}

void FullyShardedSync::hook_gradients() {
  // Note [Fully sharded], step 3: a unit's gradients are complete when all have arrived.
  accumulators_.clear();
  for (size_t u = 0; u < units_.size(); ++u) {
    for (const auto& p : units_[u].params) {
      accumulators_.push_back(on_gradient_ready(p, alive_, [this, u] { on_grad_ready(u); }));
    }
  }
}

void FullyShardedSync::gather(size_t u, bool master) {
  Unit& unit = units_[u];
  if (unit.gathered) return;
  if (gathers_whole(u) || (master && unit.whole.defined())) {
    gather_whole(u);
    launch_frozen_gather(u);
  } else {
    launch_gather(u);  // (the frozen parameters' too)
    // Note [Fully sharded stream order]: the cast chunk goes back to the allocator only after
    // the device stream waits for the all-gather that reads it.
    wait_for_device(unit.gathering);
    unit.gathering.reset();
    unit.gather_in = torch::Tensor();
  }
  if (unit.frozen_gathering) {
    wait_for_device(unit.frozen_gathering);
    unit.frozen_gathering.reset();
  }
  unit.frozen_gathered = unit.frozen_full.defined();
  unit.gathered = true;
}

bool FullyShardedSync::gathers_whole(size_t u) const {
  return (full_ || forwards_) && units_[u].whole.defined();
}

void FullyShardedSync::release(size_t u, bool keep_frozen) {
  Unit& unit = units_[u];
  if (full_) return;
  if (unit.gathering) {  // a prefetch nobody used (e.g. the last block's successor)
    wait_for_device(unit.gathering);
    unit.gathering.reset();
    unit.gather_in = torch::Tensor();
  }
  // Evaluation's fp32 unit under bf16 gathers (Note [Sharded evaluation]).
  if (unit.whole.defined() && unit.whole.storage().nbytes() > 0) release_whole(u);
  if (unit.full.storage().nbytes() > 0) add_live(-bytes_of(unit.full), "P-", u);
  release_storage(unit.full);
  unit.gathered = false;
  if (!keep_frozen) release_frozen(u);
}

void FullyShardedSync::release_frozen(size_t u) {
  Unit& unit = units_[u];
  if (full_ || !unit.frozen_full.defined()) return;
  if (unit.frozen_gathering) {
    wait_for_device(unit.frozen_gathering);
    unit.frozen_gathering.reset();
  }
  if (unit.frozen_full.storage().nbytes() > 0) add_live(-bytes_of(unit.frozen_full), "F-", u);
  release_storage(unit.frozen_full);
  unit.frozen_gathered = false;
}

void FullyShardedSync::allocate_grad(size_t u) {
  Unit& unit = units_[u];
  if (unit.grad_live) return;
  add_live(bytes_of(unit.full_grad), "G+", u);
  allocate_storage(unit.full_grad);
  unit.full_grad.zero_();
  unit.grad_live = true;
}

void FullyShardedSync::release_grad(size_t u) {
  Unit& unit = units_[u];
  if (!unit.grad_live) return;
  add_live(-bytes_of(unit.full_grad), "G-", u);
  release_storage(unit.full_grad);
  unit.grad_live = false;
}

void FullyShardedSync::add_live(int64_t bytes, const char* what, size_t u) {
  live_bytes_ += bytes;
  peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
  if (trace_) std::fprintf(stderr, "zero3 %s %zu live %lld\n", what, u, (long long)live_bytes_);
}

void FullyShardedSync::before_block(size_t u) {
  gather(u);
  if (options_.prefetch && !full_ && u + 1 < root_ && !gathers_whole(u + 1)) launch_gather(u + 1);
}

torch::Tensor FullyShardedSync::after_block(size_t u, torch::Tensor output) {
  if (full_) return output;
  if (torch::GradMode::is_enabled() && output.requires_grad()) {
    std::weak_ptr<bool> alive = alive_;
    output.register_hook([alive, this, u](const torch::Tensor&) {
      if (auto a = alive.lock(); a && *a) before_unit_backward(u);
    });
  }
  release(u);
  return output;
}

void FullyShardedSync::before_unit_backward(size_t u) {
  // Block u + 1's backward is over: the gradient of its input is ready.
  if (u + 1 < root_) release_frozen(u + 1);
  gather(u);
  if (options_.prefetch && u > 0) launch_gather(u - 1);
  allocate_grad(u);
}

void FullyShardedSync::before_forward(int64_t) {
  // The root is gathered for the micro-step (its embeddings run first, its heads last).
  gather(root_);
  if (options_.prefetch && root_ > 0) launch_gather(0);
}

void FullyShardedSync::before_backward(int64_t, bool last) {
  armed_ = true;
  reduce_now_ = last || !options_.accumulate_unsharded;
  for (auto& unit : units_) {
    unit.pending = static_cast<int64_t>(unit.params.size());
    unit.reduced = false;
  }
  // The root's gradients arrive first (the heads) and last (the embeddings).
  allocate_grad(root_);
}

void FullyShardedSync::on_grad_ready(size_t u) {
  if (!armed_) return;
  Unit& unit = units_[u];
  if (--unit.pending > 0) return;
  if (reduce_now_) {
    launch_reduce(u);
  } else {
    release(u, true);  // the gradient stays whole until the last micro-step
  }
}

void FullyShardedSync::launch_reduce(size_t u) {
  Unit& unit = units_[u];
  if (unit.reduced) return;
  unit.reduced = true;
  // Note [Fully sharded], step 3: the parameters are done with; at most two reductions fly.
  release(u, true);
  while (in_flight_.size() >= 2) complete_oldest();
  const int64_t chunk = unit.shard.chunk;
  InFlight f;
  f.unit = u;
  torch::Tensor in = unit.full_grad;
  if (options_.reduce_dtype != DType::kFloat32) {
    // Note [Fully sharded mixed precision]: a 2-byte copy flies instead of the fp32 gradient.
    f.staging = unit.full_grad.to(torch_dtype(options_.reduce_dtype));
    add_live(bytes_of(f.staging), "S+", u);
    release_grad(u);
    in = f.staging;
  }
  f.out = torch::empty({chunk}, shard_grads_.options().dtype(in.scalar_type()));
  f.work = comm_.reduce_scatter(view_of(in, 0, in.numel()), view_of(f.out, 0, chunk),
                                comm::ReduceOp::kSum);
  in_flight_.push_back(std::move(f));
}

void FullyShardedSync::complete_oldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  // Note [Fully sharded stream order]: the add below is queued after the reduction on the
  // device; `out`, `staging` and the gradient buffer are freed after the wait.
  wait_for_device(f.work);
  Unit& unit = units_[f.unit];
  shard_grads_.narrow(0, unit.shard.local_offset, unit.shard.chunk).add_(f.out);
  if (f.staging.defined()) add_live(-bytes_of(f.staging), "S-", f.unit);
  release_grad(f.unit);
}

void FullyShardedSync::wait_for_device(const comm::WorkPtr& work) {
  if (stream_ordered_) {
    work->wait_stream();
  } else {
    work->wait();
  }
}

void FullyShardedSync::complete_all() {
  while (!in_flight_.empty()) complete_oldest();
}

void FullyShardedSync::after_backward(int64_t, bool) {
  torch::NoGradGuard no_grad;
  // Units whose gradients arrived only in part (unused parameters) reduce now, in unit order
  // (the same on every rank); units backward never reached have nothing to reduce.
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    if (reduce_now_ && !unit.reduced && unit.grad_live &&
        unit.pending < static_cast<int64_t>(unit.params.size())) {
      launch_reduce(u);
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  complete_all();
  exposed_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  armed_ = false;
  for (size_t u = 0; u < units_.size(); ++u) {
    // Gathered in backward, never reduced (no gradient arrived); kept when accumulating.
    if (reduce_now_) release_grad(u);
    release(u);
  }
}

double FullyShardedSync::wait_gradients() {
  const double s = exposed_s_;
  exposed_s_ = 0;
  return s;
}

double FullyShardedSync::grad_sq_norm(const torch::Tensor& shard_grads) {
  return sum_scalar(optim::grad_sq_sum(shard_grads));
}

void FullyShardedSync::after_optimizer_step(optim::FlatParameters&) {
  // Units gather when used; one held now (every parameter held, a restore) is stale.
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].gathered) {
      units_[u].gathered = false;
      if (full_) gather(u);
    }
  }
}

bool FullyShardedSync::abandon_step() {
  in_flight_.clear();
  for (auto& unit : units_) {
    unit.gathering.reset();
    unit.frozen_gathering.reset();
    unit.gather_in = torch::Tensor();
    unit.reduced = false;
  }
  full_ = false;
  forwards_ = false;
  armed_ = false;
  reduce_now_ = true;
  exposed_s_ = 0;
  for (size_t u = 0; u < units_.size(); ++u) release_grad(u);
  release_all();
  if (shard_grads_.defined()) shard_grads_.zero_();
  return true;
}

void FullyShardedSync::release_all() {
  for (size_t u = 0; u < units_.size(); ++u) release(u);
  // Changing a parameter's dtype (set_data to `whole` and back, release_whole) drops its
  // gradient accumulator, and the hooks with it: the bf16 parameters get new ones.
  if (rehook_) {
    hook_gradients();
    rehook_ = false;
  }
}

void FullyShardedSync::gather_full_parameters() {
  // Between steps nothing is gathered; under bf16 gathers a unit held now would be the bf16
  // one, and the whole model is gathered in fp32 (Note [Fully sharded mixed precision]).
  release_all();
  full_ = true;
  predicted_peak_bytes_ = std::max(predicted_peak_bytes_, predicted_whole_bytes_);
  for (size_t u = 0; u < units_.size(); ++u) gather(u);
}

void FullyShardedSync::release_full_parameters() {
  full_ = false;
  release_all();
}

void FullyShardedSync::visit_parameter_units(
    const std::function<void(const std::function<bool(const torch::Tensor&)>& held)>& visit) {
  torch::NoGradGuard no_grad;
  if (full_) {  // inside a FullParameters: every unit is held already
    visit([](const torch::Tensor&) { return true; });
    return;
  }
  // Note [Fully sharded exports]: between steps nothing is gathered; a unit held now would be
  // the bf16 one.
  release_all();
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    gather(u, /*master=*/true);
    std::set<const void*> here;
    for (const auto& p : unit.params) here.insert(p.unsafeGetTensorImpl());
    for (const auto& p : unit.frozen) here.insert(p.unsafeGetTensorImpl());
    visit([&](const torch::Tensor& t) {
      const void* impl = t.unsafeGetTensorImpl();
      return here.count(impl) > 0 || sharded_.count(impl) == 0;
    });
    release(u);
  }
  release_all();  // (the gradient hooks again, after the fp32 views of bf16 gathers)
}

void FullyShardedSync::begin_forwards() {
  // Note [Sharded evaluation]: between steps nothing is gathered.
  release_all();
  forwards_ = true;
}

void FullyShardedSync::before_forward_only() {
  gather(root_);
  if (options_.prefetch && root_ > 0 && !gathers_whole(0)) launch_gather(0);
}

void FullyShardedSync::after_forward_only() {
  for (size_t u = 0; u < units_.size(); ++u) release(u);
}

void FullyShardedSync::end_forwards() {
  forwards_ = false;
  release_all();
}

std::optional<GradientSync::Memory> FullyShardedSync::memory() const {
  Memory m;
  const int64_t shard = shard_params_.numel() * 4;
  m.allocated.params = shard;
  m.allocated.grads = shard;
  m.allocated.optimizer = 2 * shard;
  m.paper = account_memory(global_numel_, options_.precision, 3, comm_.world_size());
  m.gathered_peak = peak_live_bytes_;
  m.gathered_predicted = predicted_peak_bytes_;
  m.frozen_held = frozen_held_bytes_;
  m.frozen_total = frozen_total_bytes_;
  m.build_held_peak = build_held_peak_;
  m.build_whole = build_whole_bytes_;
  return m;
}

}  // namespace dnallm::parallel
