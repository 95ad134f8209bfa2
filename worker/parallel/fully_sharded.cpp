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
#include "worker/tensor_buffer.hpp"

namespace dnallm::parallel {

namespace {

constexpr int64_t kAlign = 16;  // elements: each parameter starts 64 bytes in, as DDP's layout

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The elements a tensor takes in a unit's fp32 buffer: a floating-point one its own (a parameter,
// or a QLoRA base's fp32 scales), an integer one its bytes in 4-byte words (a QLoRA base's NF4
// codes and int8 block scales: Note [Fully sharded quantized base]).
int64_t slots(const torch::Tensor& t) {
  if (t.is_floating_point()) return t.numel();
  return (t.numel() * static_cast<int64_t>(t.element_size()) + 3) / 4;
}

// `t`'s place in an fp32 unit buffer at `offset`: a floating-point tensor's elements, an integer
// one's bytes, with its dtype and shape (an all-gather copies bytes, whatever dtype it is told).
torch::Tensor slot_view(const torch::Tensor& buffer, int64_t offset, const torch::Tensor& t) {
  auto words = buffer.narrow(0, offset, slots(t));
  if (t.is_floating_point()) return words.view(t.sizes());
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  return words.view(torch::kUInt8).narrow(0, 0, bytes).view(t.scalar_type()).view(t.sizes());
}

// Each of `params`' offset in its unit's flat buffer (16-element aligned, in order) and the
// buffer's length: the one layout of a unit's trainable and of its frozen parameters, and what
// the streamed build lays out before place() (Note [Streamed build]).
int64_t aligned_offsets(const std::vector<torch::Tensor>& params, std::vector<int64_t>& offsets) {
  offsets.clear();
  int64_t n = 0;
  for (const auto& p : params) {
    offsets.push_back(n);
    n += align_up(slots(p));
  }
  return n;
}

// Note [Fully sharded]: a gathered buffer's storage goes to 0 bytes and comes back in place,
// so every view (the parameters, what autograd saved) follows it.
void release_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (impl->nbytes() == bytes) return;
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

// Note [Streamed build]: whether place() found the parameters the sink took as the block was
// built: the same TensorImpls in the same order.
bool same_tensors(const std::vector<torch::Tensor>& taken,
                  const std::vector<torch::Tensor>& placed) {
  if (taken.size() != placed.size()) return false;
  for (size_t k = 0; k < taken.size(); ++k) {
    if (taken[k].unsafeGetTensorImpl() != placed[k].unsafeGetTensorImpl()) return false;
  }
  return true;
}

// A block's frozen tensors in its unit's order (Note [Fully sharded frozen base], Note [Fully
// sharded quantized base]): its fp32 parameters that do not train, each once (`seen`: those an
// earlier block took), then its quantized base's codes and scales. The streamed build and place()
// both lay a block out through it, so they agree.
std::vector<torch::Tensor> frozen_of(torch::nn::Module& block, std::set<const void*>& seen,
                                     const std::function<bool(const torch::Tensor&)>& trains) {
  std::vector<torch::Tensor> frozen;
  for (const auto& p : block.parameters()) {
    if (trains(p) || p.scalar_type() != torch::kFloat32 ||
        !seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    frozen.push_back(p);
  }
  for (auto& t : models::quantized_storage(block)) frozen.push_back(std::move(t));
  return frozen;
}

BufferView view_of(const torch::Tensor& t, int64_t begin, int64_t count) {
  return buffer_view(t, begin, count, *dtype_of(t.scalar_type()));
}

int64_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace

// The model's BlockHooks: forwards to the sync while it lives (the model may outlive it).
class FullyShardedSync::Hooks final : public models::BlockHooks {
 public:
  explicit Hooks(FullyShardedSync* owner) : owner_(owner) {}
  void before_block(size_t index) override {
    if (owner_) owner_->before_block(index);
  }
  torch::Tensor after_block(size_t index, torch::Tensor output) override {
    return owner_ ? owner_->after_block(index, std::move(output)) : output;
  }
  void detach() { owner_ = nullptr; }

 private:
  FullyShardedSync* owner_;
};

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

torch::Tensor FullyShardedSync::broadcast_packed(const std::vector<torch::Tensor>& params,
                                                 const std::vector<int64_t>& offsets, int64_t chunk,
                                                 torch::TensorOptions options) {
  const int64_t padded = chunk * comm_.world_size();
  auto buffer = torch::zeros({padded}, options);
  for (size_t k = 0; k < params.size(); ++k) {
    slot_view(buffer, offsets[k], params[k]).copy_(params[k].detach());
  }
  if (padded > 0) comm_.broadcast(view_of(buffer, 0, padded), 0)->wait();
  return buffer;
}

models::BlockSink* FullyShardedSync::block_sink(torch::Device device) {
  build_device_ = device;
  return this;
}

void FullyShardedSync::block_built(size_t index, const std::string& /*path*/,
                                   torch::nn::Module& block) {
  // Note [Streamed build]: the unit's layout as place() makes it (the block's trainable fp32
  // parameters in its order, each 16-element aligned; one already taken by an earlier block
  // belongs to that one), rank 0's values broadcast, this rank's chunk kept.
  torch::NoGradGuard no_grad;
  DNALLM_CHECK(build_device_.has_value() && index == streamed_.size(), ExitCode::kFailure,
               "internal: block {} built with {} streamed before it", index, streamed_.size());
  const int world = comm_.world_size(), rank = comm_.rank();
  // Its frozen fp32 parameters (a LoRA base, Note [LoRA block by block]) the same way, as
  // place()'s frozen base lays them out.
  Streamed s;
  for (const auto& p : block.parameters()) {
    if (p.requires_grad() && p.scalar_type() == torch::kFloat32 &&
        streamed_seen_.insert(p.unsafeGetTensorImpl()).second) {
      s.params.push_back(p);
    }
  }
  s.frozen =
      frozen_of(block, streamed_seen_, [](const torch::Tensor& p) { return p.requires_grad(); });
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(*build_device_);
  auto my_chunk = [&](const std::vector<torch::Tensor>& params) {
    std::vector<int64_t> offsets;
    const int64_t chunk = (aligned_offsets(params, offsets) + world - 1) / world;
    return broadcast_packed(params, offsets, chunk, opts).narrow(0, rank * chunk, chunk).clone();
  };
  s.chunk = my_chunk(s.params);
  if (!s.frozen.empty()) s.frozen_chunk = my_chunk(s.frozen);
  // What the blocks built so far hold whole now, from their storage: this one only, once
  // the earlier ones were released.
  int64_t held = 0;
  for (const auto& earlier : streamed_) {
    for (const auto* list : {&earlier.params, &earlier.frozen}) {
      for (const auto& p : *list) held += int64_t(p.storage().nbytes());
    }
  }
  for (const auto* list : {&s.params, &s.frozen}) {
    for (const auto& p : *list) {
      held += int64_t(p.storage().nbytes());
      build_whole_bytes_ += bytes_of(p);
    }
  }
  build_held_peak_ = std::max(build_held_peak_, held);
  for (const auto* list : {&s.params, &s.frozen}) {
    for (const auto& p : *list) release_storage(p);
  }
  streamed_.push_back(std::move(s));
}

std::unique_ptr<optim::FlatParameters> FullyShardedSync::place(
    models::LanguageModel& model, const std::vector<std::pair<std::string, torch::Tensor>>& named,
    torch::Device device) {
  torch::NoGradGuard no_grad;
  const int world = comm_.world_size(), rank = comm_.rank();
  stream_ordered_ = device.is_cuda();
  // Units: a parameter belongs to the first block that has it, else to the root.
  const auto blocks = model->blocks();
  std::vector<std::set<const void*>> in_block(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (const auto& p : blocks[b]->parameters()) in_block[b].insert(p.unsafeGetTensorImpl());
  }
  std::vector<std::vector<size_t>> members(blocks.size() + 1);
  for (size_t i = 0; i < named.size(); ++i) {
    size_t u = blocks.size();
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (in_block[b].count(named[i].second.unsafeGetTensorImpl())) {
        u = b;
        break;
      }
    }
    members[u].push_back(i);
  }
  units_.resize(members.size());
  root_ = blocks.size();
  std::vector<int64_t> sizes;
  for (size_t u = 0; u < members.size(); ++u) {
    Unit& unit = units_[u];
    for (size_t i : members[u]) {
      unit.params.push_back(named[i].second);
      unit.shapes.push_back(named[i].second.sizes().vec());
    }
    sizes.push_back(aligned_offsets(unit.params, unit.offsets));
  }
  const auto plan = plan_unit_shards(sizes, world, rank);
  int64_t local = 0;
  for (const auto& s : plan) local += s.chunk;
  global_numel_ = plan.empty() ? 0 : plan.back().begin + plan.back().numel;

  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  // Note [Fully sharded mixed precision]: bf16 runs gather (and compute with) bf16 parameters,
  // except a family that reads fp32 parameters (ModelSpec::fp32_parameters: HyenaDNA).
  param_dtype_ = options_.precision == cfg::Precision::kBf16 ? torch::kBFloat16 : torch::kFloat32;
  if (param_dtype_ != torch::kFloat32 && model->spec().fp32_parameters) {
    param_dtype_ = torch::kFloat32;
    if (rank == 0) {
      spdlog::warn(
          "ZeRO-3 with training.precision = \"bf16\": the {} family's units are gathered in "
          "fp32 (it reads fp32 parameters); it computes under autocast as with DDP (Note [Fully "
          "sharded mixed precision])",
          model->spec().family);
    }
  }
  // Note [Streamed build]: every block streamed, or none (the model was built whole).
  DNALLM_CHECK(streamed_.empty() || streamed_.size() == blocks.size(), ExitCode::kFailure,
               "internal: {} of {} blocks streamed", streamed_.size(), blocks.size());
  shard_params_ = torch::zeros({local}, opts);
  shard_grads_ = torch::zeros({local}, opts);
  auto mask = torch::zeros({local}, opts);
  std::vector<optim::FlatParameters::Entry> entries;
  std::vector<optim::FlatParameters::Piece> pieces;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    unit.shard = plan[u];
    const int64_t padded = unit.shard.chunk * world;
    const bool streamed = u < streamed_.size();
    if (streamed) {  // the same parameters in the same order as the sink laid out
      DNALLM_CHECK(same_tensors(streamed_[u].params, unit.params) &&
                       streamed_[u].chunk.numel() == unit.shard.chunk,
                   ExitCode::kFailure,
                   "internal: block {} was streamed with {} parameters, placed with {}", u,
                   streamed_[u].params.size(), unit.params.size());
    }
    // Rank 0's values everywhere (as DDP's broadcast), then this rank's chunk into the shard;
    // a streamed block's chunk was taken so as it was built (Note [Streamed build]).
    auto init = streamed ? torch::empty({padded}, opts)
                         : broadcast_packed(unit.params, unit.offsets, unit.shard.chunk, opts);
    unit.full_grad = torch::zeros({padded}, opts);
    auto unit_mask = torch::zeros({padded}, opts);
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const int64_t off = unit.offsets[k], n = unit.params[k].numel();
      const std::string& name = named[members[u][k]].first;
      unit_mask.narrow(0, off, n).fill_(optim::decays(name) ? 1.0 : 0.0);
      entries.push_back({name, unit.shard.begin + off, n, unit.shapes[k]});
    }
    const int64_t lo = rank * unit.shard.chunk;
    auto mine = shard_params_.narrow(0, unit.shard.local_offset, unit.shard.chunk);
    if (streamed) {
      mine.copy_(streamed_[u].chunk);
      streamed_[u].chunk = torch::Tensor();
    } else {
      mine.copy_(init.narrow(0, lo, unit.shard.chunk));
    }
    if (param_dtype_ == torch::kFloat32) {
      unit.full = init;
    } else {
      unit.full = torch::zeros({padded}, opts.dtype(param_dtype_));
      unit.whole = torch::zeros({padded}, opts);
      release_storage(unit.whole);
    }
    mask.narrow(0, unit.shard.local_offset, unit.shard.chunk)
        .copy_(unit_mask.narrow(0, lo, unit.shard.chunk));
    if (unit.shard.owned.size() > 0) {
      pieces.push_back({unit.shard.owned.begin, unit.shard.owned.end, unit.shard.local_offset});
    }
    // The parameters become views of the gathered buffer, their gradients of its gradient one
    // (fp32 under bf16 gathers too: Note [Fully sharded mixed precision]).
    point_params(u, unit.full);
    for (size_t k = 0; k < unit.params.size(); ++k) {
      auto param = unit.params[k];
      const int64_t off = unit.offsets[k], n = param.numel();
      param.mutable_grad() = unit.full_grad.narrow(0, off, n).view(unit.shapes[k]);
    }
    unit.gathered = true;
    release(u);
    release_storage(unit.full_grad);
  }
  hook_gradients();
  place_frozen(model, named, opts);
  streamed_.clear();
  streamed_seen_.clear();
  for (const auto& unit : units_) {
    for (const auto& p : unit.params) sharded_.insert(p.unsafeGetTensorImpl());
    for (const auto& p : unit.frozen) sharded_.insert(p.unsafeGetTensorImpl());
  }
  live_bytes_ = peak_live_bytes_ = 0;
  predict_peak();
  hooks_ = std::make_shared<Hooks>(this);
  model->set_block_hooks(hooks_);
  spdlog::info(
      "ZeRO-3: {} units ({} blocks and the root), {} of {} elements on rank {}; frozen "
      "parameters: {} of {} bytes held; gathers in {}, reduce-scatters in {}",
      units_.size(), blocks.size(), local, global_numel_, rank, frozen_held_bytes_,
      frozen_total_bytes_, param_dtype_ == torch::kFloat32 ? "fp32" : "bf16",
      dtype_name(options_.reduce_dtype));
  if (build_whole_bytes_ > 0) {
    spdlog::info(
        "ZeRO-3: the model was built block by block (Note [Streamed build]): at most {} of its "
        "blocks' {} bytes whole at once on rank {}",
        build_held_peak_, build_whole_bytes_, rank);
  }
  return std::make_unique<optim::FlatParameters>(std::move(entries), global_numel_, shard_params_,
                                                 shard_grads_, mask, std::move(pieces));
}

