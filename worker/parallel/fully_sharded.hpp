// Fully sharded data parallelism (parallel.zero_stage = 3): parameters, gradients and optimizer
// state are all split across ranks, so a rank holds 1/N of the model state plus the blocks it
// is computing.
//
// Note [Fully sharded]: the model's blocks() are the units (a unit per block, then the root:
// every other trainable parameter: embeddings, final norm, heads); the global flat layout and
// which elements a rank owns follow Note [Fully sharded layout] (plan.hpp). Each rank keeps
//  - its shard: one fp32 buffer of its chunk of every unit back to back (the trainer's
//    FlatParameters in sharded form: the optimizer and the checkpoint see only this), with its
//    gradient shard and decay mask;
//  - per unit, a gathered buffer (chunk x world elements) whose views ARE the model's
//    parameters, and a gathered gradient buffer whose views are their .grad. Their storage is
//    released (0 bytes) while the unit is not in use and allocated again in place when it is:
//    tensors autograd saved in forward keep pointing at it, and the all-gather writes raw
//    memory, so no version counter moves (as FSDP frees and re-allocates flat parameters).
// A step (the model calls Note [Block hooks] around block i):
//  1. forward, before block i: all-gather unit i (waiting for it if prefetched), then launch the
//     all-gather of unit i + 1 (prefetch: at most two units gathered at once, besides the root);
//     after block i: release unit i's parameters (unless every parameter is held: evaluation,
//     export) and hook the block's output so that its gradient arrives first:
//  2. backward, when the gradient of block i's output is ready (before block i's backward):
//     all-gather unit i again (activation checkpointing recomputes from it), prefetch unit
//     i - 1, allocate and zero its gradient buffer;
//  3. when every parameter of unit i has its gradient (AccumulateGrad post-hooks, as DDP's),
//     release its parameters and launch the reduce-scatter of its gradient buffer; at most two
//     are in flight: the oldest is waited for, added into the gradient shard and its buffer
//     released. The root (gathered before each micro-step's forward: before_forward) reduces
//     when its last gradient arrives.
//  4. after backward (every micro-step): units whose gradients came only in part (unused
//     parameters) are reduced, everything in flight is waited for, and every unit, the root
//     included, is released: between steps a rank holds its shard only. Gradient
//     accumulation adds each micro-step's reduced shard into the gradient shard; with
//     parallel.zero3_accumulate_unsharded the whole gradients stay allocated instead, autograd
//     adds the next micro-step's into them, and only the last micro-step reduce-scatters.
//  5. the trainer's norm is the sum of the shards' partial squares over ranks; the optimizer
//     updates the shard.
// Neither the exports (ours and the Hugging Face layouts: Note [Fully sharded exports]) nor
// evaluation gather the whole model, and the build never makes it whole (Note [Streamed build]
// in models/block_hooks.hpp: block_built() keeps each block's chunk as it is built):
//
// Note [Sharded evaluation]: evaluation's forwards (ShardedForwards, gradient_sync.hpp) run the
// block hooks as a training forward does: before_forward_only() gathers the root and prefetches
// block 0, before block i gathers it and prefetches block i + 1, after it releases it, and
// after_forward_only() releases the root: a rank holds its shard, the root and at most two
// blocks' parameters (under bf16 gathers: the root and one block, gathered in fp32 into `whole`
// without prefetch, so that evaluation computes with the master values as DDP's does, and the
// bf16 parameters are hooked again after it). Every forward is then collective, so evaluate()
// keeps the ranks in step (one scalar all-reduce a batch says whether any rank still has one; a
// rank that ran out repeats its first batch and drops the result). Before this, evaluation held
// the whole model on every rank (FullParameters), 4 bytes a parameter: for a model sharded
// because it does not fit one rank, evaluation was the run's peak. A rank with no evaluation
// batch at all has nothing to repeat: that evaluation falls back to FullParameters.
// Every collective is issued in the same order on every rank: forward runs blocks in order and
// the autograd engine runs the same graph in the same order everywhere.
//
// Equivalence: with 2 ranks the reduce-scatter adds the same two numbers as DDP's all-reduce,
// so an fp32 run without clipping is bitwise DDP's; with clipping, or more ranks, sums differ
// in order (tests state the tolerance). bf16 runs gather bf16: Note [Fully sharded mixed
// precision]. On CUDA the waits are stream-ordered: Note [Fully sharded stream order].
//
// Note [Fully sharded stream order]: on a CUDA device every wait of steps 1-4 is
// Work::wait_stream() (Note [Stream-ordered wait] in comm/communicator.hpp): before block i
// runs, the default stream waits for unit i's all-gathers (trainable and frozen) and the host
// goes straight on to launch unit i + 1's and queue block i's kernels; the add of a
// reduce-scatter's result into the gradient shard is queued after the reduction the same way.
// With nccl the collectives run on the communicator's own stream, each after what the default
// stream had queued when it was issued (Note [Producer stream]): unit i + 1's all-gather runs
// while block i computes, and the host no longer stalls at each block, so it runs ahead of
// the device. Buffers, with LibTorch's caching allocator (stream-ordered: a block freed on the
// default stream goes only to later allocations on it, whose kernels run after the waits):
//  - gather_in, the bf16 chunk the all-gather reads, is dropped right after the stream wait:
//    whatever reuses its block runs after the all-gather. No record_stream (the communicator's
//    stream is not a LibTorch stream) and no host wait: the order is by events, as FSDP2's.
//  - `full` (and frozen_full) released after block i while queued kernels still read it: the
//    block goes to later default-stream work only, and an all-gather that writes into it
//    again waits for everything queued before it was issued (those kernels included).
//  - a reduction's input (full_grad or its 2-byte staging copy) and output stay in in_flight_
//    until complete_oldest(), which stream-waits, queues the add, then frees them. "At most
//    two in flight" now bounds the allocator's blocks; the host no longer waits for the
//    oldest, and the communicator runs the reductions in issue order.
//  - a prefetch nobody used is stream-waited for before its buffer is freed.
// The host still waits where it needs values or host memory: sum_scalar (loss, gradient
// norm), place()'s broadcasts, the fp32 gathers of evaluation and exports (gather_whole), and
// every wait of a host backend (gloo, mpi; staged for a CUDA model through host memory:
// StagedWork::wait_stream() is wait()). On CPU, wait() as before. comm_exposed_s (what
// wait_gradients() returns: host seconds waiting for reductions after backward) reads about
// 0 on CUDA with nccl: the device's waiting shows in the step time instead.
//
// Note [Fully sharded mixed precision]: with training.precision = "bf16" (FSDP's param_dtype)
//  - launch_gather casts this rank's fp32 chunk of the unit to bf16 (gather_in, kept until the
//    all-gather completes) and all-gathers bf16 into `full`, now bf16: half the bytes on the
//    wire and gathered. The parameters are bf16 views of it, so the model computes with bf16
//    weights under autocast; code that computes in fp32 casts them up (the transformer's
//    LayerNorm: CPU layer_norm takes no fp32 input with bf16 weights). HyenaDNA's fused mixer
//    and fp32 regions read fp32 parameters: its units stay fp32 (a warning says so).
//  - the gradient buffer `full_grad` stays fp32: AccumulateGrad adds a bf16 parameter's bf16
//    gradient into an fp32 .grad in place, so a parameter's several contributions (tied
//    embeddings, the micro-steps kept by zero3_accumulate_unsharded) add in fp32, and the
//    default fp32 reduce-scatter reads the buffer with no copy. It costs 2 bytes a parameter
//    more than bf16 gradients, for the at most three blocks whose gradients are live.
//  - parallel.grad_reduce_dtype: fp32 reduces `full_grad`; bf16 (fp16) casts it to a staging
//    copy, releases the fp32 buffer at once (2 bytes a parameter fly instead of 4), reduces and
//    adds the result into the fp32 gradient shard. The same holds under fp32 gathers.
//  - the shard (master weights), the optimizer and the checkpoint are fp32 and unchanged.
//    Evaluation and exports (FullParameters) gather fp32 into `whole` and point the
//    parameters at it (exports write the master values); set_data to another dtype drops a
//    parameter's gradient accumulator, so going back to bf16 hooks the new ones (hook_gradients).
//  - a block's frozen base (LoRA) stays fp32: the root's frozen embeddings, whole and fp32, feed
//    the blocks fp32 activations, which CPU layer_norm cannot take with bf16 weights.
// The memory account counts each buffer at its element size: a unit's parameters 2 bytes an
// element, gradients 4, a reduction in flight 4 or 2, the whole model 4 (steps 1-4 above).
//
// Note [Fully sharded exports]: the final and the best model's exports (Note [Exports unit by
// unit], models/registry.hpp) visit the units in order (blocks, then the root) on every rank:
// all-gather unit u (fp32 into `whole` under bf16 gathers: exports write the master values;
// its frozen base with it), let rank 0 write the tensors it completes, release it. So a rank
// holds its shard plus one unit, in fp32 (trace: W+/W- or P+/P- per unit), never the whole
// model; the root's frozen parameters and buffers are held anyway. Inside a FullParameters
// every unit is held already: one visit, nothing gathered. The Hugging Face layouts (final/hf,
// best/hf: each family's hf_export, fused and renamed tensors, LoRA merged, PEFT's adapter and
// base) are written the same way, in a second visit.
//
// Note [Fully sharded frozen base]: a block's frozen parameters (the base of a LoRA model,
// 4 bytes a parameter that DDP and ZeRO-1/2 replicate) are sharded with their block: each
// rank keeps its chunk (frozen_shard, an even split of the block's frozen parameters, each
// 16-element aligned), and the block's all-gather also gathers them into frozen_full, whose
// views are the parameters, released with the block's. Rank 0's values are broadcast first,
// as for the trainable ones. They have no gradient, no optimizer state and no place in the
// checkpoint (a LoRA run reads its base again from model.init_from). In backward they are
// released later than the trainable ones: a unit's trainable gradients can all be in before
// autograd has run the nodes that read its frozen weights (a LoRA linear's base product, for
// the gradient of its input), so they go when the gradient of the block's input is ready
// (before_unit_backward of the block before), or after backward for the first. The root's frozen
// parameters (embeddings under LoRA) stay whole, as the root is gathered for every step. A
// streamed build (Note [Streamed build]) hands each block's frozen chunk over as the block is
// built (Note [LoRA block by block]), so the base is never whole on a rank either.
//
// Note [Fully sharded quantized base]: under QLoRA a block's base linears are NF4 codes and
// scales (Note [NF4 layout]: 0.52 bytes a weight), not parameters: models::quantized_storage()
// lists them. They join the block's frozen buffer after its fp32 frozen parameters, each in
// 4-byte words (its bytes as they are: an all-gather copies bytes), and are sharded, gathered
// and released with it: set_data points each at its place in frozen_full, so the linears (and
// what the NF4 backward saved: Note [NF4 backward]) read the gathered bytes; its code book (16
// values) follows the codes to the device. A rank holds 1/N of the 4-bit base between uses,
// where DDP holds all of it (as FSDP-QLoRA shards bitsandbytes' Params4bit). The codes are those
// every rank would compute, rank 0's broadcast: DDP and ZeRO-3 train the same model bit for bit.
#pragma once

