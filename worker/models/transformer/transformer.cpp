#include "worker/models/transformer/transformer.hpp"

#include <torch/version.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/host_memory.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/recompute_autocast.hpp"
#include "worker/models/transformer/context_attention.hpp"
#include "worker/parallel/context_parallel.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models {
namespace {

using torch::Tensor;

std::shared_ptr<torch::nn::Module> holder(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

// Note [Rotary variants]: rotary positions as transformers' Llama and GPT-NeoX compute them.
// The frequencies are rope_theta^(-2i / d) for i < d / 2, d = rotary_dims() (base 10000 over
// the whole head unless the model says otherwise: Llama 3's rope_theta 500000, Pythia's
// rotary_pct 0.25); the tables hold [freqs, freqs] (d columns) and the first d channels of each
// query and key head rotate in the "rotate half" form, the others pass through unchanged
// (GPT-NeoX's apply_rotary_pos_emb: q[..., :d] rotated, then cat with q[..., d:]). With the
// defaults (10000, the whole head) the arithmetic is the one this project always did.

// Rotary embedding in the "rotate half" form: x * cos + rotate_half(x) * sin, on the first
// cos.size(-1) channels of x (Note [Rotary variants]); the others pass unchanged.
Tensor apply_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t rotated_dims = cos.size(-1);
  if (rotated_dims < x.size(-1)) {
    return torch::cat({apply_rope(x.narrow(-1, 0, rotated_dims), cos, sin),
                       x.narrow(-1, rotated_dims, x.size(-1) - rotated_dims)},
                      -1);
  }
  const int64_t half = x.size(-1) / 2;
  auto x1 = x.narrow(-1, 0, half);
  auto x2 = x.narrow(-1, half, half);
  auto rotated = torch::cat({-x2, x1}, -1);
  return x * cos.to(x.dtype()) + rotated * sin.to(x.dtype());
}

// cos/sin tables [T, dims] (dims: rotary_dims(), base `theta`: Note [Rotary variants]) for
// positions [start, start + T), or for the positions `at` (int64 [T]) when defined (context
// parallelism: global positions).
std::pair<Tensor, Tensor> rope_tables(int64_t start, int64_t len, int64_t dims, double theta,
                                      const torch::Device& device, const Tensor& at = {}) {
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  auto inv_freq = torch::pow(theta, -torch::arange(0, dims, 2, opts) / double(dims));
  auto pos = at.defined() ? at.to(opts) : torch::arange(start, start + len, opts);
  auto freqs = torch::outer(pos, inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

// LayerNorm in fp32 (LibTorch 1.13's CPU autocast passes bf16 activations to layer_norm with
// fp32 weights, which it then rejects); a no-op without autocast. Its weight and bias are cast
// up too where they are bf16 (ZeRO-3's bf16 gathers, Note [Fully sharded mixed precision]):
// CPU layer_norm takes no fp32 input with bf16 weights; fp32 ones pass unchanged.
Tensor norm(torch::nn::LayerNorm& ln, const Tensor& x) {
  const auto xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  if (!ln->weight.defined() || ln->weight.scalar_type() == torch::kFloat32) return ln(xf);
  const auto& o = ln->options;
  return torch::layer_norm(xf, o.normalized_shape(), ln->weight.to(torch::kFloat32),
                           ln->bias.defined() ? ln->bias.to(torch::kFloat32) : Tensor(), o.eps());
}

// RMSNorm as Llama computes it: in fp32, x / sqrt(mean(x^2) + eps), times the weight.
Tensor rms_norm(const Tensor& weight, const Tensor& x, double eps) {
  auto xf = x.to(torch::kFloat32);
  return weight * (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps));
}

// Note [Embedding backward without a sync]: CUDA's embedding backward (sort + unique of the
// ids) reads the number of unique ids back to the host: a synchronisation in every step.
// index_select's backward is an index_add_ (atomics, no read-back). On CPU the embedding
// op is kept: its results stay bit-identical to earlier releases.
Tensor embed(torch::nn::Embedding& table, const Tensor& ids) {
  if (ids.device().is_cpu()) return table(ids);
  auto sizes = ids.sizes().vec();
  sizes.push_back(table->weight.size(1));
  return table->weight.index_select(0, ids.reshape({-1})).view(sizes);
}

// Large negative additive value for masked scores: finite so a fully masked row stays finite.
double mask_value(torch::ScalarType dtype) { return dtype == torch::kHalf ? -65504.0 : -1e9; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Options

double parameter_count(const ModelOptions& o) {
  const double h = double(o.hidden), f = double(o.ffn), v = double(o.vocab_size);
  const double norm = o.rms_norm ? h : 2 * h;
  const double bias = o.linear_bias ? 1.0 : 0.0;
  const double ffn_bias = o.linear_bias && o.ffn_bias ? 1.0 : 0.0;
  const double kv = double(key_value_heads(o)) * (h / double(std::max<int64_t>(o.heads, 1)));
  double block = 2 * (h * h + bias * h) + 2 * (h * kv + bias * kv) + 2 * norm;
  block += (o.gated_mlp ? 3 : 2) * h * f + ffn_bias * (f + h) + (o.gated_mlp ? ffn_bias * f : 0);
  if (!o.ffn_in_bias) block -= ffn_bias * f * (o.gated_mlp ? 2 : 1);
  double total = double(o.layers) * block + v * h + norm;
  if (!o.rotary && !o.alibi) total += double(o.max_seq_length) * h;
  total += double(o.type_vocab_size) * h;
  if (o.task == Task::kPretrain) {
    // (the MLM head's transform and bias; a causal LM head has no bias)
    total += (o.tie_embeddings ? 0 : v * h) + (o.arch == Arch::kBert ? v + h * h + h + norm : 0);
  } else {
    total += h * h + h + (h + 1) * double(std::max<int64_t>(o.num_labels, 1));
  }
  return total;
}

double block_linear_weight_count(const ModelOptions& o) {
  const double h = double(o.hidden), f = double(o.ffn);
  const double kv = double(key_value_heads(o)) * (h / double(std::max<int64_t>(o.heads, 1)));
  return 2 * h * h + 2 * h * kv + (o.gated_mlp ? 3 : 2) * h * f;
}

void check_model_shape(const ModelOptions& o, const std::string& where) {
  auto in_range = [&](const char* key, int64_t v, int64_t lo, int64_t hi) {
    DNALLM_CHECK(v >= lo && v <= hi, ExitCode::kUsage,
                 "{}: {} = {} is outside [{}, {}]: the file is damaged or describes a model "
                 "this program does not build",
                 where, key, v, lo, hi);
  };
  in_range("vocab_size", o.vocab_size, 1, kMaxVocab);
  in_range("hidden_size", o.hidden, 1, kMaxHidden);
  in_range("num_attention_heads", o.heads, 1, o.hidden);
  DNALLM_CHECK(o.hidden % o.heads == 0, ExitCode::kUsage,
               "{}: hidden_size {} is not a multiple of num_attention_heads {}", where, o.hidden,
               o.heads);
  in_range("num_key_value_heads", o.kv_heads != 0 ? o.kv_heads : o.heads, 1, o.heads);
  DNALLM_CHECK(o.heads % key_value_heads(o) == 0, ExitCode::kUsage,
               "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", where,
               o.heads, key_value_heads(o));
  in_range("num_hidden_layers", o.layers, 1, kMaxLayers);
  in_range("intermediate_size", o.ffn, 1, kMaxFfn);
  in_range("max_position_embeddings", o.max_seq_length, 1, kMaxPositions);
  if (o.task == Task::kClassification) in_range("num_labels", o.num_labels, 1, kMaxLabels);
  in_range("pad_token_id", o.pad_id, 0, o.vocab_size - 1);
  in_range("type_vocab_size", o.type_vocab_size, 0, kMaxLabels);
  DNALLM_CHECK(!(o.alibi && o.rotary), ExitCode::kUsage,
               "{}: ALiBi and rotary positions together are not a model this program builds",
               where);
  // Note [Rotary variants]
  DNALLM_CHECK(std::isfinite(o.rope_theta) && o.rope_theta > 0, ExitCode::kUsage,
               "{}: rope_theta = {} must be a positive finite number: the file is damaged", where,
               o.rope_theta);
  DNALLM_CHECK(std::isfinite(o.rotary_fraction) && o.rotary_fraction > 0 && o.rotary_fraction <= 1,
               ExitCode::kUsage,
               "{}: a rotary fraction (rotary_pct / partial_rotary_factor) of {} is not supported: "
               "supported is a share of the head in (0, 1]",
               where, o.rotary_fraction);
  if (o.rotary) {
    const int64_t dims = rotary_dims(o);
    DNALLM_CHECK(dims >= 2 && dims % 2 == 0, ExitCode::kUsage,
                 "{}: rotary positions on {} channels of each head (head size {} x rotary fraction "
                 "{}) are not supported: supported is an even number of channels, at least 2",
                 where, dims, o.hidden / o.heads, o.rotary_fraction);
  }
  DNALLM_CHECK(!(o.parallel_residual && o.post_layer_norm), ExitCode::kUsage,
               "{}: a parallel residual (use_parallel_residual) with post-LN blocks is not a model "
               "this program builds",
               where);
  if (o.position_padding_idx >= 0) {
    in_range("position_padding_idx", o.position_padding_idx, 0, o.max_seq_length - 1);
  }
  DNALLM_CHECK(std::isfinite(o.layer_norm_eps) && o.layer_norm_eps > 0 && o.layer_norm_eps < 1,
               ExitCode::kUsage,
               "{}: layer_norm_eps = {} must be a finite number in (0, 1): the file is damaged",
               where, o.layer_norm_eps);
  const double params = parameter_count(o);
  DNALLM_CHECK(params <= kMaxParameters, ExitCode::kUsage,
               "{}: these sizes make {:.3g} parameters, more than the {:.3g} this program builds: "
               "the file is damaged or describes another model",
               where, params, kMaxParameters);
  const double bytes = params * 4;  // loaded as fp32
  const double avail = available_memory_bytes();
  DNALLM_CHECK(avail <= 0 || bytes <= avail, ExitCode::kUsage,
               "{}: the model has {:.3g} parameters, {:.2f} GB as fp32, but only {:.2f} GB of "
               "memory is available here (MemAvailable / cgroup memory.max): use a machine with "
               "more memory or a smaller model",
               where, params, bytes / 1e9, avail / 1e9);
}

ModelOptions model_options_from_config(const Config& config, int64_t vocab_size) {
  const auto& m = config.model;
  ModelOptions o;
  switch (m.arch) {
    case cfg::Arch::kBert:
      o.arch = Arch::kBert;
      break;
    case cfg::Arch::kGpt:
      o.arch = Arch::kGpt;
      break;
  }
  switch (m.task) {
    case cfg::Task::kPretrain:
      o.task = Task::kPretrain;
      break;
    case cfg::Task::kClassification:
      o.task = Task::kClassification;
      break;
    case cfg::Task::kRegression:
      o.task = Task::kRegression;
      break;
  }
  DNALLM_CHECK(m.hidden > 0 && m.heads > 0 && m.hidden % m.heads == 0, ExitCode::kUsage,
               "model.hidden ({}) must be a positive multiple of model.heads ({})", m.hidden,
               m.heads);
  DNALLM_CHECK((m.hidden / m.heads) % 2 == 0 || m.position != cfg::Position::kRotary,
               ExitCode::kUsage,
               "rotary positions need an even head size (model.hidden / model.heads)");
  DNALLM_CHECK(m.layers > 0 && m.ffn > 0 && m.max_seq_length > 1, ExitCode::kUsage,
               "model.layers, model.ffn must be positive and model.max_seq_length > 1");
  DNALLM_CHECK(vocab_size > 0, ExitCode::kUsage, "empty tokenizer vocabulary");
  o.vocab_size = vocab_size;
  o.hidden = m.hidden;
  o.layers = m.layers;
  o.heads = m.heads;
  DNALLM_CHECK(
      m.kv_heads >= 0 && m.kv_heads <= m.heads && (m.kv_heads == 0 || m.heads % m.kv_heads == 0),
      ExitCode::kUsage,
      "model.kv_heads = {} must divide model.heads ({}) (0: as many as model.heads)", m.kv_heads,
      m.heads);
  o.kv_heads = m.kv_heads;
  o.ffn = m.ffn;
  o.max_seq_length = m.max_seq_length;
  switch (m.position) {
    case cfg::Position::kLearned:
      o.rotary = false;
      break;
    case cfg::Position::kRotary:
      o.rotary = true;
      break;
    case cfg::Position::kAlibi:
      o.alibi = true;
      break;
  }
  // DNABERT-2's blocks (configs/dnabert2-*.toml): post-LN with an embedding LayerNorm, and a
  // GEGLU feed-forward whose input projections have no bias.
  o.post_layer_norm = m.post_layer_norm;
  o.embedding_layer_norm = m.post_layer_norm;
  switch (m.mlp) {
    case cfg::Mlp::kGeglu:
      o.gated_mlp = true;
      o.gate_activation = ModelOptions::GateActivation::kGelu;
      o.ffn_in_bias = false;
      break;
    case cfg::Mlp::kGelu:
      break;
  }
  switch (m.attn_implementation) {
    case cfg::AttnImplementation::kAuto:
    case cfg::AttnImplementation::kSdpa:
      o.attn = AttnImpl::kSdpa;
      break;
    case cfg::AttnImplementation::kEager:
      o.attn = AttnImpl::kEager;
      break;
  }
  DNALLM_CHECK(m.dropout >= 0.0 && m.dropout < 1.0, ExitCode::kUsage,
               "model.dropout = {} must be in [0, 1)", m.dropout);
  o.dropout = m.dropout;
  o.gradient_checkpointing = m.gradient_checkpointing;
  o.num_labels = o.task == Task::kRegression ? 1 : m.num_labels;
  DNALLM_CHECK(o.num_labels >= 1, ExitCode::kUsage, "model.num_labels must be >= 1");
  o.mean_pooling = m.pooling == cfg::Pooling::kMean;
  o.lora_r = config.lora.r;
  DNALLM_CHECK(o.lora_r >= 0, ExitCode::kUsage, "lora.r must be >= 0");
  o.lora_alpha = config.lora.alpha;
  o.lora_dropout = config.lora.dropout;
  o.lora_targets = config.lora.target_modules;
  for (const auto& t : o.lora_targets) {
    DNALLM_CHECK(t == "query" || t == "key" || t == "value" || t == "dense", ExitCode::kUsage,
                 "lora.target_modules has \"{}\": use \"query\", \"key\", \"value\", \"dense\"", t);
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// Attention

std::vector<double> alibi_slopes(int64_t heads) {
  DNALLM_CHECK(heads > 0, ExitCode::kFailure, "alibi_slopes: {} heads", heads);
  auto power_of_two = [](int64_t n) {
    // 2^(-2^-(log2 n - 3)) = 2^(-8/n), raised to 1..n, as the reference computes it.
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(double(n)) - 3)));
    std::vector<double> s;
    for (int64_t i = 0; i < n; ++i) s.push_back(start * std::pow(start, double(i)));
    return s;
  };
  if ((heads & (heads - 1)) == 0) return power_of_two(heads);
  int64_t below = 1;
  while (below * 2 < heads) below *= 2;
  auto slopes = power_of_two(below);
  const auto twice = power_of_two(2 * below);
  for (size_t i = 0; i < twice.size() && int64_t(slopes.size()) < heads; i += 2) {
    slopes.push_back(twice[i]);
  }
  return slopes;
}

Tensor alibi_bias(int64_t heads, int64_t q_start, int64_t tq, int64_t tk,
                  const torch::Device& device) {
  const auto slopes64 = alibi_slopes(heads);
  std::vector<float> slopes(slopes64.begin(), slopes64.end());
  auto ints = torch::TensorOptions().dtype(torch::kInt64).device(device);
  auto distance = (torch::arange(0, tk, ints).unsqueeze(0) -
                   torch::arange(q_start, q_start + tq, ints).unsqueeze(1))
                      .abs();
  auto s = torch::tensor(slopes, torch::kFloat32).to(device).view({heads, 1, 1});
  return (s * distance.neg()).unsqueeze(0);  // fp32 [1, H, tq, tk]
}

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
  Tensor q, k, v;
  const bool plain_qkv = !query->has_lora() && !key->has_lora() && !value->has_lora() &&
                         !query->quantized() && !key->quantized() && !value->quantized();
  if (plain_qkv && !positions.defined()) {
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
  } else if (!q.defined()) {
    q = query(h).view({b, t, nh, hd}).transpose(1, 2);
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
    // Note [Grouped-query attention]: query head i attends with key/value head i / (nh / nkv)
    // (transformers' repeat_kv): each shared head is repeated after the cache, which keeps
    // nkv heads. Exact for every attention kernel and mask.
    auto repeat = [&](const Tensor& x) {
      const int64_t n = x.size(2);
      return x.unsqueeze(2).expand({b, nkv, nh / nkv, n, hd}).reshape({b, nh, n, hd});
    };
    k = repeat(k);
    v = repeat(v);
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
  Tensor inner;
  if (!ffn_gate) {
    inner = torch::gelu(ffn_in(hf));
  } else {
    Tensor gate, up;
    const bool plain_ffn = !ffn_gate->has_lora() && !ffn_in->has_lora() && !ffn_gate->quantized() &&
                           !ffn_in->quantized();
    if (plain_ffn) {
      // One GEMM for the gate and up projections (as for Q, K and V above; DNABERT-2 stores
      // them fused, gated_layers), the weights separate parameters.
      auto w = torch::cat({ffn_gate->weight, ffn_in->weight}, 0);
      auto bgu =
          ffn_gate->bias.defined() ? torch::cat({ffn_gate->bias, ffn_in->bias}, 0) : Tensor();
      auto gu = torch::linear(hf, w, bgu).chunk(2, -1);
      gate = gu[0];
      up = gu[1];
    } else {
      gate = ffn_gate(hf);
      up = ffn_in(hf);
    }
    // Exact (erf) GELU as DNABERT-2's GLU, or SiLU (Llama).
    inner = options_.gate_activation == ModelOptions::GateActivation::kGelu
                ? torch::gelu(gate) * up
                : torch::silu(gate) * up;
  }
  auto f = ffn_out(inner);
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

// ---------------------------------------------------------------------------------------------
// Model

TransformerLMImpl::TransformerLMImpl(ModelOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  auto root = holder(*this, root_name());
  auto emb = holder(*root, "embeddings");
  word_embeddings =
      emb->register_module("word_embeddings", torch::nn::Embedding(o.vocab_size, o.hidden));
  if (!o.rotary && !o.alibi) {
    position_embeddings = emb->register_module("position_embeddings",
                                               torch::nn::Embedding(o.max_seq_length, o.hidden));
  }
  if (o.type_vocab_size > 0) {
    token_type_ = holder(*emb, "token_type_embeddings")
                      ->register_parameter("weight", torch::zeros({o.type_vocab_size, o.hidden}));
  }
  if (o.embedding_layer_norm) {
    embedding_norm = emb->register_module(
        "LayerNorm",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden}).eps(o.layer_norm_eps)));
  }
  auto encoder = holder(*root, "encoder");
  auto layer = holder(*encoder, "layer");
  for (int64_t i = 0; i < o.layers; ++i) {
    blocks_.push_back(layer->register_module(std::to_string(i), Block(o)));
    // Note [Streamed build]
    block_built(size_t(i), root_name() + ".encoder.layer." + std::to_string(i) + ".",
                *blocks_.back());
  }
  if (o.rms_norm) {
    rms_final_ =
        holder(*encoder, "final_layer_norm")->register_parameter("weight", torch::ones({o.hidden}));
  } else if (!o.post_layer_norm) {
    final_norm = encoder->register_module(
        "final_layer_norm",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden}).eps(o.layer_norm_eps)));
  }

  if (o.task == Task::kPretrain) {
    if (o.arch == Arch::kBert) {
      auto cls = holder(*this, "cls");
      auto pred = holder(*cls, "predictions");
      auto transform = holder(*pred, "transform");
      mlm_dense = transform->register_module("dense", LoraLinear(o.hidden, o.hidden));
      mlm_norm = transform->register_module(
          "LayerNorm",
          torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden}).eps(o.layer_norm_eps)));
      lm_bias_ = pred->register_parameter("bias", torch::zeros({o.vocab_size}));
      if (!o.tie_embeddings) {
        auto decoder = holder(*pred, "decoder");
        lm_weight_ = decoder->register_parameter("weight", torch::empty({o.vocab_size, o.hidden}));
      }
    } else if (!o.tie_embeddings) {
      auto head = holder(*this, "lm_head");
      lm_weight_ = head->register_parameter("weight", torch::empty({o.vocab_size, o.hidden}));
    }
  } else {
    pooler = holder(*root, "pooler")->register_module("dense", LoraLinear(o.hidden, o.hidden));
    classifier = register_module("classifier", LoraLinear(o.hidden, o.num_labels));
  }

  torch::NoGradGuard no_grad;
  word_embeddings->weight.normal_(0.0, 0.02);
  if (position_embeddings) position_embeddings->weight.normal_(0.0, 0.02);
  if (lm_weight_.defined()) lm_weight_.normal_(0.0, 0.02);
  update_spec();
  if (o.lora_r > 0) enable_lora();
}

