// Note [Recompute under the forward's autocast]: activation checkpointing recomputes a block in
// backward, and backward runs outside the trainer's AutocastGuard (worker/train/autocast.hpp:
// it scopes the forward only). A checkpointed block of a bf16 run (or fp16 on CUDA) was
// therefore recomputed in fp32: its gradients came from other activations than the forward's
// (slower, more memory, and not the gradients of the loss that was computed). As PyTorch's
// torch.utils.checkpoint does, each checkpoint Function records the autocast state of its
// forward (save_autocast_state) and its backward recomputes inside RecomputeAutocast, which
// re-enters that state for the recompute's scope only. Without autocast both are no-ops.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cstdint>

namespace dnallm::models {

// In a checkpoint Function's forward: the autocast state it runs under, kept in ctx.
inline void save_autocast_state(torch::autograd::AutogradContext* ctx) {
  ctx->saved_data["autocast_cpu"] = at::autocast::is_autocast_enabled(at::kCPU);
  ctx->saved_data["autocast_cuda"] = at::autocast::is_autocast_enabled(at::kCUDA);
  ctx->saved_data["autocast_cpu_dtype"] =
      static_cast<int64_t>(at::autocast::get_autocast_dtype(at::kCPU));
  ctx->saved_data["autocast_cuda_dtype"] =
      static_cast<int64_t>(at::autocast::get_autocast_dtype(at::kCUDA));
}

// In its backward, around the recompute: the forward's autocast state for this scope.
class RecomputeAutocast {
 public:
  explicit RecomputeAutocast(torch::autograd::AutogradContext* ctx)
      : cpu_(ctx->saved_data["autocast_cpu"].toBool()),
        cuda_(ctx->saved_data["autocast_cuda"].toBool()),
        previous_cpu_(at::autocast::is_autocast_enabled(at::kCPU)),
        previous_cuda_(at::autocast::is_autocast_enabled(at::kCUDA)),
        previous_cpu_dtype_(at::autocast::get_autocast_dtype(at::kCPU)),
        previous_cuda_dtype_(at::autocast::get_autocast_dtype(at::kCUDA)) {
    if (!cpu_ && !cuda_) return;
    at::autocast::set_autocast_enabled(at::kCPU, cpu_);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_);
    at::autocast::set_autocast_dtype(
        at::kCPU, static_cast<at::ScalarType>(ctx->saved_data["autocast_cpu_dtype"].toInt()));
    at::autocast::set_autocast_dtype(
        at::kCUDA, static_cast<at::ScalarType>(ctx->saved_data["autocast_cuda_dtype"].toInt()));
    at::autocast::increment_nesting();
  }
  ~RecomputeAutocast() {
    if (!cpu_ && !cuda_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, previous_cpu_);
    at::autocast::set_autocast_enabled(at::kCUDA, previous_cuda_);
    at::autocast::set_autocast_dtype(at::kCPU, previous_cpu_dtype_);
    at::autocast::set_autocast_dtype(at::kCUDA, previous_cuda_dtype_);
  }
  RecomputeAutocast(const RecomputeAutocast&) = delete;
  RecomputeAutocast& operator=(const RecomputeAutocast&) = delete;

 private:
  bool cpu_, cuda_;
  bool previous_cpu_, previous_cuda_;
  at::ScalarType previous_cpu_dtype_, previous_cuda_dtype_;
};

}  // namespace dnallm::models