#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "worker/parallel/grad_hook.hpp"
#include "worker/parallel/gradient_sync.hpp"
#include "worker/parallel/plan.hpp"

namespace dnallm::parallel {

struct FullyShardedOptions {
  // training.precision; bf16 gathers the units in bf16 (Note [Fully sharded mixed precision]).
  cfg::Precision precision = cfg::Precision::kFp32;
  // parallel.grad_reduce_dtype: the dtype of the reduce-scatter (fp32, bf16 or fp16).
  DType reduce_dtype = DType::kFloat32;
  bool prefetch = true;  // all-gather the next unit while the current one computes
  // parallel.zero3_accumulate_unsharded: whole gradients kept between micro-steps, one
  // reduce-scatter at the last.
  bool accumulate_unsharded = false;
  // Whether place() gives every rank rank 0's initial values (a broadcast a unit); false for a
  // spare that joins a running group (Note [In-process recovery]): its shard comes from a peer.
  bool broadcast_on_place = true;
};

class FullyShardedSync final : public GradientSync, public models::BlockSink {
 public:
  FullyShardedSync(comm::Communicator& comm, FullyShardedOptions options);
  ~FullyShardedSync() override;

  int rank() const override { return comm_.rank(); }
  int world_size() const override { return comm_.world_size(); }
  double sum_scalar(double value) override;
  std::unique_ptr<optim::FlatParameters> place(
      models::LanguageModel& model, const std::vector<std::pair<std::string, torch::Tensor>>& named,
      torch::Device device) override;
  void before_forward(int64_t micro_step) override;
  void before_backward(int64_t micro_step, bool last) override;
  void after_backward(int64_t micro_step, bool last) override;
  double wait_gradients() override;
  double grad_sq_norm(const torch::Tensor& shard_grads) override;
  std::pair<int64_t, int64_t> shard_range(int64_t numel) const override { return {0, numel}; }
  void after_optimizer_step(optim::FlatParameters& params) override;
  // Drops what the broken step launched (works of a destroyed communicator, unwaited) and
  // releases every unit; the shard's state comes from the buddy copies (Note [Buddy copies]).
  bool abandon_step() override;
  std::optional<Memory> memory() const override;
  void gather_full_parameters() override;
  void release_full_parameters() override;
  // Note [Fully sharded exports]
  void visit_parameter_units(
      const std::function<void(const std::function<bool(const torch::Tensor&)>& held)>& visit)
      override;
  bool places_from_host() const override { return true; }
  // Note [Streamed build]: this rank's chunk of each block's trainable parameters, taken as the
  // block is built (a broadcast of rank 0's values; collective), its storage released.
  models::BlockSink* block_sink(torch::Device device) override;
  void block_built(size_t index, const std::string& path, torch::nn::Module& block) override;
  bool forwards_are_collective() const override { return true; }
  void begin_forwards() override;
  void before_forward_only() override;
  void after_forward_only() override;
  void end_forwards() override;

