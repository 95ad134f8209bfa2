#include "worker/models/transformer/block.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "worker/models/recompute_autocast.hpp"
#include "worker/models/transformer/attention.hpp"
#include "worker/models/transformer/context_attention.hpp"
#include "worker/models/transformer/feed_forward.hpp"
#include "worker/models/transformer/layers.hpp"
#include "worker/models/transformer/positions.hpp"

namespace dnallm::models {

using detail::holder;
using detail::norm;
using detail::rms_norm;
using torch::Tensor;

// ---------------------------------------------------------------------------------------------
// Block

BlockImpl::BlockImpl(const ModelOptions& options) : options_(options) {
  const int64_t h = options.hidden;
  const int64_t kv = key_value_heads(options) * (h / options.heads);
  const bool b = options.linear_bias;
  auto attention = holder(*this, "attention");
  auto self = holder(*attention, "self");
  query = self->register_module("query", LoraLinear(h, h, b));
  key = self->register_module("key", LoraLinear(h, kv, b));
  value = self->register_module("value", LoraLinear(h, kv, b));
  auto attn_output = holder(*attention, "output");
  attn_out = attn_output->register_module("dense", LoraLinear(h, h, b));
  auto layer_norm = [&](torch::nn::Module& parent, torch::nn::LayerNorm& ln, Tensor& rms) {
    if (options.rms_norm) {
      rms = holder(parent, "LayerNorm")->register_parameter("weight", torch::ones({h}));
    } else {
      ln = parent.register_module(
          "LayerNorm",
          torch::nn::LayerNorm(torch::nn::LayerNormOptions({h}).eps(options.layer_norm_eps)));
    }
  };
  layer_norm(*attn_output, ln_attn, rms_attn);
  auto intermediate = holder(*this, "intermediate");
  const bool fb = b && options.ffn_bias;
  const bool in_bias = fb && options.ffn_in_bias;
  ffn_in = intermediate->register_module("dense", LoraLinear(h, options.ffn, in_bias));
  if (options.gated_mlp) {
    ffn_gate = intermediate->register_module("gate", LoraLinear(h, options.ffn, in_bias));
  }
  auto output = holder(*this, "output");
  ffn_out = output->register_module("dense", LoraLinear(options.ffn, h, fb));
  layer_norm(*output, ln_ffn, rms_ffn);
}

Tensor BlockImpl::forward(const Tensor& x, const Tensor& bias, bool causal, LayerCache* cache,
                          const Tensor& rope_cos, const Tensor& rope_sin, const Tensor& ffn_rows) {
  return forward_impl(x, bias, causal, cache, rope_cos, rope_sin, Tensor(), ffn_rows);
}

Tensor BlockImpl::forward_selected(const Tensor& x, const Tensor& bias, const Tensor& rope_cos,
                                   const Tensor& rope_sin, const Tensor& positions) {
  return forward_impl(x, bias, false, nullptr, rope_cos, rope_sin, positions, Tensor());
}

Tensor BlockImpl::forward_impl(const Tensor& x, const Tensor& bias, bool causal, LayerCache* cache,
                               const Tensor& rope_cos, const Tensor& rope_sin,
                               const Tensor& positions, const Tensor& ffn_rows) {
  const int64_t b = x.size(0), t = x.size(1), nh = options_.heads, hidden = options_.hidden,
                hd = hidden / nh, nkv = key_value_heads(options_);
  const double p = is_training() ? options_.dropout : 0.0;
  const bool post_ln = options_.post_layer_norm;
  auto norm_attn = [&](const Tensor& t) {
    return ln_attn ? norm(ln_attn, t) : rms_norm(rms_attn, t, options_.layer_norm_eps);
  };
  auto norm_ffn = [&](const Tensor& t) {
    return ln_ffn ? norm(ln_ffn, t) : rms_norm(rms_ffn, t, options_.layer_norm_eps);
  };
  auto h = post_ln ? x : norm_attn(x);
  // (with `positions`: the queries below, at those positions only)
  auto [q, k, v] = project_qkv(h, query, key, value, AttentionHeads{nh, nkv, hd},
                               /*with_query=*/!positions.defined());
  Tensor residual = x;
  Tensor q_cos = rope_cos, q_sin = rope_sin;
  Tensor attn_bias = bias;
  int64_t tq = t;
  if (positions.defined()) {
    // Note [Scored positions only]: only the queries at `positions` [B, M] are computed;
    // keys and values still cover the whole sequence.
    tq = positions.size(1);
    if (bias.defined() && bias.size(-2) > 1) {  // a bias per query (ALiBi): their rows only
      auto full = bias.expand({b, bias.size(1), t, bias.size(3)});
      attn_bias =
          full.gather(2, positions.view({b, 1, tq, 1}).expand({b, bias.size(1), tq, bias.size(3)}));
    }
    auto index = positions.unsqueeze(-1).expand({b, tq, hidden});
    q = query(h.gather(1, index)).view({b, tq, nh, hd}).transpose(1, 2);
    residual = x.gather(1, index);
    if (rope_cos.defined()) {
      const int64_t rd = rope_cos.size(-1);  // Note [Rotary variants]: maybe part of the head
      q_cos = rope_cos.index_select(0, positions.reshape({-1})).view({b, 1, tq, rd});
      q_sin = rope_sin.index_select(0, positions.reshape({-1})).view({b, 1, tq, rd});
    }
  }
  if (rope_cos.defined()) {
    q = apply_rope(q, q_cos, q_sin);
    k = apply_rope(k, rope_cos, rope_sin);
  }
  if (cache != nullptr) {
    if (cache->key.defined()) {
      k = torch::cat({cache->key, k}, 2);
      v = torch::cat({cache->value, v}, 2);
    }
    cache->key = k;
    cache->value = v;
  }
  // Note [Attention context parallelism]: context_attention exchanges k and v (the nkv shared
  // heads, repeated after the exchange) while it computes the local blocks.
  if (nkv != nh && !context) {
    k = repeat_kv_heads(k, nh);  // Note [Grouped-query attention]
    v = repeat_kv_heads(v, nh);
  }
  auto a = context ? context_attention(q, k, v, *context, p)
                   : attention_with_dropout(q, k, v, attn_bias, causal, options_.attn, p);
  a = a.transpose(1, 2).reshape({b, tq, hidden});
  auto out = attn_out(a);
  if (p > 0) out = torch::dropout(out, p, true);
  auto y = residual + out;
  if (post_ln) y = norm_attn(y);
  // Note [Parallel residual]: GPT-NeoX's use_parallel_residual (Pythia): the feed-forward reads
  // the block's input, not y, and the block returns mlp + attn + x, summed in that order as
  // transformers' GPTNeoXLayer does. (Pre-LN only: check_model_shape.)
  const bool parallel = options_.parallel_residual;
  auto hf = post_ln ? y : norm_ffn(parallel ? residual : y);
  Tensor y_rows = y, out_rows = out, residual_rows = residual;
  if (ffn_rows.defined()) {  // Note [Padding-free feed-forward]
    auto rows = [&](const Tensor& t) { return t.reshape({-1, hidden}).index_select(0, ffn_rows); };
    hf = rows(hf);
    y_rows = rows(y);
    if (parallel) {
      out_rows = rows(out);
      residual_rows = rows(residual);
    }
  }
  auto f = feed_forward(hf, ffn_in, ffn_gate, ffn_out, feed_forward_kind(options_));
  if (p > 0) f = torch::dropout(f, p, true);
  auto block_out = post_ln    ? norm_ffn(y_rows + f)
                   : parallel ? f + out_rows + residual_rows
                              : y_rows + f;
  if (!ffn_rows.defined()) return block_out;
  return y.reshape({-1, hidden}).index_copy(0, ffn_rows, block_out).view(y.sizes());
}

// ---------------------------------------------------------------------------------------------
// Activation checkpointing (see Note [Activation checkpointing])

namespace {

// Autograd Functions cannot take undefined tensors: absent ones travel as empty tensors.
Tensor present(const Tensor& t) { return t.defined() ? t : torch::empty({0}); }
Tensor opt(const Tensor& t) { return t.numel() == 0 ? Tensor() : t; }

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor x, Tensor bias, Tensor cos,
                        Tensor sin, int64_t block_address, bool causal) {
    ctx->save_for_backward({x, bias, cos, sin});
    ctx->saved_data["block"] = block_address;
    ctx->saved_data["causal"] = causal;
    save_autocast_state(ctx);  // Note [Recompute under the forward's autocast]
    auto* block = reinterpret_cast<BlockImpl*>(block_address);
    return block->forward(x, opt(bias), causal, nullptr, opt(cos), opt(sin));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    auto* block = reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    const bool causal = ctx->saved_data["causal"].toBool();
    auto x = saved[0].detach().requires_grad_(true);
    Tensor out;
    {
      torch::AutoGradMode grad_mode(true);
      RecomputeAutocast autocast(ctx);
      out = block->forward(x, opt(saved[1]), causal, nullptr, opt(saved[2]), opt(saved[3]));
    }
    torch::autograd::backward({out}, {grad_out[0]});
    return {x.grad(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor checkpointed_block(Block& block, const Tensor& x, const Tensor& bias, bool causal,
                          const Tensor& rope_cos, const Tensor& rope_sin) {
  // The Function only gets a backward when an input requires grad; with a frozen embedding
  // (LoRA) the hidden state does not, yet the block's adapters still need gradients.
  auto input = x.requires_grad() ? x : x.detach().requires_grad_(true);
  return CheckpointFunction::apply(input, present(bias), present(rope_cos), present(rope_sin),
                                   reinterpret_cast<int64_t>(block.get()), causal);
}

void enable_block_lora(torch::nn::Module& module, const ModelOptions& o) {
  auto* block = dynamic_cast<BlockImpl*>(&module);
  DNALLM_CHECK(block != nullptr && o.lora_r > 0, ExitCode::kFailure,
               "internal: enable_block_lora on a {} with r = {}", module.name(), o.lora_r);
  for (auto& p : block->parameters()) p.set_requires_grad(false);
  auto wants = [&](const std::string& name) {
    return std::find(o.lora_targets.begin(), o.lora_targets.end(), name) != o.lora_targets.end();
  };
  if (wants("query")) block->query->enable_lora(o.lora_r, o.lora_alpha, o.lora_dropout);
  if (wants("key")) block->key->enable_lora(o.lora_r, o.lora_alpha, o.lora_dropout);
  if (wants("value")) block->value->enable_lora(o.lora_r, o.lora_alpha, o.lora_dropout);
  if (wants("dense")) {
    block->attn_out->enable_lora(o.lora_r, o.lora_alpha, o.lora_dropout);
    block->ffn_in->enable_lora(o.lora_r, o.lora_alpha, o.lora_dropout);
    block->ffn_out->enable_lora(o.lora_r, o.lora_alpha, o.lora_dropout);
  }
}

}  // namespace dnallm::models