void TransformerLMImpl::update_spec() {
  const auto& o = options_;
  spec_.family = "transformer";
  spec_.arch = o.arch;
  spec_.task = o.task;
  spec_.vocab_size = o.vocab_size;
  spec_.hidden_size = o.hidden;
  spec_.max_seq_length = o.max_seq_length;
  spec_.extends_past_max_length = o.rotary || o.alibi;
  spec_.num_labels = o.num_labels;
  spec_.pad_id = o.pad_id;
  spec_.shift_labels = o.shift_labels && !context_view_;  // the data path shifts under CP
  spec_.context_layout = o.arch == Arch::kGpt ? ContextLayout::kZigZag : ContextLayout::kContiguous;
  spec_.lora_r = o.lora_r;
  spec_.lora_alpha = o.lora_alpha;
  spec_.reserved_positions = o.position_padding_idx >= 0 ? o.position_padding_idx + 1 : 0;
}

// The trainer's context mesh (Note [Data x context mesh]) hands over one ContextParallel and
// updates its length and positions in place per batch; the attention context is built from it
// when the length changes (refresh_context, in encode: a collective over the group, which every
// rank of it reaches with the same length), or at once where positions are already given.
void TransformerLMImpl::set_context_parallel(std::shared_ptr<ContextParallel> cp) {
  context_view_ = cp != nullptr && cp->group != nullptr ? cp : nullptr;
  context_.reset();
  context_length_ = -1;
  if (context_view_) {
    parallel::refuse_context_parallel_regression(options_.task == Task::kRegression,
                                                 context_view_->group->world_size());
  }
  if (context_view_ && !context_view_->positions.defined()) {
    for (auto& block : blocks_) block->context = nullptr;
    update_spec();
    return;
  }
  build_context(context_view_);
}

