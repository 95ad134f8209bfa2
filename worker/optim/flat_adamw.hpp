// Flat fp32 parameter/gradient storage, AdamW over a range of it, LR schedules, global-norm
// clipping and the fp16 loss scaler.
//
// Note [Flat buffers]: every trainable parameter is a view into ONE fp32 buffer and its
// gradient a view into ONE fp32 gradient buffer (same offsets). Autograd accumulates into the
// gradient views in place (DESIGN.md "Verified facts"), so the whole model's gradient is a
// single tensor that a communicator can reduce in buckets and an optimiser can update with a
// handful of vectorised ops. ZeRO shards are plain [begin, end) ranges of these buffers.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"

namespace dnallm::optim {

// Weight decay policy: biases and normalisation weights (and LoRA-free embeddings keep decay,
// as HF's Trainer) get none. Pure function of the parameter name.
bool decays(const std::string& parameter_name);

class FlatParameters {
 public:
  struct Entry {
    std::string name;
    int64_t offset = 0;  // elements from the buffer start
    int64_t numel = 0;
    std::vector<int64_t> shape;
  };

  // Where a piece of this buffer lies in the global layout: elements [global_begin,
  // global_end) of the global flat buffer are at [local_begin, local_begin + size) here.
  struct Piece {
    int64_t global_begin = 0, global_end = 0, local_begin = 0;
  };

  // Takes the parameters that require grad, in the given order, copies them into a new flat
  // fp32 buffer on `device`, and re-points each parameter's data and grad at views of the
  // flat buffers. Frozen parameters (requires_grad false) are left alone.
  FlatParameters(const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
                 torch::Device device = torch::kCPU);
  // A shard (ZeRO-3, Note [Fully sharded] in worker/parallel/fully_sharded.hpp): `params`,
  // `grads` and `decay_mask` are this rank's buffers, `pieces` place them in the global layout
  // of `entries` (global offsets, `global_numel` elements). Parameters are not views of it.
  FlatParameters(std::vector<Entry> entries, int64_t global_numel, torch::Tensor params,
                 torch::Tensor grads, torch::Tensor decay_mask, std::vector<Piece> pieces);

  const torch::Tensor& params() const { return params_; }
  const torch::Tensor& grads() const { return grads_; }
  // 1 where weight decay applies, 0 elsewhere (see decays()).
  const torch::Tensor& decay_mask() const { return decay_mask_; }
  // Every trainable parameter in the global layout (the whole buffer's, unless sharded).
  const std::vector<Entry>& entries() const { return entries_; }
  // Elements of this buffer (of this rank's shard when sharded).
  int64_t numel() const { return params_.numel(); }
  // Elements of the global layout; numel() unless sharded.
  int64_t global_numel() const { return global_numel_; }
  // Trainable parameters: the entries' elements (the global layout may hold gaps: ZeRO-3).
  int64_t parameter_count() const {
    int64_t n = 0;
    for (const auto& e : entries_) n += e.numel;
    return n;
  }
  bool sharded() const { return sharded_; }
  // This buffer in the global layout: one piece {0, numel(), 0} unless sharded.
  const std::vector<Piece>& pieces() const { return pieces_; }

  // Zeroes the flat gradient buffer (never resets the grads: they stay views).
  void zero_grad() { grads_.zero_(); }

 private:
  torch::Tensor params_, grads_, decay_mask_;
  std::vector<Entry> entries_;
  int64_t global_numel_ = 0;
  bool sharded_ = false;
  std::vector<Piece> pieces_;
};

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// AdamW over the flat range [begin, end) (a ZeRO shard, or the whole buffer). It owns the
// moments of that range only. step() is one multi-tensor update: ~6 vectorised ops over the
// range, independent of the number of parameters.
class FlatAdamW {
 public:
  FlatAdamW(AdamWOptions options, int64_t begin, int64_t end, torch::Tensor decay_mask_range);

  // `params` and `grads` are the [end - begin] slices (views). Gradients are multiplied by
  // `grad_scale` (clip coefficient / loss scale) on the fly; they are not modified.
  void step(torch::Tensor params, const torch::Tensor& grads, double lr, double grad_scale = 1.0);

