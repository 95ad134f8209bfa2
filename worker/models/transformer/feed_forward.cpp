#include "worker/models/transformer/feed_forward.hpp"

namespace dnallm::models {

using torch::Tensor;

FeedForwardKind feed_forward_kind(const ModelOptions& o) {
  if (!o.gated_mlp) return FeedForwardKind::kGelu;
  return o.gate_activation == ModelOptions::GateActivation::kGelu ? FeedForwardKind::kGeglu
                                                                  : FeedForwardKind::kSwiglu;
}

Tensor feed_forward(const Tensor& x, LoraLinear& in, LoraLinear& gate_linear, LoraLinear& out,
                    FeedForwardKind kind) {
  Tensor inner;
  if (kind == FeedForwardKind::kGelu) {
    inner = torch::gelu(in(x));
  } else {
    Tensor gate, up;
    const bool plain_ffn = !gate_linear->has_lora() && !in->has_lora() &&
                           !gate_linear->quantized() && !in->quantized();
    if (plain_ffn) {
      // One GEMM for the gate and up projections (as for Q, K and V: project_qkv; DNABERT-2
      // stores them fused, gated_layers), the weights separate parameters.
      auto w = torch::cat({gate_linear->weight, in->weight}, 0);
      auto bgu =
          gate_linear->bias.defined() ? torch::cat({gate_linear->bias, in->bias}, 0) : Tensor();
      auto gu = torch::linear(x, w, bgu).chunk(2, -1);
      gate = gu[0];
      up = gu[1];
    } else {
      gate = gate_linear(x);
      up = in(x);
    }
    // Exact (erf) GELU as DNABERT-2's GLU, or SiLU (Llama).
    inner = kind == FeedForwardKind::kGeglu ? torch::gelu(gate) * up : torch::silu(gate) * up;
  }
  return out(inner);
}

}  // namespace dnallm::models
