// The feed-forward sublayer of a block (Note [Feed-forward variants]).
#pragma once

#include <torch/torch.h>

#include "worker/models/lora_linear.hpp"
#include "worker/models/transformer/model_options.hpp"

namespace dnallm::models {

// Note [Feed-forward variants]: with `in` [ffn, hidden] and `out` [hidden, ffn] (HF names:
// intermediate.dense, output.dense) and, for the gated ones, `gate_linear` [ffn, hidden]
// (intermediate.gate):
//   kGelu    out(gelu(in(x)))                  BERT, ESM, GPT-NeoX, this project's default
//   kGeglu   out(gelu(gate(x)) * in(x))        DNABERT-2 (exact, erf GELU)
//   kSwiglu  out(silu(gate(x)) * in(x))        Llama, Nucleotide Transformer v2
enum class FeedForwardKind { kGelu, kGeglu, kSwiglu };

// The variant `o` describes (gated_mlp, gate_activation).
FeedForwardKind feed_forward_kind(const ModelOptions& o);

// The feed-forward of `x` [..., hidden] (no dropout: the block's). Gated, the gate and up
// projections run as one GEMM where neither has an adapter or a quantized base (the weights stay
// separate parameters); `gate_linear` is null for kGelu.
torch::Tensor feed_forward(const torch::Tensor& x, LoraLinear& in, LoraLinear& gate_linear,
                           LoraLinear& out, FeedForwardKind kind);

}  // namespace dnallm::models
