#include "worker/parallel/ddp.hpp"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <unordered_map>

#include <fmt/format.h>
#if __has_include(<fmt/ranges.h>)
#include <fmt/ranges.h>  // fmt::join lives here from fmt 11 on
#endif

#include "core/clock.hpp"
#include "core/error.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Fires after AccumulateGrad wrote a parameter's gradient (DESIGN.md "Verified facts").
// The gradient reduction dtype as a ScalarType (validated: a floating type of 2 or 4 bytes).
torch::ScalarType reduce_scalar_type(DType t) {
  DNALLM_CHECK(t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16,
               ExitCode::kUsage, "parallel.grad_reduce_dtype must be fp32, bf16 or fp16, not {}",
               dtype_name(t));
  return torch_dtype(t);
}

// Sum of one scalar over all ranks (collective, blocking).
template <typename T>
T sum_over_ranks(comm::Communicator& comm, T value, DType dtype) {
  T v = value;
  comm.allreduce(BufferView{&v, 1, dtype, Device{}}, comm::ReduceOp::kSum)->wait();
  return v;
}

}  // namespace

DdpOptions ddp_options_from_config(const ParallelConfig& parallel) {
  DdpOptions o;
  o.bucket_cap_bytes = static_cast<int64_t>(parallel.bucket_cap_mb * 1024 * 1024);
  o.first_bucket_bytes = static_cast<int64_t>(parallel.first_bucket_mb * 1024 * 1024);
  o.sync_every_micro_step = parallel.accumulate_sync == cfg::AccumulateSync::kEvery;
  o.reduce_dtype = cfg::dtype_of(parallel.grad_reduce_dtype);
  o.zero_stage = static_cast<int>(parallel.zero_stage);
  o.find_unused_parameters = parallel.find_unused_parameters;
  return o;
}

std::vector<std::pair<std::string, torch::Tensor>> bucket_order(
    const std::vector<std::pair<std::string, torch::Tensor>>& registration_order) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto it = registration_order.rbegin(); it != registration_order.rend(); ++it) {
    if (it->second.requires_grad()) out.push_back(*it);
  }
  return out;
}