void TransformerLMImpl::refresh_context() {
  if (context_view_ && context_length_ != context_view_->full_length) build_context(context_view_);
}

void TransformerLMImpl::build_context(const std::shared_ptr<ContextParallel>& cp) {
  const auto& o = options_;
  std::shared_ptr<AttentionContext> context;
  if (cp != nullptr && cp->group != nullptr) {
    context_length_ = cp->full_length;
    auto& group = *cp->group;
    const int world = group.world_size();
    DNALLM_CHECK(o.position_padding_idx < 0, ExitCode::kUsage,
                 "parallel.context_parallel = {}: RoBERTa-numbered positions count the real "
                 "tokens before each one, which a context shard does not see; set "
                 "parallel.context_parallel = 1 for this model",
                 world);
    const auto positions =
        cp->positions.defined() ? cp->positions.to(torch::kCPU, torch::kLong) : torch::Tensor();
    DNALLM_CHECK(
        positions.defined() && positions.dim() == 1 && cp->full_length % world == 0 &&
            positions.numel() == cp->full_length / world && positions.min().item<int64_t>() >= 0 &&
            positions.max().item<int64_t>() < cp->full_length,
        ExitCode::kUsage, "context parallelism: rank {} needs {} / {} positions of [0, {}), got {}",
        group.rank(), cp->full_length, world, cp->full_length,
        positions.defined() ? positions.numel() : 0);
    DNALLM_CHECK(cp->full_length <= o.max_seq_length || o.rotary || o.alibi, ExitCode::kBadData,
                 "sequence of {} tokens exceeds model.max_seq_length = {}", cp->full_length,
                 o.max_seq_length);
    context = std::make_shared<AttentionContext>();
    context->group = &group;
    context->query_positions.assign(positions.data_ptr<int64_t>(),
                                    positions.data_ptr<int64_t>() + positions.numel());
    const auto keys = gather_context_rows(positions.view({1, -1}), group).reshape({-1});
    context->key_positions.assign(keys.data_ptr<int64_t>(),
                                  keys.data_ptr<int64_t>() + keys.numel());
    context->causal = o.arch == Arch::kGpt;
    if (o.alibi) context->alibi_slopes = alibi_slopes(o.heads);
    context_positions_ = positions;
  } else {
    context_positions_ = torch::Tensor();
  }
  context_ = context;
  for (auto& block : blocks_) block->context = context;
  update_spec();
}