 private:
  struct Unit {
    std::vector<torch::Tensor> params;  // the model's parameters (views of `full` when gathered)
    std::vector<int64_t> offsets;       // each one's offset inside the unit
    std::vector<std::vector<int64_t>> shapes;
    // Note [Fully sharded frozen base]: the block's frozen parameters (LoRA's base), then its
    // quantized base's tensors (Note [Fully sharded quantized base]), gathered and released
    // with it; no gradient, no optimizer, not in the checkpoint.
    std::vector<torch::Tensor> frozen;
    torch::Tensor frozen_full;   // [frozen_chunk * world]; storage released when not gathered
    torch::Tensor frozen_shard;  // [frozen_chunk]: this rank's chunk, always held
    comm::WorkPtr frozen_gathering;
    bool frozen_gathered = false;  // frozen_full holds the frozen parameters
    UnitShard shard;
    torch::Tensor full;       // [chunk * world] of param_dtype_; storage released when not gathered
    torch::Tensor gather_in;  // bf16 gathers: this rank's chunk cast, alive while gathering
    // bf16 gathers: the fp32 parameters while every parameter is held (FullParameters: the
    // exports write fp32); storage released otherwise. Note [Fully sharded mixed precision].
    torch::Tensor whole;
    torch::Tensor full_grad;  // [chunk * world]; storage released outside its backward
    comm::WorkPtr gathering;  // a launched all-gather not yet waited for
    bool gathered = false;    // full holds the current parameters
    bool grad_live = false;   // full_grad is allocated for this backward
    int64_t pending = 0;      // parameters whose gradient has not arrived in this backward
    bool reduced = false;     // this micro-step's reduce-scatter launched
  };
  struct InFlight {
    size_t unit = 0;
    comm::WorkPtr work;
    torch::Tensor out;      // [chunk] of the reduce dtype
    torch::Tensor staging;  // [chunk * world]: the gradient cast to a 2-byte reduce dtype
  };
  class Hooks;  // the model's BlockHooks (fully_sharded.cpp)
  // Note [Streamed build]: a block as block_built() took it, until place().
  struct Streamed {
    std::vector<torch::Tensor> params;  // its trainable fp32 parameters, storage released
    torch::Tensor chunk;  // [chunk] on build_device_: this rank's, as place() lays out
    // Its frozen fp32 parameters (a LoRA base: Note [Fully sharded frozen base]) and quantized
    // base (Note [Fully sharded quantized base]), likewise.
    std::vector<torch::Tensor> frozen;
    torch::Tensor frozen_chunk;
  };

