// Data parallelism over one flat gradient buffer: bucketed all-reduce overlapped with
// backward, gradient accumulation without wasted communication, and ZeRO-1/2 sharding of the
// optimizer step.
//
// How a step runs on every rank (the trainer drives it; all calls in the same order on every
// rank, since they issue collectives):
//  1. begin_micro_step(last): before each micro-step's backward. With accumulate_sync =
//     "last", only the last micro-step arms the gradient hooks (DDP's no_sync for the others);
//     with "every", every micro-step does, each into its own staging buffer.
//  2. backward(): each parameter's AccumulateGrad post-hook marks it ready; when the last
//     parameter of a bucket is ready the bucket's collective is launched, in bucket order
//     (see Note [Bucket launch order]), while backward goes on with earlier layers.
//  3. finish_step(): waits for every bucket (the time spent waiting is the exposed
//     communication), folds "every"'s staging buffers into the flat gradient, and for
//     ZeRO-2 reduce-scatters the flat gradient into this rank's shard.
//  4. The trainer clips with global_grad_norm() and steps the optimizer on owned_range()
//     (the whole buffer for stage 0); then gather_parameters() all-gathers updated
//     parameters (ZeRO-1/2).
//
// Reductions SUM: the trainer scales each rank's loss by 1 / (scored tokens in the whole
// global batch), so a sum of per-rank gradients is the gradient of the global mean loss
// ("averaging folded into the reduction"). That is what makes N ranks equal 1 rank.
//
// Note [Bucket launch order]
// Readiness order is the same on every rank for the same model and inputs, but a bucket may
// become ready before an earlier one (a parameter used twice, unused parameters). Collectives
// must be issued in the same order everywhere, so bucket i is launched only after buckets
// 0..i-1; a ready bucket whose predecessors are pending waits for them (as c10d's reducer).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/variable.h>

#include "comm/communicator.hpp"
#include "worker/optim/flat_adamw.hpp"
#include "worker/parallel/grad_hook.hpp"
#include "worker/parallel/gradient_sync.hpp"
#include "worker/parallel/plan.hpp"

