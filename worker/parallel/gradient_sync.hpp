// The data-parallel interface of the trainer: what crosses ranks during a step. DDP and
// ZeRO-1/2 (ddp.hpp) and ZeRO-3 (fully_sharded.hpp) implement it; one process needs none.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "worker/models/language_model.hpp"
#include "worker/optim/flat_adamw.hpp"
#include "worker/parallel/plan.hpp"

namespace dnallm::parallel {

// Note [GradientSync]: everything that crosses ranks during a step, so DDP and ZeRO plug in
// without touching the loop. Every method is a collective where noted: it must be called in
// the same order on every rank. The trainer calls, per step:
//   0. once, at construction: place(model, named, device) builds the flat buffers: by default
//      order_parameters() chooses the layout (DDP: bucket order), then attach(flat, named)
//      (DDP: register hooks, broadcast rank 0's weights); ZeRO-3 returns this rank's shard
//      and installs the model's block hooks (Note [Fully sharded], fully_sharded.hpp)
//   1. sum_scalar(local label count)                    collective
//   2. per micro-step: before_forward(j), forward, before_backward(j, last), backward,
//      after_backward(j, last)
//      (DDP: buckets launch from gradient hooks during the last micro-step's backward)
//   3. wait_gradients() -> seconds of exposed communication      collective completion
//   4. sum_scalar(local loss sum) (for the logged loss)           collective
//   5. grad_sq_norm(flat grads of the shard)                      collective for ZeRO
//   6. optimizer on shard_range(numel), then after_optimizer_step()  (ZeRO: all-gather)
// Outside steps, evaluation holds a ShardedForwards and brackets each forward with
// before_forward_only() / after_forward_only() (Note [Sharded evaluation]); exports visit the
// parameters unit by unit (visit_parameter_units, Note [Exports unit by unit] in
// models/family_io.hpp), our files and the Hugging Face layouts alike. Memory figures come from
// memory(), not from a cast.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Sum of `value` over all ranks. Collective.
  virtual double sum_scalar(double value) = 0;
  // The order of the trainable parameters in the flat buffer (default: registration order).
  virtual std::vector<std::pair<std::string, torch::Tensor>> order_parameters(
      const std::vector<std::pair<std::string, torch::Tensor>>& registration_order) {
    return registration_order;
  }
  // Step 0: the flat buffers of `named` (the model's trainable parameters, registration order)
  // on `device`. Default: laid out by order_parameters(), parameters made views of them, then
  // attach().
  virtual std::unique_ptr<optim::FlatParameters> place(
      models::LanguageModel& model, const std::vector<std::pair<std::string, torch::Tensor>>& named,
      torch::Device device) {
    (void)model;
    auto flat = std::make_unique<optim::FlatParameters>(order_parameters(named), device);
    attach(*flat, named);
    return flat;
  }
  // Whether place() takes the model where it was built (the host) and puts each parameter on
  // `device` itself (Note [Sharded placement], trainer.cpp): ZeRO-3, so that the device never
  // holds the whole model. Otherwise the model is on `device` before place().
  virtual bool places_from_host() const { return false; }
  // Note [Streamed build] (models/block_hooks.hpp): where a fresh model's blocks go as they are
  // built, for place() on `device` to take; null (the default): the model is built whole.
  virtual models::BlockSink* block_sink(torch::Device device) { return nullptr; }
  // The flat buffers exist and parameters are views into them. `named` in registration order.
  virtual void attach(optim::FlatParameters& flat,
                      const std::vector<std::pair<std::string, torch::Tensor>>& named) {}
  // Before micro-step `micro_step`'s forward (ZeRO-3: gathers the root unit).
  virtual void before_forward(int64_t micro_step) {}
  // Before micro-step `micro_step`'s backward; `last` on the step's final micro-step.
  virtual void before_backward(int64_t micro_step, bool last) {}
  // After micro-step `micro_step`'s backward; `last` on the step's final micro-step.
  virtual void after_backward(int64_t micro_step, bool last) {}
  // Waits until the flat gradient holds the global sum (over ranks). Returns exposed seconds.
  virtual double wait_gradients() { return 0.0; }
  // Squared global norm of the gradient (ZeRO: local shard partials summed over ranks).
  virtual double grad_sq_norm(const torch::Tensor& flat_grads) {
    return optim::grad_sq_sum(flat_grads);
  }
  // The same as a 0-dim fp32 tensor on the gradients' device, for the sync-free step (Note
  // [Sync-free step]). The default reads grad_sq_norm() back (one host synchronisation);
  // a sync that can reduce on the device overrides it.
  virtual torch::Tensor grad_sq_norm_tensor(const torch::Tensor& flat_grads) {
    return torch::scalar_tensor(grad_sq_norm(flat_grads),
                                flat_grads.options().dtype(torch::kFloat32));
  }
  // The [begin, end) range of the flat buffer this rank's optimizer updates.
  virtual std::pair<int64_t, int64_t> shard_range(int64_t numel) const { return {0, numel}; }
  // After the optimizer updated this rank's range (ZeRO: all-gather the parameters).
  virtual void after_optimizer_step(optim::FlatParameters& params) {}