  // place()'s frozen half: each block's frozen parameters and quantized base sharded with it
  // (Note [Fully sharded frozen base], Note [Fully sharded quantized base]), and the frozen
  // bytes this rank holds and the model has.
  void place_frozen(models::LanguageModel& model,
                    const std::vector<std::pair<std::string, torch::Tensor>>& named,
                    const torch::TensorOptions& opts);
  // param_dtype_: the dtype units are gathered in (Note [Fully sharded mixed precision]).
  void choose_param_dtype(const models::ModelSpec& spec);
  // place()'s step for unit `u` (its shard already planned): its buffers, this rank's chunk of
  // its parameters into the shard, their optimizer entries, decay mask and owned pieces; the
  // parameters become views of the (released) gathered buffer. `members`: its indices into
  // `named`.
  void place_unit(size_t u, const std::vector<size_t>& members,
                  const std::vector<std::pair<std::string, torch::Tensor>>& named,
                  const torch::TensorOptions& opts, torch::Tensor& mask,
                  std::vector<optim::FlatParameters::Entry>& entries,
                  std::vector<optim::FlatParameters::Piece>& pieces);
  void log_placement(size_t blocks, int64_t local) const;
  // predicted_peak_bytes_ and predicted_whole_bytes_, from the placed units' buffers.
  void predict_peak();
  // `params` at `offsets` in a zeroed buffer of chunk x world elements, then rank 0's values
  // everywhere (as DDP's broadcast): a unit's placement (its frozen base too) and the streamed
  // build's (Note [Streamed build]).
  torch::Tensor broadcast_packed(const std::vector<torch::Tensor>& params,
                                 const std::vector<int64_t>& offsets, int64_t chunk,
                                 torch::TensorOptions options);
  void launch_gather(size_t u);
  void launch_frozen_gather(size_t u);
  // bf16 gathers, every parameter held or evaluating: the unit's fp32 parameters gathered
  // into `whole`.
  void gather_whole(size_t u);
  // Whether unit u is gathered in fp32 into `whole` now (bf16 gathers, outside training steps).
  bool gathers_whole(size_t u) const;
  void release_whole(size_t u);
  // The unit's parameters become views of `buffer` (its dtype theirs).
  void point_params(size_t u, const torch::Tensor& buffer);
  void hook_gradients();  // Note [Fully sharded], step 3: the AccumulateGrad post-hooks
  // Gathered on return; `master`: under bf16 gathers the fp32 values into `whole` (as while
  // every parameter is held).
  void gather(size_t u, bool master = false);
  // Parameters' storage released (unless every parameter is held). keep_frozen: in backward,
  // the frozen ones stay until the block's backward is over (Note [Fully sharded frozen base]).
  void release(size_t u, bool keep_frozen = false);
  void release_frozen(size_t u);
  // Every unit released, and the gradient hooks made again if a release_whole() dropped them.
  void release_all();
  void allocate_grad(size_t u);
  void release_grad(size_t u);
  void add_live(int64_t bytes, const char* what, size_t u);
  void before_block(size_t u);
  torch::Tensor after_block(size_t u, torch::Tensor output);
  void before_unit_backward(size_t u);
  void on_grad_ready(size_t u);
  void launch_reduce(size_t u);
  void complete_oldest();
  void complete_all();
  // Note [Fully sharded stream order]: wait_stream() on a CUDA device, else wait().
  void wait_for_device(const comm::WorkPtr& work);

