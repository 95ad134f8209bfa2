// Mamba, the mixer of Caduceus (Note [Caduceus] in caduceus.hpp): the selective scan (reference
// and fused CPU kernels, Note [Fused selective scan]) and the Mamba module. Its context-parallel
// form is mamba_context.hpp's (Note [Mamba context parallelism]).
#pragma once

#include <torch/torch.h>

#include <cmath>

#include "worker/models/caduceus/caduceus_options.hpp"
#include "worker/models/lora_linear.hpp"

namespace dnallm::models::caduceus {

// The selective scan of Mamba (mamba-ssm's selective_scan_ref, delta_softplus on, z gating):
// u, delta, z [B, D, L]; A [D, N]; Bm, C [B, N, L]; D, delta_bias [D]. fp32; returns [B, D, L].
torch::Tensor selective_scan(const torch::Tensor& u, const torch::Tensor& delta,
                             const torch::Tensor& A, const torch::Tensor& Bm,
                             const torch::Tensor& C, const torch::Tensor& D, const torch::Tensor& z,
                             const torch::Tensor& delta_bias);

// selective_scan() in two steps, for the device-generic context-parallel scan (Note [Mamba
// context parallelism]): the scan from a zero state, keeping what the contribution of a start
// state needs, then the skip and the gate. selective_scan_output(s, s.y) is selective_scan().
struct ScanFromZero {
  torch::Tensor u, delta, A, C, D, z;  // fp32; delta = softplus(delta + delta_bias) [B, D, L]
  torch::Tensor y;                     // sum_n C_t h_t [B, D, L], before the D u skip and the gate
  torch::Tensor last;                  // the state h after the last position [B, D, N]
};
ScanFromZero selective_scan_from_zero(const torch::Tensor& u, const torch::Tensor& delta,
                                      const torch::Tensor& A, const torch::Tensor& Bm,
                                      const torch::Tensor& C, const torch::Tensor& D,
                                      const torch::Tensor& z, const torch::Tensor& delta_bias);
// (y + D u) * silu(z) for the scan `s` whose sum_n C_t h_t is `y` [B, D, L].
torch::Tensor selective_scan_output(const ScanFromZero& s, const torch::Tensor& y);

// The same function, Note [Fused selective scan]: one hand-written loop per (batch, channel) on
// the CPU, forward and backward (an autograd Function); other devices take selective_scan().
// Note [Fused selective scan]'s CPU kernels (fp32, contiguous), for FusedScan and the
// context-parallel scan (Note [Mamba context parallelism]).
inline float softplus20(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
inline float sigmoidf(float x) { return 1.f / (1.f + std::exp(-x)); }
struct FusedScanInputs {
  torch::Tensor u, delta, A, Bt, Ct, Dv, z, bias;  // Bt, Ct [B, L, N]
  // Contiguous fp32 copies as the kernels read them (B and C transposed to [B, L, N]).
  static FusedScanInputs of(const torch::Tensor& u, const torch::Tensor& delta,
                            const torch::Tensor& A, const torch::Tensor& Bm, const torch::Tensor& C,
                            const torch::Tensor& Dv, const torch::Tensor& z,
                            const torch::Tensor& bias);
};
struct FusedScanOutputs {
  torch::Tensor out, y_pre, H;  // y * silu(z); y before the gate; the states [B, D, L, N]
};
// From `start` [B, D, N] before the first position (undefined: zero).
FusedScanOutputs fused_scan_forward(const FusedScanInputs& in, const torch::Tensor& start);
// The gradients of (u, delta, A, B, C, D, z, delta_bias), the state `entering` [B, D, N] after
// the last position (undefined: zero), `start` as in the forward.
torch::autograd::variable_list fused_scan_backward(const FusedScanInputs& in,
                                                   const FusedScanOutputs& forward,
                                                   const torch::Tensor& dout,
                                                   const torch::Tensor& start,
                                                   const torch::Tensor& entering);

torch::Tensor selective_scan_fused(const torch::Tensor& u, const torch::Tensor& delta,
                                   const torch::Tensor& A, const torch::Tensor& Bm,
                                   const torch::Tensor& C, const torch::Tensor& D,
                                   const torch::Tensor& z, const torch::Tensor& delta_bias);

class MambaImpl : public torch::nn::Module {
 public:
  // `shared`: the module whose in_proj and out_proj this one uses (BiMamba's weight tying), or
  // null to own them.
  MambaImpl(const CaduceusOptions& o, MambaImpl* shared);
  torch::Tensor forward(const torch::Tensor& x);  // [B, L, d_model]

  // in_proj and out_proj carry LoRA adapters (Note [Caduceus LoRA targets]).
  LoraLinear in_proj{nullptr}, out_proj{nullptr};
  torch::nn::Linear x_proj{nullptr}, dt_proj{nullptr};
  torch::nn::Conv1d conv1d{nullptr};
  torch::Tensor A_log, D;

 private:
  CaduceusOptions o_;
};
TORCH_MODULE(Mamba);

}  // namespace dnallm::models::caduceus
