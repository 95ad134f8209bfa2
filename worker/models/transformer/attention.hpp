// Dense attention on [B, H, T, D] tensors (Note [Attention masks]); the context-parallel form is
// context_attention.hpp's.
#pragma once

#include <torch/torch.h>

#include "worker/models/transformer/model_options.hpp"

namespace dnallm::models {

// Large negative additive value for masked scores: finite so a fully masked row stays finite.
inline double mask_value(torch::ScalarType dtype) {
  return dtype == torch::kHalf ? -65504.0 : -1e9;
}

// Attention on [B, H, T, D] tensors with an additive mask (see the implementation note).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& bias, bool causal, AttnImpl impl);
torch::Tensor attention_with_dropout(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& bias, bool causal,
                                     AttnImpl impl, double dropout_p);

}  // namespace dnallm::models
