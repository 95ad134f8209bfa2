#include "worker/models/transformer/attention.hpp"

#include <cmath>

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

}  // namespace dnallm::models
