// Autocast scope for a training micro-step (bf16 on CPU/CUDA, fp16 on CUDA), shared by the
// trainer and the micro-batch probe. Header-only: only worker/ .cpp files include it.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

namespace dnallm::train {

// Note [Mixed precision on CPU]: bf16 uses LibTorch's autocast (CPU: bf16 matmuls and linear
// layers, fp32 norms, softmax and loss) with fp32 master parameters in the flat buffer. fp16
// autocast exists on CUDA only; on CPU precision = "fp16" computes in fp32 but still runs the
// dynamic loss scaler (so its skip/backoff logic is exercised identically).
class AutocastGuard {
 public:
  AutocastGuard(bool bf16, bool fp16, const torch::Device& device) {
    if (!bf16 && !fp16) return;
    active_ = true;
    cuda_ = device.is_cuda();
    const auto dtype = bf16 ? at::kBFloat16 : at::kHalf;
    const auto type = cuda_ ? at::kCUDA : at::kCPU;
    previous_ = at::autocast::is_autocast_enabled(type);
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::set_autocast_dtype(type, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(cuda_ ? at::kCUDA : at::kCPU, previous_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false, cuda_ = false, previous_ = false;
};

}  // namespace dnallm::train