namespace dnallm::parallel {

struct DdpOptions {
  int64_t bucket_cap_bytes = 25 << 20;
  int64_t first_bucket_bytes = 1 << 20;
  bool sync_every_micro_step = false;    // accumulate_sync = "every"
  DType reduce_dtype = DType::kFloat32;  // grad_reduce_dtype: bf16/fp16 halve the bytes sent
  int zero_stage = 0;                    // 0, 1, 2
  bool find_unused_parameters = false;
  // attach() makes every rank start from rank 0's parameters (a broadcast). Off for a spare
  // joining a re-formed group: its state comes from a peer (Note [In-process recovery]).
  bool broadcast_on_attach = true;
};

DdpOptions ddp_options_from_config(const ParallelConfig& parallel);

// Orders parameters for FlatParameters so that buckets are contiguous: reverse registration
// order (see Note [Flat layout follows bucket order] in plan.hpp).
std::vector<std::pair<std::string, torch::Tensor>> bucket_order(
    const std::vector<std::pair<std::string, torch::Tensor>>& registration_order);

class DataParallel {
 public:
  // `flat` was built from bucket_order(named_parameters); `named_parameters` are the same
  // trainable parameters in registration order. Registers gradient hooks. Not thread-safe:
  // one training thread drives it.
  DataParallel(optim::FlatParameters& flat,
               const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
               comm::Communicator& comm, DdpOptions options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Makes every rank start from rank 0's parameters. Collective.
  void broadcast_parameters();
  // Sum of `value` over ranks. Collective, blocking.
  int64_t allreduce_sum(int64_t value);
  double allreduce_sum(double value);

  void begin_micro_step(bool last_micro_step);  // step 1
  // Step 3. Returns the seconds spent waiting for communication that backward did not hide.
  double finish_step();
  // sqrt of the sum of squared reduced gradients over the whole model (collective for
  // ZeRO-2, where each rank holds only its shard).
  double global_grad_norm();
  // Step 4: [begin, end) of the flat buffer this rank's optimizer updates.
  FlatRange owned_range() const { return owned_; }
  void gather_parameters();
  // GradientSync::abandon_step: back to "no step open", nothing launched, zero gradients.
  void abandon_step();

  const FlatLayout& layout() const { return layout_; }
  // Bytes this rank allocates for model state (parameters, gradients incl. staging, optimizer
  // state for its range: Adam moments), next to the ZeRO paper's accounting for comparison.
  MemoryAccount allocated_memory(cfg::Precision precision) const;
  MemoryAccount paper_memory(cfg::Precision precision) const;
  int64_t buckets_launched_during_backward() const { return launched_in_backward_; }

 private:
  struct Bucket {
    FlatRange range;
    std::vector<int64_t> entries;  // indices into flat.entries()
    int64_t pending = 0;
    bool launched = false;
  };
  // One launched collective: `target` (fp32 slice) receives `staging` back when the reduce
  // dtype is not fp32.
  struct Launched {
    comm::WorkPtr work;
    torch::Tensor target;
    torch::Tensor staging;
  };
  void on_ready(int64_t entry);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  static void complete(std::vector<Launched>& launched);
  void point_grads_at(const torch::Tensor& buffer);
  BufferView view(const torch::Tensor& t, int64_t begin, int64_t end) const;

  optim::FlatParameters& flat_;
  comm::Communicator& comm_;
  DdpOptions options_;
  FlatLayout layout_;
  FlatRange owned_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_entry_;
  std::vector<torch::Tensor> params_;          // by flat entry index
  std::vector<GradAccumulator> accumulators_;  // keep hooks alive
  std::shared_ptr<bool> alive_;                // hooks outlive us inside autograd; they check this
  std::vector<bool> ready_;
  bool armed_ = false;
  size_t next_bucket_ = 0;
  int64_t launched_in_backward_ = 0;
  std::vector<Launched>* launch_into_ = nullptr;  // where launch() records its work
  torch::Tensor launch_buffer_;                   // the gradient buffer hooks reduce
  std::vector<Launched> flat_launched_;           // "last": launches on flat_.grads()
  // accumulate_sync = "every": micro-steps alternate between two staging gradient buffers;
  // a buffer's reductions are waited for, and added into flat_.grads(), only when it is
  // reused two micro-steps later or at finish_step(): so a micro-step's communication
  // overlaps the next micro-step's compute.
  struct Stage {
    torch::Tensor grads;
    std::vector<Launched> launched;
    bool in_flight = false;
  };
  void end_micro_step();     // launches buckets left unlaunched (unused parameters)
  void drain(Stage& stage);  // waits a stage's reductions and adds it into flat_.grads()
  Stage stages_[2];
  int micro_ = 0;  // micro-steps begun in this step
  bool step_open_ = false;
  double exposed_s_ = 0;  // waiting done inside begin_micro_step ("every")
};

// The trainer's GradientSync over DataParallel (Note [GradientSync] in gradient_sync.hpp).
class DdpGradientSync final : public GradientSync {
 public:
  DdpGradientSync(comm::Communicator& comm, DdpOptions options, cfg::Precision precision);
  int rank() const override { return comm_.rank(); }
  int world_size() const override { return comm_.world_size(); }
  double sum_scalar(double value) override;
  std::vector<std::pair<std::string, torch::Tensor>> order_parameters(
      const std::vector<std::pair<std::string, torch::Tensor>>& registration_order) override {
    return bucket_order(registration_order);
  }
  void attach(optim::FlatParameters& flat,
              const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters) override;
  void before_backward(int64_t micro_step, bool last) override;
  double wait_gradients() override;
  double grad_sq_norm(const torch::Tensor& flat_grads) override;
  std::pair<int64_t, int64_t> shard_range(int64_t numel) const override;
  void after_optimizer_step(optim::FlatParameters& params) override;
  // Every rank holds the whole parameters and, without ZeRO, the whole optimizer state; with
  // ZeRO-1/2 a dead rank's range comes from its buddy's copy (Note [Buddy copies]).
  bool abandon_step() override;
  std::optional<Memory> memory() const override {
    return Memory{ddp_->allocated_memory(precision_), ddp_->paper_memory(precision_), 0, 0};
  }

 private:
  comm::Communicator& comm_;
  DdpOptions options_;
  cfg::Precision precision_;
  std::unique_ptr<DataParallel> ddp_;
};

}  // namespace dnallm::parallel