void FullyShardedSync::place_frozen(models::LanguageModel& model,
                                    const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                    const torch::TensorOptions& opts) {
  const int world = comm_.world_size(), rank = comm_.rank();
  const auto blocks = model->blocks();
  std::set<const void*> trainable, placed;
  for (const auto& np : named) trainable.insert(np.second.unsafeGetTensorImpl());
  const auto trains = [&](const torch::Tensor& p) {
    return trainable.count(p.unsafeGetTensorImpl()) > 0;
  };
  for (size_t b = 0; b < blocks.size(); ++b) {
    Unit& unit = units_[b];
    unit.frozen = frozen_of(*blocks[b], placed, trains);
    for (const auto& t : unit.frozen) frozen_total_bytes_ += bytes_of(t);
    if (unit.frozen.empty()) continue;
    std::vector<int64_t> offsets;
    const int64_t chunk = (aligned_offsets(unit.frozen, offsets) + world - 1) / world;
    if (b < streamed_.size()) {  // taken as the block was built (Note [Streamed build])
      DNALLM_CHECK(same_tensors(streamed_[b].frozen, unit.frozen) &&
                       streamed_[b].frozen_chunk.numel() == chunk,
                   ExitCode::kFailure,
                   "internal: block {} was streamed with {} frozen parameters, placed with {}", b,
                   streamed_[b].frozen.size(), unit.frozen.size());
      unit.frozen_full = torch::empty({chunk * world}, opts);
      unit.frozen_shard = streamed_[b].frozen_chunk.to(opts.device());
      streamed_[b].frozen_chunk = torch::Tensor();
    } else {
      unit.frozen_full = broadcast_packed(unit.frozen, offsets, chunk, opts);
      unit.frozen_shard = unit.frozen_full.narrow(0, rank * chunk, chunk).clone();
    }
    for (size_t k = 0; k < unit.frozen.size(); ++k) {
      unit.frozen[k].set_data(slot_view(unit.frozen_full, offsets[k], unit.frozen[k]));
    }
    release_storage(unit.frozen_full);
    frozen_held_bytes_ += chunk * 4;
  }
  // The root's frozen parameters, and non-fp32 ones: whole.
  for (const auto& p : model->parameters()) {
    const void* impl = p.unsafeGetTensorImpl();
    if (trainable.count(impl) || placed.count(impl)) continue;
    frozen_total_bytes_ += bytes_of(p);
    frozen_held_bytes_ += bytes_of(p);
  }
}

