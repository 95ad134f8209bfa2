// Dense attention on [B, H, T, D] tensors (Note [Attention masks]); the context-parallel form is
// context_attention.hpp's.
#pragma once

#include <torch/torch.h>

#include "worker/models/language_model.hpp"
#include "worker/models/lora_linear.hpp"
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

// The heads of one attention: `heads` query heads and `kv_heads` key/value heads (grouped-query
// attention when fewer), each of `head_dim` channels.
struct AttentionHeads {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
};

// Queries [B, heads, T, D], keys and values [B, kv_heads, T, D] of `h` [B, T, hidden]. Where no
// projection has an adapter or a quantized base, one GEMM computes all three (the weights stay
// separate parameters, HF names). Without `with_query` the queries stay undefined (the caller
// computes them at some positions only: Note [Scored positions only]) and the keys and values
// come from their own linears. In the unfused form, K, V and then Q run in that order (LoRA
// dropout draws).
struct QkvHeads {
  torch::Tensor q, k, v;
};
QkvHeads project_qkv(const torch::Tensor& h, LoraLinear& query, LoraLinear& key, LoraLinear& value,
                     const AttentionHeads& heads, bool with_query);

// Note [Grouped-query attention]: key/value heads [B, kv_heads, T, D] repeated to `heads` query
// heads [B, heads, T, D], each shared head `heads / kv_heads` times in a row.
torch::Tensor repeat_kv_heads(const torch::Tensor& x, int64_t heads);

// Note [Attention masks]: the additive mask [B or 1, 1 or H, T, past_len + T] of `t` queries
// that follow `past_len` cached positions, from `in`'s attention_mask (padding; `in.padded` is
// the host's answer, Note [Host-known batch facts]) and segment_ids (packing), with causality
// where `causal` and the kernel's own causal path does not serve (another mask, several new
// queries after a cache, ALiBi), plus ALiBi's biases when `alibi_heads` > 0 (Note [ALiBi]).
// `bias` stays undefined when nothing masks; `padded_batch` says whether some key is padding.
struct AttentionBias {
  torch::Tensor bias;  // fp32
  bool padded_batch = false;
};
AttentionBias attention_bias(const ForwardInputs& in, int64_t batch, int64_t t, int64_t past_len,
                             bool causal, int64_t alibi_heads, const torch::Device& device);

}  // namespace dnallm::models