std::vector<std::shared_ptr<torch::nn::Module>> TransformerLMImpl::blocks() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& block : blocks_) out.push_back(block.ptr());
  return out;
}

void TransformerLMImpl::set_activation_checkpointing(bool on) {
  options_.gradient_checkpointing = on;
}

double TransformerLMImpl::flops_per_token(int64_t seq_len) const {
  return parameter_flops_per_token(*this) +
         12.0 * double(options_.layers) * double(options_.hidden) * double(seq_len);
}

nlohmann::ordered_json TransformerLMImpl::export_config() const {
  return models::export_config(options_);
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

void TransformerLMImpl::enable_lora(int64_t r) {
  if (r > 0) options_.lora_r = r;
  update_spec();
  for (auto& p : parameters()) p.set_requires_grad(false);
  for (auto& block : blocks_) enable_block_lora(*block, options_);
  // Task heads are new for a fine-tune: they train in full (PEFT's modules_to_save).
  if (pooler) {
    for (auto& p : pooler->parameters()) p.set_requires_grad(true);
    for (auto& p : classifier->parameters()) p.set_requires_grad(true);
  }
}

void TransformerLMImpl::merge_lora() {
  for (auto& block : blocks_) {
    for (auto* lin : {&block->query, &block->key, &block->value, &block->attn_out, &block->ffn_in,
                      &block->ffn_out}) {
      (*lin)->merge_lora();
    }
  }
}

Tensor TransformerLMImpl::encode(const ForwardInputs& in, std::vector<LayerCache>* cache,
                                 int64_t past_len) {
  const auto& o = options_;
  refresh_context();
  const auto& ids = in.input_ids;
  DNALLM_CHECK(ids.dim() == 2, ExitCode::kFailure, "input_ids must be [batch, seq]");
  const int64_t b = ids.size(0), t = ids.size(1);
  DNALLM_CHECK(past_len + t <= o.max_seq_length || o.rotary || o.alibi, ExitCode::kBadData,
               "sequence of {} tokens exceeds model.max_seq_length = {}", past_len + t,
               o.max_seq_length);
  auto device = ids.device();
  auto x = embed(word_embeddings, ids);
  if (position_embeddings && o.position_padding_idx >= 0) {
    DNALLM_CHECK(past_len == 0, ExitCode::kFailure, "RoBERTa positions are not cached");
    auto real = ids.ne(o.position_padding_idx).to(torch::kInt64);
    x = x + embed(position_embeddings, real.cumsum(1) * real + o.position_padding_idx);
  } else if (position_embeddings) {
    auto pos = context_ ? context_positions_.to(device)
                        : torch::arange(past_len, past_len + t, ids.options());
    x = x + embed(position_embeddings, pos).unsqueeze(0);
  }
  if (token_type_.defined()) x = x + token_type_[0];  // every token is of type 0
  if (o.mask_embeddings && in.attention_mask.defined() && in.attention_mask.size(1) == t) {
    x = x * in.attention_mask.unsqueeze(-1).to(x.dtype());
  }
  if (embedding_norm) x = norm(embedding_norm, x);
  const double p = is_training() ? o.dropout : 0.0;
  if (p > 0) x = torch::dropout(x, p, true);

  if (context_) {
    DNALLM_CHECK(cache == nullptr && past_len == 0 && t == context_positions_.numel(),
                 ExitCode::kUsage,
                 "context parallelism: the model holds {} positions a sequence on this rank, the "
                 "batch {} (and no key/value cache)",
                 context_positions_.numel(), t);
  }
  Tensor cos, sin;
  if (o.rotary) {
    std::tie(cos, sin) = rope_tables(past_len, t, rotary_dims(o), o.rope_theta, device,
                                     context_ ? context_positions_ : Tensor());
  }

  // Note [Attention context parallelism]: the blocks build their masks per key block from the
  // gathered padding mask and segments; none is built here.
  const ForwardInputs no_masks;
  const ForwardInputs& masked = context_ ? no_masks : in;
  if (context_) {
    auto& group = *context_->group;
    context_->key_ok =
        in.attention_mask.defined()
            ? gather_context_rows(in.attention_mask.to(torch::kInt64), group).to(torch::kBool)
            : Tensor();
    context_->query_segments = in.segment_ids;
    context_->key_segments = in.segment_ids.defined()
                                 ? gather_context_rows(in.segment_ids.to(torch::kInt64), group)
                                 : Tensor();
  }
  // Build the additive mask (Note [Attention masks]).
  const bool causal = o.arch == Arch::kGpt;
  const int64_t tk = past_len + t;
  Tensor allowed;  // bool, broadcastable to [B, 1, T, Tk]
  bool padded_batch = false;
  if (masked.attention_mask.defined()) {
    auto key_ok = masked.attention_mask.to(torch::kBool);
    if (key_ok.size(1) == t && past_len > 0) {
      key_ok = torch::cat({torch::ones({b, past_len}, key_ok.options()), key_ok}, 1);
    }
    // See Note [Host-known batch facts]: the host says whether anything is padded.
    const bool any_padding =
        masked.padded.has_value() && past_len == 0 ? *masked.padded : !key_ok.all().item<bool>();
    if (any_padding) allowed = key_ok.view({b, 1, 1, tk});
    padded_batch = any_padding;
  }
  if (masked.segment_ids.defined()) {
    DNALLM_CHECK(past_len == 0, ExitCode::kFailure, "packed segments are not cached");
    auto seg = masked.segment_ids;
    auto same = seg.unsqueeze(2).eq(seg.unsqueeze(1)).unsqueeze(1);  // [B, 1, T, T]
    allowed = allowed.defined() ? allowed.logical_and(same) : same;
  }
  if (causal && !context_ && (allowed.defined() || (past_len > 0 && t > 1) || o.alibi)) {
    auto tri = torch::ones({t, tk}, torch::TensorOptions().dtype(torch::kBool).device(device))
                   .tril(past_len);
    allowed = allowed.defined() ? allowed.logical_and(tri) : tri.view({1, 1, t, tk});
  }
  Tensor bias;
  if (allowed.defined()) {
    bias = torch::zeros(allowed.sizes(), x.options().dtype(torch::kFloat32))
               .masked_fill(allowed.logical_not(), mask_value(torch::kFloat32));
  }
  if (o.alibi && !context_) {  // Note [ALiBi]: added to the padding/causal mask, as DNABERT-2 does
    auto alibi = alibi_bias(o.heads, past_len, t, tk, device);
    bias = bias.defined() ? bias + alibi : alibi;
  }
  // A single cached decode step (t == 1) attends to everything before it: no mask needed.
  const bool kernel_causal = causal && !bias.defined() && !(past_len > 0 && t == 1);
  // Note [Padding-free feed-forward]: DNABERT-2's reference runs its feed-forward on the real
  // tokens only; so do ALiBi models here, on the CPU (finding the rows reads the mask back,
  // a synchronisation on a GPU). The padding rows' outputs are not part of the function:
  // they are keys masked out of every attention and positions no loss or pooling reads.
  Tensor ffn_rows;
  if (o.alibi && padded_batch && device.is_cpu() && cache == nullptr && past_len == 0 &&
      in.attention_mask.size(1) == t) {
    ffn_rows = in.attention_mask.reshape({-1}).nonzero().squeeze(1);
  }

  for (size_t i = 0; i < blocks_.size(); ++i) {
    LayerCache* layer_cache = cache != nullptr ? &(*cache)[i] : nullptr;
    // Note [Block hooks]: block i's parameters are used inside this call only.
    x = run_block(hooks_.get(), i, [&] {
      if (i + 1 == blocks_.size() && in.scored_positions.defined()) {
        return blocks_[i]->forward_selected(x, bias, cos, sin, in.scored_positions);
      }
      if (o.gradient_checkpointing && is_training() && torch::GradMode::is_enabled() &&
          layer_cache == nullptr) {
        return checkpointed_block(blocks_[i], x, bias, kernel_causal, cos, sin);
      }
      return blocks_[i]->forward(x, bias, kernel_causal, layer_cache, cos, sin, ffn_rows);
    });
  }
  if (rms_final_.defined()) return rms_norm(rms_final_, x, o.layer_norm_eps);
  return final_norm ? norm(final_norm, x) : x;
}

Tensor TransformerLMImpl::lm_logits(const Tensor& hidden) {
  const auto& weight = lm_weight_.defined() ? lm_weight_ : word_embeddings->weight;
  if (options_.arch == Arch::kBert) {
    auto h = norm(mlm_norm, torch::gelu(mlm_dense(hidden)));
    return torch::linear(h, weight, lm_bias_);
  }
  return torch::linear(hidden, weight);
}

ModelOutput TransformerLMImpl::forward(const ForwardInputs& in) {
  const auto& o = options_;
  refresh_context();  // before the scored-positions choice below, which context parallelism skips
  ModelOutput out;
  // See Note [Scored positions only]: a masked LM that only needs the scored positions runs
  // the last block for those queries alone (exact; ~85% of the last block's work is skipped
  // at 15% masking).
  Tensor selected_valid, selected_labels;
  Tensor hidden;
  const bool mlm_selected = o.task == Task::kPretrain && o.arch == Arch::kBert && !context_ &&
                            in.logits_for_labels_only && in.labels.defined() &&
                            !in.segment_ids.defined() && in.labels.dim() == 2;
  if (mlm_selected && in.mlm_positions.defined() && in.mlm_selected.defined()) {
    // The same selection as below, with the positions and picks computed on the host (Note
    // [Host-known batch facts]): index_select of the row-major picks equals the boolean index.
    ForwardInputs sub = in;
    sub.scored_positions = in.mlm_positions;
    auto h = encode(sub);  // [B, M, hidden]
    hidden = h.reshape({-1, o.hidden}).index_select(0, in.mlm_selected);
    selected_labels =
        in.labels.gather(1, in.mlm_positions).reshape({-1}).index_select(0, in.mlm_selected);
    selected_valid = in.mlm_selected;
  } else if (mlm_selected) {
    auto scored = in.labels.ne(-100);
    const int64_t t = in.labels.size(1);
    auto ar = torch::arange(t, in.labels.options());
    // Scored positions first (ascending), then the others: the first count[b] are the picks.
    auto order = torch::where(scored, ar, ar + t).argsort(int64_t{1});
    const int64_t m = std::max<int64_t>(1, scored.sum(1).max().item<int64_t>());
    auto positions = order.narrow(1, 0, m).contiguous();
    selected_valid = ar.narrow(0, 0, m).unsqueeze(0) < scored.sum(1, true);
    selected_labels = in.labels.gather(1, positions);
    ForwardInputs sub = in;
    sub.scored_positions = positions;
    auto h = encode(sub);  // [B, M, hidden]
    hidden = h.index({selected_valid});
    selected_labels = selected_labels.index({selected_valid});
  } else {
    hidden = encode(in);
  }
  if (o.task == Task::kPretrain) {
    Tensor labels = selected_valid.defined() ? selected_labels : in.labels;
    if (labels.defined() && o.arch == Arch::kGpt && spec_.shift_labels) {
      // Position i predicts token i + 1; the last position has no target.
      hidden = hidden.narrow(1, 0, hidden.size(1) - 1);
      labels = labels.narrow(1, 1, labels.size(1) - 1);
    }
    if (labels.defined()) {
      auto flat_labels = labels.reshape({-1});
      auto flat_hidden = hidden.reshape({-1, o.hidden});
      if (!selected_valid.defined() && in.logits_for_labels_only) {
        auto idx =
            in.label_index.defined() ? in.label_index : flat_labels.ne(-100).nonzero().squeeze(1);
        flat_hidden = flat_hidden.index_select(0, idx);
        flat_labels = flat_labels.index_select(0, idx);
      }
      auto logits = lm_logits(flat_hidden);
      out.loss_sum = torch::nn::functional::cross_entropy(
          logits.to(torch::kFloat32), flat_labels,
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(
              torch::kSum));
      out.loss_count =
          in.label_count >= 0 ? in.label_count : flat_labels.ne(-100).sum().item<int64_t>();
      out.logits =
          in.logits_for_labels_only ? logits : logits.view({hidden.size(0), hidden.size(1), -1});
    } else {
      out.logits = lm_logits(hidden);
    }
    return out;
  }
  Tensor pooled;
  if (context_) {
    // Note [Context-parallel pooling]: the masked mean, or [CLS] (global position 0, on context
    // rank 0 in both layouts), summed over the group.
    auto& group = *context_->group;
    pooled = o.mean_pooling ? parallel::context_mean_pool(hidden, in.attention_mask, group)
                            : parallel::context_token_pool(
                                  hidden, context_positions_,
                                  torch::zeros({hidden.size(0)}, in.input_ids.options()), group);
  } else if (o.mean_pooling) {
    auto mask = in.attention_mask.defined()
                    ? in.attention_mask.to(hidden.dtype()).unsqueeze(-1)
                    : torch::ones({hidden.size(0), hidden.size(1), 1}, hidden.options());
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0);
  } else {
    pooled = hidden.select(1, 0);
  }
  pooled = torch::tanh(pooler(pooled));
  if (is_training() && o.dropout > 0) pooled = torch::dropout(pooled, o.dropout, true);
  auto logits = classifier(pooled);
  if (o.task == Task::kRegression) {
    out.logits = logits.squeeze(-1);
    if (in.targets.defined()) {
      out.loss_sum = (out.logits.to(torch::kFloat32) - in.targets.to(torch::kFloat32)).pow(2).sum();
      out.loss_count = in.targets.numel();
    }
  } else {
    out.logits = logits;
    if (in.labels.defined()) {
      out.loss_sum = torch::nn::functional::cross_entropy(
          logits.to(torch::kFloat32), in.labels,
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(
              torch::kSum));
      out.loss_count =
          in.label_count >= 0 ? in.label_count : in.labels.ne(-100).sum().item<int64_t>();
    }
  }
  return out;
}