DataParallel::DataParallel(
    optim::FlatParameters& flat,
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    comm::Communicator& comm, DdpOptions options)
    : flat_(flat), comm_(comm), options_(options), alive_(std::make_shared<bool>(true)) {
  DNALLM_CHECK(options_.zero_stage >= 0 && options_.zero_stage <= 2, ExitCode::kUsage,
               "parallel.zero_stage must be 0, 1 or 2");
  const auto& entries = flat_.entries();
  const int64_t n = static_cast<int64_t>(entries.size());
  std::unordered_map<std::string, torch::Tensor> by_name;
  for (const auto& [name, p] : named_parameters) by_name[name] = p;
  // See Note [Flat layout follows bucket order]: the flat buffer must hold the trainable
  // parameters in reverse registration order, or buckets would not be contiguous slices.
  const auto expected = bucket_order(named_parameters);
  DNALLM_CHECK(expected.size() == entries.size(), ExitCode::kFailure,
               "flat buffer has {} parameters, the model {} trainable ones", entries.size(),
               expected.size());
  for (size_t e = 0; e < entries.size(); ++e) {
    DNALLM_CHECK(entries[e].name == expected[e].first, ExitCode::kFailure,
                 "flat buffer holds '{}' where bucket order puts '{}'; build FlatParameters from "
                 "parallel::bucket_order()",
                 entries[e].name, expected[e].first);
  }
  // Plan buckets over registration order; entries are in reverse registration order.
  std::vector<int64_t> numels(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) numels[r] = entries[n - 1 - r].numel;
  LayoutOptions lo;
  lo.element_bytes = 4;
  lo.bucket_cap_bytes = options_.bucket_cap_bytes;
  lo.first_bucket_bytes = options_.first_bucket_bytes;
  lo.align_elements = 1;
  lo.world_size = 1;
  layout_ = plan_flat_layout(numels, lo);
  bucket_of_entry_.assign(static_cast<size_t>(n), -1);
  for (const auto& plan : layout_.buckets) {
    Bucket b;
    b.range = plan.range;
    for (int64_t r : plan.params) {
      int64_t e = n - 1 - r;
      DNALLM_CHECK(entries[e].offset == layout_.offsets[r], ExitCode::kFailure,
                   "flat buffer of '{}' is not in bucket order; build FlatParameters from "
                   "parallel::bucket_order()",
                   entries[e].name);
      b.entries.push_back(e);
      bucket_of_entry_[e] = static_cast<int64_t>(buckets_.size());
    }
    buckets_.push_back(std::move(b));
  }
  if (!buckets_.empty()) buckets_.back().range.end = flat_.numel();
  ready_.assign(static_cast<size_t>(n), false);
  // Gradient hooks.
  for (int64_t e = 0; e < n; ++e) {
    auto it = by_name.find(entries[e].name);
    DNALLM_CHECK(it != by_name.end(), ExitCode::kFailure, "parameter '{}' missing",
                 entries[e].name);
    params_.push_back(it->second);
    accumulators_.push_back(on_gradient_ready(it->second, alive_, [this, e] { on_ready(e); }));
  }
  // ZeRO: this rank's contiguous share of the flat buffer (balanced like reduce_scatter).
  if (options_.zero_stage > 0) {
    auto s =
        comm::shard_range(static_cast<size_t>(flat_.numel()), comm_.world_size(), comm_.rank());
    owned_ = {static_cast<int64_t>(s.offset), static_cast<int64_t>(s.offset + s.count)};
  } else {
    owned_ = {0, flat_.numel()};
  }
  if (options_.sync_every_micro_step && options_.zero_stage < 2) {
    for (auto& st : stages_) st.grads = torch::zeros_like(flat_.grads());
  }
  launch_buffer_ = flat_.grads();
  launch_into_ = &flat_launched_;
}

DataParallel::~DataParallel() {
  *alive_ = false;  // hooks stay registered inside autograd; they become no-ops
  try {
    complete(flat_launched_);
    for (auto& st : stages_) complete(st.launched);
  } catch (...) {
    // never throw from a destructor; the first error was already reported by finish_step
  }
}

BufferView DataParallel::view(const torch::Tensor& t, int64_t begin, int64_t end) const {
  const auto dtype = dtype_of(t.scalar_type());
  DNALLM_CHECK(dtype.has_value(), ExitCode::kFailure, "DDP: no collective dtype for a {} tensor",
               c10::toString(t.scalar_type()));
  return buffer_view(t, begin, end - begin, *dtype);
}

void DataParallel::broadcast_parameters() {
  const auto& p = flat_.params();
  comm_.broadcast(view(p, 0, p.numel()), 0)->wait();
}

int64_t DataParallel::allreduce_sum(int64_t value) {
  return sum_over_ranks(comm_, value, DType::kInt64);
}

double DataParallel::allreduce_sum(double value) {
  return sum_over_ranks(comm_, value, DType::kFloat64);
}

void DataParallel::point_grads_at(const torch::Tensor& buffer) {
  const auto& entries = flat_.entries();
  for (size_t e = 0; e < entries.size(); ++e) {
    params_[e].mutable_grad() =
        buffer.narrow(0, entries[e].offset, entries[e].numel).view(entries[e].shape);
  }
}

void DataParallel::abandon_step() {
  // The works belong to a communicator already destroyed (their failure is known): drop them.
  flat_launched_.clear();
  for (auto& st : stages_) {
    st.launched.clear();
    st.in_flight = false;
    if (st.grads.defined()) st.grads.zero_();
  }
  armed_ = false;
  step_open_ = false;
  micro_ = 0;
  next_bucket_ = 0;
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& b : buckets_) {
    b.pending = static_cast<int64_t>(b.entries.size());
    b.launched = false;
  }
  point_grads_at(flat_.grads());
  launch_buffer_ = flat_.grads();
  launch_into_ = &flat_launched_;
  flat_.grads().zero_();
}

