// FullyShardedSync's placement (Note [Fully sharded], Note [Streamed build]): the streamed
// build's sink, place() and its frozen half, and the predicted peak. See fully_sharded.hpp.
#include <algorithm>
#include <set>

#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "worker/parallel/fully_sharded.hpp"
#include "worker/parallel/fully_sharded_detail.hpp"

namespace dnallm::parallel {

using namespace detail;

namespace {

// Units: a parameter belongs to the first block that has it, else to the root (the last unit);
// each unit's indices into `named`, in order.
std::vector<std::vector<size_t>> unit_members(
    const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
    const std::vector<std::pair<std::string, torch::Tensor>>& named) {
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
  return members;
}

}  // namespace

torch::Tensor FullyShardedSync::broadcast_packed(const std::vector<torch::Tensor>& params,
                                                 const std::vector<int64_t>& offsets, int64_t chunk,
                                                 torch::TensorOptions options) {
  const int64_t padded = chunk * comm_.world_size();
  auto buffer = torch::zeros({padded}, options);
  for (size_t k = 0; k < params.size(); ++k) {
    slot_view(buffer, offsets[k], params[k]).copy_(params[k].detach());
  }
  if (padded > 0 && options_.broadcast_on_place) {
    comm_.broadcast(view_of(buffer, 0, padded), 0)->wait();
  }
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
  const auto blocks = model->blocks();
  const auto members = unit_members(blocks, named);
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
  choose_param_dtype(model->spec());
  // Note [Streamed build]: every block streamed, or none (the model was built whole).
  DNALLM_CHECK(streamed_.empty() || streamed_.size() == blocks.size(), ExitCode::kFailure,
               "internal: {} of {} blocks streamed", streamed_.size(), blocks.size());
  shard_params_ = torch::zeros({local}, opts);
  shard_grads_ = torch::zeros({local}, opts);
  auto mask = torch::zeros({local}, opts);
  std::vector<optim::FlatParameters::Entry> entries;
  std::vector<optim::FlatParameters::Piece> pieces;
  for (size_t u = 0; u < units_.size(); ++u) {
    units_[u].shard = plan[u];
    place_unit(u, members[u], named, opts, mask, entries, pieces);
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
  log_placement(blocks.size(), local);
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

void FullyShardedSync::choose_param_dtype(const models::ModelSpec& spec) {
  // Note [Fully sharded mixed precision]: bf16 runs gather (and compute with) bf16 parameters,
  // except a family that reads fp32 parameters (ModelSpec::fp32_parameters: HyenaDNA).
  param_dtype_ = options_.precision == cfg::Precision::kBf16 ? torch::kBFloat16 : torch::kFloat32;
  if (param_dtype_ == torch::kFloat32 || !spec.fp32_parameters) return;
  param_dtype_ = torch::kFloat32;
  if (comm_.rank() != 0) return;
  spdlog::warn(
      "ZeRO-3 with training.precision = \"bf16\": the {} family's units are gathered in "
      "fp32 (it reads fp32 parameters); it computes under autocast as with DDP (Note [Fully "
      "sharded mixed precision])",
      spec.family);
}

void FullyShardedSync::place_unit(size_t u, const std::vector<size_t>& members,
                                  const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                  const torch::TensorOptions& opts, torch::Tensor& mask,
                                  std::vector<optim::FlatParameters::Entry>& entries,
                                  std::vector<optim::FlatParameters::Piece>& pieces) {
  const int world = comm_.world_size(), rank = comm_.rank();
  Unit& unit = units_[u];
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
    const std::string& name = named[members[k]].first;
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

void FullyShardedSync::log_placement(size_t blocks, int64_t local) const {
  spdlog::info(
      "ZeRO-3: {} units ({} blocks and the root), {} of {} elements on rank {}; frozen "
      "parameters: {} of {} bytes held; gathers in {}, reduce-scatters in {}",
      units_.size(), blocks, local, global_numel_, comm_.rank(), frozen_held_bytes_,
      frozen_total_bytes_, param_dtype_ == torch::kFloat32 ? "fp32" : "bf16",
      dtype_name(options_.reduce_dtype));
  if (build_whole_bytes_ > 0) {
    spdlog::info(
        "ZeRO-3: the model was built block by block (Note [Streamed build]): at most {} of its "
        "blocks' {} bytes whole at once on rank {}",
        build_held_peak_, build_whole_bytes_, comm_.rank());
  }
}

}  // namespace dnallm::parallel