  // The same update with the gradient multiplier a 0-dim fp32 device tensor (clip coefficient
  // / loss scale computed on the device): nothing is read back. On LibTorch 2.x CUDA it is
  // torch's fused AdamW kernel over the decayed and the undecayed runs of the range.
  void step(torch::Tensor params, const torch::Tensor& grads, double lr,
            const torch::Tensor& grad_scale);

  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  int64_t steps() const { return step_; }
  // State for checkpoints: moments [end - begin] and the step count.
  torch::Tensor& exp_avg() { return exp_avg_; }
  torch::Tensor& exp_avg_sq() { return exp_avg_sq_; }
  void set_steps(int64_t steps) {
    step_ = steps;
    if (step_tensor_.defined()) step_tensor_.fill_(static_cast<double>(steps));
  }
  // Whether step(Tensor) runs torch's fused kernel (LibTorch 2.x, CUDA).
  bool fused() const { return step_tensor_.defined(); }

 private:
  // The update both step()s share once the moments are updated for step_: decoupled weight
  // decay, then p -= lr / bc1 * m / (sqrt(v / bc2) + eps). Uses scratch_.
  void apply_update(torch::Tensor& params, double lr);
  // step(Tensor) on torch's fused kernel (LibTorch >= 2.1, CUDA).
  void fused_step(torch::Tensor& params, const torch::Tensor& grads, double lr,
                  const torch::Tensor& grad_scale);

  AdamWOptions options_;
  int64_t begin_, end_;
  int64_t step_ = 0;
  torch::Tensor decay_mask_, exp_avg_, exp_avg_sq_, scratch_;
  // Fused path: [begin, end) runs of equal decay (read from the mask once, at construction)
  // and the step count as a device tensor (the kernel reads it).
  std::vector<std::pair<int64_t, int64_t>> decay_runs_, plain_runs_;
  torch::Tensor step_tensor_;
};

// Sum of squares of a gradient range as a double (a partial: add partials across shards,
// then sqrt). Non-finite values propagate (inf/nan detection for the loss scaler).
double grad_sq_sum(const torch::Tensor& grads);
// The same as a 0-dim fp32 tensor on the gradients' device (nothing read back).
torch::Tensor grad_sq_sum_tensor(const torch::Tensor& grads);
// min(1, max_norm / (total_norm + 1e-6)); 1 when max_norm <= 0 (clipping off).
double clip_coefficient(double total_norm, double max_norm);
// The same on the device for a 0-dim `total_norm` (Note [Sync-free step] in
// worker/train/trainer.hpp): a 0-dim tensor of total_norm's dtype and device; nothing is read
// back.
torch::Tensor clip_coefficient(const torch::Tensor& total_norm, double max_norm);

enum class ScheduleKind { kConstant, kLinear, kCosine };
struct Schedule {
  ScheduleKind kind = ScheduleKind::kLinear;
  double base_lr = 3e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
};
// warmup_steps, else ceil(warmup_ratio * total_steps). Throws Error(kUsage) on a bad name.
Schedule schedule_from_config(const TrainingConfig& training, int64_t total_steps);
// Learning rate of optimizer step `step` (0-based), HF's conventions: linear warmup from 0,
// then constant / linear decay to 0 at total_steps / half-cosine to 0.
double lr_at(const Schedule& schedule, int64_t step);

// Dynamic loss scaling for fp16: scale the loss, skip steps whose gradients overflow and
// back off; grow after `growth_interval` clean steps.
struct LossScalerOptions {
  bool enabled = false;
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});
  double scale() const { return options_.enabled ? scale_ : 1.0; }
  // Call once per optimizer step with whether any gradient was inf/nan. Returns true when the
  // step must be applied, false when it is skipped (then the scale backs off).
  bool update(bool found_inf);
  bool enabled() const { return options_.enabled; }
  int64_t skipped_steps() const { return skipped_; }
  // Checkpoint state: the raw scale (kept when disabled), clean steps since the last change.
  double raw_scale() const { return scale_; }
  int64_t clean_steps() const { return clean_steps_; }
  // Restores what raw_scale(), clean_steps() and skipped_steps() returned when saved.
  void restore(double raw_scale, int64_t clean_steps, int64_t skipped_steps) {
    scale_ = raw_scale;
    clean_steps_ = clean_steps;
    skipped_ = skipped_steps;
  }

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t clean_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace dnallm::optim