void DataParallel::begin_micro_step(bool last_micro_step) {
  if (!step_open_) {
    step_open_ = true;
    micro_ = 0;
    exposed_s_ = 0;
    launched_in_backward_ = 0;
  } else {
    end_micro_step();
  }
  const bool every = options_.sync_every_micro_step && options_.zero_stage < 2;
  if (every) {
    Stage& st = stages_[micro_ % 2];
    if (st.in_flight) {
      auto t = Clock::now();
      drain(st);
      exposed_s_ += seconds_since(t);
    }
    point_grads_at(st.grads);
    launch_buffer_ = st.grads;
    launch_into_ = &st.launched;
  }
  for (auto& b : buckets_) {
    b.pending = static_cast<int64_t>(b.entries.size());
    b.launched = false;
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_bucket_ = 0;
  // ZeRO-2 reduce-scatters once after backward; the hooks then only track readiness.
  armed_ = (every || last_micro_step);
  ++micro_;
}

void DataParallel::on_ready(int64_t entry) {
  if (!armed_ || ready_[entry]) return;
  ready_[entry] = true;
  Bucket& b = buckets_[bucket_of_entry_[entry]];
  if (--b.pending == 0) launch_ready_buckets();
}

void DataParallel::launch_ready_buckets() {
  // See Note [Bucket launch order].
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    launch(buckets_[next_bucket_]);
    ++next_bucket_;
  }
}

void DataParallel::launch(Bucket& bucket) {
  bucket.launched = true;
  if (options_.zero_stage == 2) return;  // reduced by one reduce_scatter in finish_step()
  ++launched_in_backward_;
  torch::Tensor target = launch_buffer_.slice(0, bucket.range.begin, bucket.range.end);
  Launched l;
  l.target = target;
  if (options_.reduce_dtype == DType::kFloat32) {
    l.work = comm_.allreduce(view(target, 0, target.numel()), comm::ReduceOp::kSum);
  } else {
    l.staging = target.to(reduce_scalar_type(options_.reduce_dtype));
    l.work = comm_.allreduce(view(l.staging, 0, l.staging.numel()), comm::ReduceOp::kSum);
  }
  launch_into_->push_back(std::move(l));
}

void DataParallel::end_micro_step() {
  if (!armed_) return;
  armed_ = false;
  if (next_bucket_ < buckets_.size()) {
    std::vector<std::string> unused;
    for (size_t e = 0; e < ready_.size(); ++e) {
      if (!ready_[e]) unused.push_back(flat_.entries()[e].name);
    }
    if (!options_.find_unused_parameters) {
      fail(ExitCode::kUsage,
           "{} parameter(s) received no gradient in this step ({}{}); every rank must use every "
           "parameter, or set parallel.find_unused_parameters = true",
           unused.size(),
           fmt::format("{}", fmt::join(unused.begin(),
                                       unused.begin() + std::min<size_t>(5, unused.size()), ", ")),
           unused.size() > 5 ? ", ..." : "");
    }
    // Unused parameters keep a zero gradient contribution; launch the rest in order.
    for (auto& b : buckets_) b.pending = 0;
    launch_ready_buckets();
  }
  const bool every = options_.sync_every_micro_step && options_.zero_stage < 2;
  if (every) stages_[(micro_ - 1) % 2].in_flight = true;
}

void DataParallel::complete(std::vector<Launched>& launched) {
  for (auto& l : launched) {
    l.work->wait();
    if (l.staging.defined()) l.target.copy_(l.staging);
  }
  launched.clear();
}

void DataParallel::drain(Stage& stage) {
  complete(stage.launched);
  flat_.grads().add_(stage.grads);
  stage.grads.zero_();
  stage.in_flight = false;
}