  comm::Communicator& comm_;
  FullyShardedOptions options_;
  std::vector<Unit> units_;  // blocks in order, then the root
  size_t root_ = 0;
  torch::ScalarType param_dtype_ = torch::kFloat32;  // of the gathered units (compute)
  torch::Tensor shard_params_, shard_grads_;
  std::deque<InFlight> in_flight_;
  std::shared_ptr<Hooks> hooks_;
  std::shared_ptr<bool> alive_;  // gradient hooks outlive us inside autograd; they check this
  std::vector<GradAccumulator> accumulators_;
  std::set<const void*> sharded_;  // every unit's parameters, frozen ones too (TensorImpl)
  bool full_ = false;              // gather_full_parameters() in effect
  bool forwards_ = false;          // begin_forwards() in effect (Note [Sharded evaluation])
  bool rehook_ = false;            // a release_whole() dropped the gradient hooks
  bool armed_ = false;             // inside a micro-step's backward
  bool reduce_now_ = true;         // this micro-step reduce-scatters (not before the last one when
                                   // accumulating unsharded)
  int64_t live_bytes_ = 0, peak_live_bytes_ = 0;  // gathered non-root parameters + gradients
  int64_t predicted_peak_bytes_ = 0;              // the same, predicted from the unit sizes
  int64_t predicted_whole_bytes_ = 0;  // every unit's parameters in fp32 (FullParameters)
  bool trace_ = false;                 // DNALLM_TRACE_ZERO3: log every change
  bool stream_ordered_ = false;        // CUDA: Note [Fully sharded stream order]
  int64_t global_numel_ = 0;
  // Note [Streamed build]
  std::optional<torch::Device> build_device_;
  std::vector<Streamed> streamed_;
  std::set<const void*> streamed_seen_;  // parameters taken by an earlier block (TensorImpl)
  int64_t build_held_peak_ = 0;          // most bytes of whole block parameters held while built
  int64_t build_whole_bytes_ = 0;        // every block's parameters (frozen too), whole
  int64_t frozen_held_bytes_ = 0;   // frozen shards of the blocks + the root's frozen parameters
  int64_t frozen_total_bytes_ = 0;  // every frozen parameter of the model, and a QLoRA base
  double exposed_s_ = 0;            // this step's waiting for reductions after backward
};

}  // namespace dnallm::parallel