Tensor TransformerLMImpl::generate(const Tensor& prompt, const GenerateOptions& g) {
  DNALLM_CHECK(options_.arch == Arch::kGpt && options_.task == Task::kPretrain, ExitCode::kUsage,
               "generation needs a causal LM (model.arch = \"gpt\", task = \"pretrain\")");
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(g.seed);
  Tensor suppress;
  if (!g.suppress_ids.empty()) {
    for (int64_t id : g.suppress_ids) {
      DNALLM_CHECK(id >= 0 && id < options_.vocab_size, ExitCode::kFailure,
                   "generate: suppressed token id {} is outside the vocabulary ({})", id,
                   options_.vocab_size);
    }
    DNALLM_CHECK(static_cast<int64_t>(g.suppress_ids.size()) < options_.vocab_size,
                 ExitCode::kUsage, "generate: every token of the vocabulary is suppressed");
    suppress = torch::tensor(g.suppress_ids, torch::kInt64);
  }
  auto tokens = prompt;
  std::vector<LayerCache> cache(blocks_.size());
  Tensor next_input = prompt;
  int64_t past = 0;
  for (int64_t step = 0; step < g.max_new_tokens; ++step) {
    Tensor hidden;
    ForwardInputs in;
    if (g.use_cache) {
      in.input_ids = next_input;
      hidden = encode(in, &cache, past);
      past += next_input.size(1);
    } else {
      in.input_ids = tokens;
      hidden = encode(in);
    }
    auto logits = lm_logits(hidden.select(1, hidden.size(1) - 1)).to(torch::kFloat32).cpu();
    if (suppress.defined())
      logits.index_fill_(-1, suppress, -std::numeric_limits<float>::infinity());
    Tensor next = sample_next_token(logits, g, gen).to(tokens.device());
    tokens = torch::cat({tokens, next}, 1);
    next_input = next;
  }
  return tokens;
}