double DataParallel::finish_step() {
  DNALLM_CHECK(step_open_, ExitCode::kFailure, "finish_step() without begin_micro_step()");
  end_micro_step();
  auto t = Clock::now();
  if (options_.zero_stage == 2) {
    // One reduce_scatter of the whole flat gradient into this rank's shard (in place).
    torch::Tensor g = flat_.grads();
    if (options_.reduce_dtype == DType::kFloat32) {
      comm_
          .reduce_scatter(view(g, 0, g.numel()), view(g, owned_.begin, owned_.end),
                          comm::ReduceOp::kSum)
          ->wait();
    } else {
      torch::Tensor staging = g.to(reduce_scalar_type(options_.reduce_dtype));
      comm_
          .reduce_scatter(view(staging, 0, staging.numel()),
                          view(staging, owned_.begin, owned_.end), comm::ReduceOp::kSum)
          ->wait();
      g.slice(0, owned_.begin, owned_.end).copy_(staging.slice(0, owned_.begin, owned_.end));
    }
  } else if (options_.sync_every_micro_step) {
    for (int i = 0; i < 2; ++i) {
      Stage& st = stages_[(micro_ + i) % 2];  // the older stage first
      if (st.in_flight) drain(st);
    }
    point_grads_at(flat_.grads());
    launch_buffer_ = flat_.grads();
  } else {
    complete(flat_launched_);
  }
  step_open_ = false;
  return exposed_s_ + seconds_since(t);
}

double DataParallel::global_grad_norm() {
  if (options_.zero_stage == 2) {
    double partial = optim::grad_sq_sum(flat_.grads().slice(0, owned_.begin, owned_.end));
    return std::sqrt(allreduce_sum(partial));
  }
  return std::sqrt(optim::grad_sq_sum(flat_.grads()));
}

void DataParallel::gather_parameters() {
  if (options_.zero_stage == 0) return;
  const auto& p = flat_.params();
  comm_.allgather(view(p, owned_.begin, owned_.end), view(p, 0, p.numel()))->wait();
}

MemoryAccount DataParallel::allocated_memory(cfg::Precision /*precision*/) const {
  MemoryAccount m;
  const int64_t n = flat_.numel();
  m.params = n * 4;
  m.grads = n * 4;
  for (const auto& st : stages_) {
    if (st.grads.defined()) m.grads += st.grads.numel() * 4;
  }
  // Adam moments for the owned range. The trainer keeps fp32 parameters in every precision
  // (16-bit compute casts on the fly), so there is no separate master copy to count.
  m.optimizer = owned_.size() * 8;
  return m;
}

MemoryAccount DataParallel::paper_memory(cfg::Precision precision) const {
  return account_memory(flat_.numel(), precision, options_.zero_stage, comm_.world_size());
}

}  // namespace dnallm::parallel

namespace dnallm::parallel {

DdpGradientSync::DdpGradientSync(comm::Communicator& comm, DdpOptions options,
                                 cfg::Precision precision)
    : comm_(comm), options_(options), precision_(precision) {}

double DdpGradientSync::sum_scalar(double value) {
  return sum_over_ranks(comm_, value, DType::kFloat64);
}

void DdpGradientSync::attach(
    optim::FlatParameters& flat,
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters) {
  ddp_ = std::make_unique<DataParallel>(flat, named_parameters, comm_, options_);
  if (options_.broadcast_on_attach) ddp_->broadcast_parameters();
}

void DdpGradientSync::before_backward(int64_t, bool last) { ddp_->begin_micro_step(last); }

double DdpGradientSync::wait_gradients() { return ddp_->finish_step(); }

bool DdpGradientSync::abandon_step() {
  if (!ddp_) return false;
  ddp_->abandon_step();
  return true;
}

double DdpGradientSync::grad_sq_norm(const torch::Tensor&) {
  double n = ddp_->global_grad_norm();
  return n * n;
}

std::pair<int64_t, int64_t> DdpGradientSync::shard_range(int64_t numel) const {
  if (!ddp_) return {0, numel};
  auto r = ddp_->owned_range();
  return {r.begin, r.end};
}

void DdpGradientSync::after_optimizer_step(optim::FlatParameters&) { ddp_->gather_parameters(); }

}  // namespace dnallm::parallel
