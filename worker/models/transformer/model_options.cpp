#include "worker/models/transformer/model_options.hpp"

#include <algorithm>
#include <cmath>

#include "core/enum_names.hpp"
#include "core/error.hpp"
#include "core/host_memory.hpp"

namespace dnallm::models {
namespace {

// model.task and a model's Task, read both ways (task_of, config_task). See Note [Enum tables]
// (core/enum_names.hpp).
constexpr EnumName<cfg::Task, Task> kTasks[] = {{cfg::Task::kPretrain, Task::kPretrain},
                                                {cfg::Task::kClassification, Task::kClassification},
                                                {cfg::Task::kRegression, Task::kRegression}};
static_assert(lists_each_in_order<cfg::Task::kRegression>(kTasks));
static_assert(names_each_in_order<Task::kRegression>(kTasks));
// "auto" attention is sdpa.
constexpr EnumName<cfg::AttnImplementation, AttnImpl> kAttnImpls[] = {
    {cfg::AttnImplementation::kAuto, AttnImpl::kSdpa},
    {cfg::AttnImplementation::kSdpa, AttnImpl::kSdpa},
    {cfg::AttnImplementation::kEager, AttnImpl::kEager}};
static_assert(lists_each_in_order<cfg::AttnImplementation::kEager>(kAttnImpls));

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
  // The transformer's framing: model.arch = "gpt" causal, anything else bidirectional ("bert").
  o.arch = m.arch == cfg::Arch::kGpt ? Arch::kGpt : Arch::kBert;
  o.task = task_of(m.task);
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
  o.attn = name_of(kAttnImpls, m.attn_implementation, AttnImpl::kSdpa);
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

Task task_of(cfg::Task task) { return name_of(kTasks, task, Task::kPretrain); }

cfg::Task config_task(Task task) {
  return value_named(kTasks, task).value_or(cfg::Task::kPretrain);
}

}  // namespace dnallm::models
