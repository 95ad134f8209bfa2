// One transformer block (attention and feed-forward sublayers, their norms and residuals), LoRA
// on a block, and activation checkpointing of a block.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "worker/models/lora_linear.hpp"
#include "worker/models/transformer/model_options.hpp"

namespace dnallm::models {

struct AttentionContext;  // worker/models/transformer/context_attention.hpp
// LoraLinear: worker/models/lora_linear.hpp (Note [LoRA linear]).

// Key/value cache of one layer for incremental decoding: [batch, kv_heads, past_len, head_dim]
// (grouped-query attention caches the shared heads once).
struct LayerCache {
  torch::Tensor key, value;
};

// One pre-LN block: x + Attn(LN(x)), then x + FFN(LN(x)) (or both on x: parallel_residual).
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const ModelOptions& options);
  // `bias`: additive attention mask broadcastable to [batch, heads, q, k] (or undefined);
  // `causal`: apply a causal mask in addition. `cache` (may be null) is read and extended.
  // `rope`: (cos, sin) for the query positions, or undefined tensors. `ffn_rows` (int64, flat
  // indices into [B * T]): the feed-forward runs on those tokens only (Note [Padding-free
  // feed-forward]); the other rows leave the block as the attention sublayer made them.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, bool causal,
                        LayerCache* cache, const torch::Tensor& rope_cos,
                        const torch::Tensor& rope_sin, const torch::Tensor& ffn_rows = {});

  // Masked LM, last block only: computes the outputs at `positions` [B, M] (int64) alone,
  // attending over the whole sequence. Returns [B, M, hidden].
  torch::Tensor forward_selected(const torch::Tensor& x, const torch::Tensor& bias,
                                 const torch::Tensor& rope_cos, const torch::Tensor& rope_sin,
                                 const torch::Tensor& positions);

  LoraLinear query{nullptr}, key{nullptr}, value{nullptr}, attn_out{nullptr};
  LoraLinear ffn_in{nullptr}, ffn_out{nullptr};
  LoraLinear ffn_gate{nullptr};  // options.gated_mlp
  torch::nn::LayerNorm ln_attn{nullptr}, ln_ffn{nullptr};
  torch::Tensor rms_attn, rms_ffn;  // options.rms_norm: the norms' weights instead
  // Note [Attention context parallelism]: x holds this rank's positions; keys and values are
  // gathered over the context group (null: off).
  std::shared_ptr<AttentionContext> context;

 private:
  torch::Tensor forward_impl(const torch::Tensor& x, const torch::Tensor& bias, bool causal,
                             LayerCache* cache, const torch::Tensor& rope_cos,
                             const torch::Tensor& rope_sin, const torch::Tensor& positions,
                             const torch::Tensor& ffn_rows);
  ModelOptions options_;
};
TORCH_MODULE(Block);

// Note [LoRA block by block]: LoRA on one block as `options` asks (lora_r > 0; the targets):
// its base frozen, adapters added (their draws) on the targeted linears; again on a block that
// has them, it only marks them trainable. TransformerLMImpl::enable_lora runs it on every
// block; a build that fills blocks as they are built (Note [Streamed build]) runs it on each
// block right after it is filled, so DDP and ZeRO-3 draw the adapters in the same order (and,
// under QLoRA, quantizes the block's base linears then: build_filled in hf_import.hpp).
void enable_block_lora(torch::nn::Module& block, const ModelOptions& options);

// Runs `block` without keeping activations; backward reruns it under grad mode.
// Note [Activation checkpointing]: a custom autograd Function whose forward runs under no_grad
// and whose backward reruns the block under grad mode and back-propagates through it
// (parameter gradients accumulate as usual). Dropout masks are re-drawn on the rerun, so with
// dropout > 0 the gradients are those of a different mask (as PyTorch without
// preserve_rng_state); with dropout = 0 they are identical.
torch::Tensor checkpointed_block(Block& block, const torch::Tensor& x, const torch::Tensor& bias,
                                 bool causal, const torch::Tensor& rope_cos,
                                 const torch::Tensor& rope_sin);

}  // namespace dnallm::models
