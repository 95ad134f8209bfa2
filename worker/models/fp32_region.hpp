// Note [fp32 regions under autocast]: training.precision = "bf16" runs the forward under
// LibTorch's autocast (Note [Mixed precision on CPU], worker/train/autocast.hpp), which casts the
// inputs of matmuls, linear layers and convolutions to bf16. Some parts of the long-context
// families must not be: HyenaDNA's implicit filter (sin(10 x) of a small MLP: bf16's 8-bit
// mantissa moves its phase by whole radians at large arguments) and the FFT long convolution
// (the reference's fftconv in fp32; an FFT of 2L points sums L products, so bf16 rounding grows
// with the length), and Caduceus's selective scan (a recurrence over L steps, fp32 in mamba-ssm's
// kernels). Such a part runs inside an Fp32Region: autocast is off for the calls made in the
// scope (its dispatch keys are excluded on this thread, as autocast's own kernels do before
// they redispatch), the part casts its inputs up to fp32 and its result back to the dtype the
// caller gave. Autograd is unaffected (its keys are below autocast's), and without autocast the
// region changes nothing. Each such part also opens a RECORD_FUNCTION scope named
// "dnallm::<family>::<part>" around its computation: profiler traces show it, and
// worker_long_context_bf16_test checks with an operator observer that no operator called inside
// it receives a bf16 tensor.
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

namespace dnallm::models {

class Fp32Region {
 public:
  Fp32Region() : no_autocast_(c10::autocast_dispatch_keyset) {}
  Fp32Region(const Fp32Region&) = delete;
  Fp32Region& operator=(const Fp32Region&) = delete;

 private:
  c10::impl::ExcludeDispatchKeyGuard no_autocast_;
};

// The dtype a region computes in for operands of dtype `t`: fp32, or double for double operands
// (which the tests use for exact comparisons).
inline c10::ScalarType fp32_or_double(c10::ScalarType t) {
  return t == c10::kDouble ? c10::kDouble : c10::kFloat;
}

}  // namespace dnallm::models