void FullyShardedSync::predict_peak() {
  // What steps 1-3 of Note [Fully sharded] hold at once besides the root's parameters and
  // gradients: in forward blocks i and i + 1 (the prefetch); in backward block i's parameters
  // and gradients, block i - 1's parameters (the prefetch) and the gradients of blocks i + 1
  // and i + 2 (two reductions in flight). Measured (DNALLM_TRACE_ZERO3=1 logs every change):
  // 6 blocks of 34,176 bytes and a root of 14,272 peak at 199,424 bytes in backward, exactly.
  // pbytes: a block's gathered parameters (trainable ones in param_dtype_, frozen ones fp32);
  // gbytes: its gradients (fp32); rbytes: its gradient while its reduce-scatter flies (the fp32
  // gradient itself, or the 2-byte staging copy that replaced it: Note [Fully sharded mixed
  // precision]); wbytes: its parameters while every parameter is held (fp32).
  auto in_range = [&](int64_t i) { return i >= 0 && i < static_cast<int64_t>(root_); };
  auto gbytes = [&](int64_t i) { return in_range(i) ? bytes_of(units_[size_t(i)].full_grad) : 0; };
  auto frozen_bytes = [&](int64_t i) {
    return in_range(i) ? bytes_of(units_[size_t(i)].frozen_full) : 0;
  };
  auto pbytes = [&](int64_t i) {
    return in_range(i) ? bytes_of(units_[size_t(i)].full) + frozen_bytes(i) : 0;
  };
  const int64_t reduce_size = static_cast<int64_t>(dtype_size(options_.reduce_dtype));
  auto rbytes = [&](int64_t i) {
    return reduce_size == 4 ? gbytes(i) : gbytes(i) / 4 * reduce_size;
  };
  auto wbytes = [&](int64_t i) { return gbytes(i) + frozen_bytes(i); };
  // The root's parameters and gradients are held for the whole forward and backward.
  const int64_t root_params = bytes_of(units_[root_].full);
  const int64_t root_grads = bytes_of(units_[root_].full_grad);
  const int64_t root = root_params + root_grads;
  predicted_peak_bytes_ = root;
  for (int64_t i = 0; i < static_cast<int64_t>(root_); ++i) {
    const int64_t forward = pbytes(i) + (options_.prefetch ? pbytes(i + 1) : 0);
    const int64_t backward = pbytes(i) + gbytes(i) + (options_.prefetch ? pbytes(i - 1) : 0) +
                             rbytes(i + 1) + rbytes(i + 2);
    predicted_peak_bytes_ = std::max({predicted_peak_bytes_, root + forward, root + backward});
  }
  // Note [Sharded evaluation]: the root and blocks i and i + 1 (fp32 gathers), or the root and
  // block i, both fp32 (bf16 gathers: `whole`, no prefetch).
  const bool eval_whole = param_dtype_ != torch::kFloat32;
  for (int64_t i = 0; i < static_cast<int64_t>(root_); ++i) {
    const int64_t forward = eval_whole
                                ? root_grads + wbytes(i)
                                : root_params + pbytes(i) + (options_.prefetch ? pbytes(i + 1) : 0);
    predicted_peak_bytes_ = std::max(predicted_peak_bytes_, forward);
  }
  // A FullParameters (an evaluation on a rank with no batch: Note [Sharded evaluation]) holds
  // every parameter in fp32: counted once one is made (gather_full_parameters()).
  int64_t whole_grads = 0;
  predicted_whole_bytes_ =
      root_grads;  // the root's fp32 parameters: as many bytes as its gradients
  for (int64_t i = 0; i < static_cast<int64_t>(root_); ++i) predicted_whole_bytes_ += wbytes(i);
  for (const auto& unit : units_) whole_grads += bytes_of(unit.full_grad);
  // Exports hold one unit at a time, in fp32 (Note [Fully sharded exports]): a block's fp32
  // parameters and frozen base (wbytes(i)), or the root's fp32 parameters (root_grads bytes);
  // evaluation's figure above holds the root and a block at once, so it covers both.
  // Accumulating unsharded: every block's gradient, the root's parameters and, in backward,
  // a block's parameters with its prefetched predecessor's.
  if (options_.accumulate_unsharded) {
    int64_t pair = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(root_); ++i) {
      pair = std::max(pair, pbytes(i) + (options_.prefetch ? pbytes(i - 1) : 0));
    }
    predicted_peak_bytes_ = std::max(predicted_peak_bytes_, whole_grads + root_params + pair);
  }
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