  // Model-state bytes this rank allocates, and the ZeRO paper's figure for the same layout;
  // nullopt where the sync does not account them (one process).
  struct Memory {
    MemoryAccount allocated, paper;
    // ZeRO-3: the most bytes of gathered blocks (parameters and gradients) held at once so far,
    // measured from their storage, and the same predicted from the blocks' sizes.
    int64_t gathered_peak = 0, gathered_predicted = 0;
    // Frozen parameters (LoRA's base): the bytes this rank holds between steps, and the
    // model's whole (Note [Fully sharded frozen base]); 0 where the sync does not shard them.
    int64_t frozen_held = 0, frozen_total = 0;
    // Note [Streamed build]: the most bytes of whole blocks' trainable parameters this rank held
    // at once while the model was built (measured from their storage), and all of them; 0
    // where the model was built whole.
    int64_t build_held_peak = 0, build_whole = 0;
  };
  virtual std::optional<Memory> memory() const { return std::nullopt; }
  // Every parameter whole on this rank until release_full_parameters(); collective (ZeRO-3
  // all-gathers every unit). No-op where every rank holds every parameter anyway.
  virtual void gather_full_parameters() {}
  virtual void release_full_parameters() {}
  // Calls `visit(held)` once per group of parameters this rank holds whole at once, the same
  // calls in the same order on every rank (collective: ZeRO-3 all-gathers a unit, fp32 master
  // values under bf16 gathers, before its call and releases it after); `held(t)` tells whether
  // tensor `t` holds its current value during that call: a parameter of the group, or one the
  // sync never releases (buffers too). Default: one call, every tensor held.
  virtual void visit_parameter_units(
      const std::function<void(const std::function<bool(const torch::Tensor&)>& held)>& visit) {
    visit([](const torch::Tensor&) { return true; });
  }

  // Note [Sharded evaluation]: forwards without backward (evaluation), between steps. Under
  // ZeRO-3 each forward gathers the model unit by unit as a training forward does (at most the
  // root and two units held, never the whole model), so a forward is collective: every rank
  // must run as many as the others (forwards_are_collective(); evaluate() pads a rank that ran
  // out of batches with a repeat whose result it drops). Elsewhere these are no-ops.
  virtual bool forwards_are_collective() const { return false; }
  virtual void begin_forwards() {}
  virtual void before_forward_only() {}
  virtual void after_forward_only() {}
  virtual void end_forwards() {}

  // Note [In-process recovery] (worker/train/in_process_recovery.hpp): a step broke off (a peer
  // died in one of its collectives) and its communicator was replaced: forget what the step
  // launched and left pending, zero the gradients, so that the step can run again from its
  // start. Returns false when this engine cannot (ZeRO-3 cannot yet); then the run restarts
  // from its last checkpoint. Sharded state comes from buddy copies (Note [Buddy copies]).
  virtual bool abandon_step() { return false; }
};

// A scope of the engine (all ranks construct it): `kBegin` at its start, `kEnd` at its end.
template <void (GradientSync::*kBegin)(), void (GradientSync::*kEnd)()>
class SyncScope {
 public:
  explicit SyncScope(GradientSync& sync) : sync_(sync) { (sync_.*kBegin)(); }
  ~SyncScope() { (sync_.*kEnd)(); }
  SyncScope(const SyncScope&) = delete;
  SyncScope& operator=(const SyncScope&) = delete;

 private:
  GradientSync& sync_;
};

// Every parameter whole for a scope: the evaluation of a rank with no batch (Note [Sharded
// evaluation]); evaluation and exports otherwise go unit by unit.
using FullParameters =
    SyncScope<&GradientSync::gather_full_parameters, &GradientSync::release_full_parameters>;

// Evaluation's forwards for a scope: Note [Sharded evaluation].
using ShardedForwards = SyncScope<&GradientSync::begin_forwards, &GradientSync::end_forwards>;

// One process, no communication.
class SingleProcessSync final : public GradientSync {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  double sum_scalar(double value) override { return value; }
  torch::Tensor grad_sq_norm_tensor(const torch::Tensor& flat_grads) override {
    return optim::grad_sq_sum_tensor(flat_grads);
  }
};

}  // namespace dnallm::parallel