std::vector<std::pair<std::string, Tensor>> TransformerLMImpl::named_weights() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& item : named_parameters()) {
    const auto& name = item.key();
    if (name.size() > 7 &&
        (name.rfind(".lora_A") == name.size() - 7 || name.rfind(".lora_B") == name.size() - 7)) {
      continue;
    }
    out.emplace_back(name, item.value());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// safetensors: the format is checkpoint/safetensors.hpp's; here only tensors meet it.

checkpoint::SafetensorsTensor safetensors_tensor(const std::string& name, const Tensor& t) {
  auto c = t.detach().to(torch::kCPU).contiguous();
  const auto dtype = dtype_of(c.scalar_type());
  DNALLM_CHECK(dtype.has_value(), ExitCode::kFailure, "safetensors: unsupported dtype {} of {}",
               c10::toString(c.scalar_type()), name);
  checkpoint::SafetensorsTensor out{name, *dtype, c.sizes().vec(), nullptr};
  out.write_data = [c](const checkpoint::ByteSink& sink) {  // little-endian host (x86-64, aarch64)
    sink(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  };
  return out;
}

std::vector<checkpoint::SafetensorsTensor> safetensors_tensors(
    const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<checkpoint::SafetensorsTensor> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) out.push_back(safetensors_tensor(name, t));
  return out;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  checkpoint::write_safetensors(path, safetensors_tensors(tensors), metadata);
}

std::map<std::string, Tensor> load_safetensors(const std::string& path) {
  checkpoint::SafetensorsReader reader(path);  // the header checked (Note [Untrusted files])
  std::map<std::string, Tensor> out;
  for (const auto& [name, entry] : reader.file().tensors) {
    auto t =
        torch::empty(entry.spec.shape, torch::TensorOptions().dtype(torch_dtype(entry.spec.dtype)));
    reader.read(entry, t.data_ptr());
    // A weight that is NaN or infinite makes every output NaN: a damaged file.
    DNALLM_CHECK(!t.is_floating_point() || t.numel() == 0 || torch::isfinite(t).all().item<bool>(),
                 ExitCode::kCheckpointCorrupt,
                 "{}: tensor {} holds NaN or infinite values: the file is damaged; re-export or "
                 "re-download it",
                 path, clip_for_message(name));
    out.emplace(name, t);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Export / load

std::map<std::string, std::shared_ptr<LoraLinearImpl>> lora_or_quantized_linears(
    torch::nn::Module& model) {
  std::map<std::string, std::shared_ptr<LoraLinearImpl>> out;
  for (const auto& item : model.named_modules()) {
    auto lin = std::dynamic_pointer_cast<LoraLinearImpl>(item.value());
    if (lin == nullptr || (!lin->has_lora() && !lin->quantized())) continue;
    out[item.key() + ".weight"] = lin;
  }
  return out;
}

Tensor full_linear_weight(const LoraLinearImpl& linear, bool merge_adapters) {
  torch::NoGradGuard no_grad;
  auto w = linear.full_weight();
  if (merge_adapters && linear.has_lora()) {
    auto params = linear.named_parameters(false);
    w = w + torch::matmul(params["lora_B"], params["lora_A"]) * linear.lora_scaling();
  }
  return w.detach();
}

nlohmann::ordered_json export_config(const ModelOptions& o) {
  nlohmann::ordered_json c;
  c["architectures"] = {
      o.arch == Arch::kBert
          ? (o.task == Task::kPretrain ? "BertForMaskedLM" : "BertForSequenceClassification")
          : "DnallmGptForCausalLM"};
  c["model_type"] = o.arch == Arch::kBert ? "bert" : "dnallm-gpt";
  c["dnallm_arch"] = arch_name(o.arch);
  c["task"] = task_name(o.task);
  c["vocab_size"] = o.vocab_size;
  c["hidden_size"] = o.hidden;
  c["num_hidden_layers"] = o.layers;
  c["num_attention_heads"] = o.heads;
  if (key_value_heads(o) != o.heads) c["num_key_value_heads"] = key_value_heads(o);
  c["intermediate_size"] = o.ffn;
  c["max_position_embeddings"] = o.max_seq_length;
  c["position_embedding_type"] = o.rotary ? "rotary" : o.alibi ? "alibi" : "absolute";
  // Note [Rotary variants], Note [Parallel residual]: written when not the defaults, so that
  // the config.json of every other model stays as it was.
  if (o.rope_theta != ModelOptions().rope_theta) c["rope_theta"] = o.rope_theta;
  if (o.rotary_fraction != ModelOptions().rotary_fraction) {
    c["rotary_fraction"] = o.rotary_fraction;
  }
  if (o.parallel_residual) c["parallel_residual"] = true;
  c["hidden_act"] = "gelu";
  c["layer_norm_eps"] = o.layer_norm_eps;
  c["pre_layer_norm"] = !o.post_layer_norm;
  if (o.embedding_layer_norm) c["embedding_layer_norm"] = true;
  if (o.mask_embeddings) c["mask_embeddings"] = true;
  if (o.position_padding_idx >= 0) c["position_padding_idx"] = o.position_padding_idx;
  if (o.rms_norm) c["rms_norm"] = true;
  if (o.gated_mlp) c["gated_mlp"] = true;
  if (!o.linear_bias) c["linear_bias"] = false;
  if (o.gate_activation == ModelOptions::GateActivation::kGelu) c["gate_activation"] = "gelu";
  if (!o.ffn_in_bias) c["ffn_in_bias"] = false;
  if (!o.ffn_bias) c["ffn_bias"] = false;
  c["tie_word_embeddings"] = o.tie_embeddings;
  c["num_labels"] = o.num_labels;
  c["pooling"] = o.mean_pooling ? "mean" : "cls";
  c["pad_token_id"] = o.pad_id;
  c["type_vocab_size"] = o.type_vocab_size;
  c["shift_labels"] = o.shift_labels;
  return c;
}

TransformerLM load_exported_transformer(const std::string& dir, const nlohmann::json& c) {
  const std::string config_path = dir + "/config.json";
  ModelOptions o;
  auto integer = [&](const char* key) {
    DNALLM_CHECK(c.contains(key) && c[key].is_number_integer(), ExitCode::kUsage,
                 "{}: \"{}\" is missing or not an integer", config_path, key);
    DNALLM_CHECK(!c[key].is_number_unsigned() ||
                     c[key].get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
                 ExitCode::kUsage, "{}: \"{}\" = {} is too large", config_path, key, c[key].dump());
    return c[key].get<int64_t>();
  };
  try {
    const auto type = c.at("model_type").get<std::string>();
    DNALLM_CHECK(type == "bert" || type == "dnallm-gpt", ExitCode::kUsage,
                 "{}: model_type \"{}\" is not a transformer of ours (\"bert\" or \"dnallm-gpt\")",
                 config_path, clip_for_message(type));
    o.arch = type == "bert" ? Arch::kBert : Arch::kGpt;
    o.task = task_from_name(c.value("task", std::string("pretrain")), config_path);
    o.vocab_size = integer("vocab_size");
    o.hidden = integer("hidden_size");
    o.layers = integer("num_hidden_layers");
    o.heads = integer("num_attention_heads");
    if (c.contains("num_key_value_heads")) o.kv_heads = integer("num_key_value_heads");
    o.ffn = integer("intermediate_size");
    o.max_seq_length = integer("max_position_embeddings");
    const auto position = c.value("position_embedding_type", std::string("absolute"));
    DNALLM_CHECK(position == "absolute" || position == "rotary" || position == "alibi",
                 ExitCode::kUsage,
                 "{}: position_embedding_type \"{}\" is not supported (\"absolute\", \"rotary\" "
                 "or \"alibi\")",
                 config_path, clip_for_message(position));
    o.rotary = position == "rotary";
    o.alibi = position == "alibi";
    o.rope_theta = c.value("rope_theta", ModelOptions().rope_theta);
    o.rotary_fraction = c.value("rotary_fraction", ModelOptions().rotary_fraction);
    o.parallel_residual = c.value("parallel_residual", false);
    o.type_vocab_size = c.value("type_vocab_size", int64_t{0});
    o.layer_norm_eps = c.value("layer_norm_eps", 1e-12);
    o.tie_embeddings = c.value("tie_word_embeddings", true);
    o.num_labels = c.value("num_labels", int64_t{2});
    const auto pooling = c.value("pooling", std::string("cls"));
    DNALLM_CHECK(pooling == "cls" || pooling == "mean", ExitCode::kUsage,
                 "{}: pooling \"{}\" is not supported (\"cls\" or \"mean\")", config_path,
                 clip_for_message(pooling));
    o.mean_pooling = pooling == "mean";
    o.pad_id = c.value("pad_token_id", int64_t{0});
    o.shift_labels = c.value("shift_labels", true);
    o.post_layer_norm = !c.value("pre_layer_norm", true);
    o.embedding_layer_norm = c.value("embedding_layer_norm", false);
    o.mask_embeddings = c.value("mask_embeddings", false);
    o.position_padding_idx = c.value("position_padding_idx", int64_t{-1});
    o.rms_norm = c.value("rms_norm", false);
    o.gated_mlp = c.value("gated_mlp", false);
    o.linear_bias = c.value("linear_bias", true);
    const auto gate = c.value("gate_activation", std::string("silu"));
    DNALLM_CHECK(gate == "silu" || gate == "gelu", ExitCode::kUsage,
                 "{}: gate_activation \"{}\" is not supported (\"silu\" or \"gelu\")", config_path,
                 clip_for_message(gate));
    o.gate_activation =
        gate == "gelu" ? ModelOptions::GateActivation::kGelu : ModelOptions::GateActivation::kSilu;
    o.ffn_in_bias = c.value("ffn_in_bias", true);
    o.ffn_bias = c.value("ffn_bias", true);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(ExitCode::kBadData, "{}: missing or bad field: {}", config_path,
         clip_for_message(e.what(), 200));
  }
  o.lora_r = 0;
  check_model_shape(o, config_path);
  TransformerLM model(o);
  auto weights = load_safetensors(dir + "/model.safetensors");
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_weights()) {
    auto it = weights.find(name);
    DNALLM_CHECK(it != weights.end(), ExitCode::kBadData, "{}/model.safetensors lacks tensor {}",
                 dir, name);
    DNALLM_CHECK(it->second.sizes() == p.sizes(), ExitCode::kBadData,
                 "{}/model.safetensors: {} has shape {} but config.json implies {}", dir, name,
                 fmt::format("{}", fmt::join(it->second.sizes(), "x")),
                 fmt::format("{}", fmt::join(p.sizes(), "x")));
    p.copy_(it->second);
  }
  model->eval();
  return model;
}

}  // namespace dnallm::models
