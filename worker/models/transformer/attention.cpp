#include "worker/models/transformer/attention.hpp"

#include <cmath>

#include "core/error.hpp"
#include "worker/models/transformer/positions.hpp"

namespace dnallm::models {

using torch::Tensor;

// Note [Attention masks]: every mask is an additive tensor broadcastable to [B, H, Tq, Tk],
// 0 where attention is allowed and a large finite negative where it is not (finite so a query
// with nothing to attend to gives a uniform, not NaN, distribution). Padding, packing
// (segment_ids, block-diagonal) and causality are combined into one such tensor by encode();
// `causal` without a mask uses the kernel's own causal path.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias, bool causal,
                 AttnImpl impl) {
  return attention_with_dropout(q, k, v, bias, causal, impl, 0.0);
}

Tensor attention_with_dropout(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                              bool causal, AttnImpl impl, double dropout_p) {
  if (impl == AttnImpl::kSdpa) {
    c10::optional<Tensor> mask;
    if (bias.defined()) mask = bias.to(q.dtype());
    return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, causal && !bias.defined());
  }
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  if (bias.defined()) {
    scores = scores + bias.to(scores.dtype());
  } else if (causal) {
    const int64_t tq = q.size(-2), tk = k.size(-2);
    auto allowed = torch::ones({tq, tk}, q.options().dtype(torch::kBool)).tril(tk - tq);
    scores = scores.masked_fill(allowed.logical_not(), mask_value(scores.scalar_type()));
  }
  auto probs = torch::softmax(scores, -1);
  if (dropout_p > 0) probs = torch::dropout(probs, dropout_p, true);
  return torch::matmul(probs, v);
}

QkvHeads project_qkv(const Tensor& h, LoraLinear& query, LoraLinear& key, LoraLinear& value,
                     const AttentionHeads& heads, bool with_query) {
  const int64_t b = h.size(0), t = h.size(1), nh = heads.heads, nkv = heads.kv_heads,
                hd = heads.head_dim, hidden = nh * hd;
  Tensor q, k, v;
  const bool plain_qkv = !query->has_lora() && !key->has_lora() && !value->has_lora() &&
                         !query->quantized() && !key->quantized() && !value->quantized();
  if (plain_qkv && with_query) {
    // One GEMM for Q, K and V (the weights stay separate parameters, HF names).
    auto w = torch::cat({query->weight, key->weight, value->weight}, 0);
    auto bqkv =
        query->bias.defined() ? torch::cat({query->bias, key->bias, value->bias}, 0) : Tensor();
    // unbind, not qkv[0..2]: the backward of three selects allocates and zero-fills a full
    // [3, B, H, T, D] gradient for each and sums them; unbind's backward stacks once (the same
    // values: the selects' zeros add exactly).
    if (nkv == nh) {
      auto qkv =
          torch::linear(h, w, bqkv).view({b, t, 3, nh, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
      q = qkv[0];
      k = qkv[1];
      v = qkv[2];
    } else {
      auto qkv = torch::linear(h, w, bqkv).split_with_sizes({hidden, nkv * hd, nkv * hd}, -1);
      q = qkv[0].view({b, t, nh, hd}).transpose(1, 2);
      k = qkv[1].view({b, t, nkv, hd}).transpose(1, 2);
      v = qkv[2].view({b, t, nkv, hd}).transpose(1, 2);
    }
  } else {
    k = key(h).view({b, t, nkv, hd}).transpose(1, 2);
    v = value(h).view({b, t, nkv, hd}).transpose(1, 2);
  }
  if (with_query && !q.defined()) q = query(h).view({b, t, nh, hd}).transpose(1, 2);
  return {q, k, v};
}

Tensor repeat_kv_heads(const Tensor& x, int64_t heads) {
  // Note [Grouped-query attention]: query head i attends with key/value head i / (nh / nkv)
  // (transformers' repeat_kv): each shared head is repeated after the cache, which keeps
  // nkv heads. Exact for every attention kernel and mask.
  const int64_t b = x.size(0), nkv = x.size(1), n = x.size(2), hd = x.size(3);
  return x.unsqueeze(2).expand({b, nkv, heads / nkv, n, hd}).reshape({b, heads, n, hd});
}

AttentionBias attention_bias(const ForwardInputs& in, int64_t b, int64_t t, int64_t past_len,
                             bool causal, int64_t alibi_heads, const torch::Device& device) {
  const int64_t tk = past_len + t;
  Tensor allowed;  // bool, broadcastable to [B, 1, T, Tk]
  bool padded_batch = false;
  if (in.attention_mask.defined()) {
    auto key_ok = in.attention_mask.to(torch::kBool);
    if (key_ok.size(1) == t && past_len > 0) {
      key_ok = torch::cat({torch::ones({b, past_len}, key_ok.options()), key_ok}, 1);
    }
    // See Note [Host-known batch facts]: the host says whether anything is padded.
    const bool any_padding =
        in.padded.has_value() && past_len == 0 ? *in.padded : !key_ok.all().item<bool>();
    if (any_padding) allowed = key_ok.view({b, 1, 1, tk});
    padded_batch = any_padding;
  }
  if (in.segment_ids.defined()) {
    DNALLM_CHECK(past_len == 0, ExitCode::kFailure, "packed segments are not cached");
    auto seg = in.segment_ids;
    auto same = seg.unsqueeze(2).eq(seg.unsqueeze(1)).unsqueeze(1);  // [B, 1, T, T]
    allowed = allowed.defined() ? allowed.logical_and(same) : same;
  }
  if (causal && (allowed.defined() || (past_len > 0 && t > 1) || alibi_heads > 0)) {
    auto tri = torch::ones({t, tk}, torch::TensorOptions().dtype(torch::kBool).device(device))
                   .tril(past_len);
    allowed = allowed.defined() ? allowed.logical_and(tri) : tri.view({1, 1, t, tk});
  }
  Tensor bias;
  if (allowed.defined()) {
    bias =
        torch::zeros(allowed.sizes(), torch::TensorOptions().dtype(torch::kFloat32).device(device))
            .masked_fill(allowed.logical_not(), mask_value(torch::kFloat32));
  }
  if (alibi_heads > 0) {  // Note [ALiBi]: added to the padding/causal mask, as DNABERT-2 does
    auto alibi = alibi_bias(alibi_heads, past_len, t, tk, device);
    bias = bias.defined() ? bias + alibi : alibi;
  }
  return {bias, padded_batch};
}

}  // namespace dnallm::models
