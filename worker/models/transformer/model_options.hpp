// The transformer's options (ModelOptions: the shape, positions, norms, feed-forward and LoRA of
// a model), their limits (Note [Model shape limits]) and the conversion from [model] / [lora].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::models {

enum class AttnImpl { kSdpa, kEager };

struct ModelOptions {
  Arch arch = Arch::kBert;
  Task task = Task::kPretrain;
  int64_t vocab_size = 9;  // PAD UNK CLS SEP MASK A C G T (+N) for char tokens
  int64_t hidden = 256;
  int64_t layers = 4;
  int64_t heads = 4;
  // Grouped-query attention (Llama's num_key_value_heads): key/value heads, each shared by
  // heads / kv_heads query heads (1: multi-query). 0: as many as `heads` (key_value_heads()).
  int64_t kv_heads = 0;
  int64_t ffn = 1024;
  int64_t max_seq_length = 512;
  bool rotary = false;  // false: learned absolute positions
  // Rotary variants (Note [Rotary variants] in positions.cpp), as transformers computes them:
  // rope_theta is the base of the frequencies (rope_theta; Llama 3: 500000); rotary_fraction
  // the share of each head's channels that rotate (GPT-NeoX's rotary_pct, Pythia 0.25): the
  // first rotary_dims() = int(head_dim * rotary_fraction) channels, the others pass unchanged.
  double rope_theta = 10000.0;
  double rotary_fraction = 1.0;
  // GPT-NeoX's use_parallel_residual: x + Attn(LN1(x)) + FFN(LN2(x)), both sublayers reading
  // the block's input, instead of y = x + Attn(LN1(x)), then y + FFN(LN2(y)). Pre-LN only.
  bool parallel_residual = false;
  AttnImpl attn = AttnImpl::kSdpa;
  double dropout = 0.0;
  bool gradient_checkpointing = false;
  bool tie_embeddings = true;
  double layer_norm_eps = 1e-12;
  int64_t num_labels = 2;
  bool mean_pooling = false;  // false: the first ([CLS]) token
  // Causal LM: labels are the input ids, shifted inside the model (HF convention) when true;
  // when false labels[i] is already the target of position i.
  bool shift_labels = true;
  int64_t pad_id = 0;
  // Variants that imported Hugging Face models need (worker/models/transformer/hf_import.hpp); the
  // defaults are this project's own pre-LN model.
  // post_layer_norm: BERT's post-LN blocks, LN(x + Attn(x)) then LN(y + FFN(y)), and no final
  // norm. embedding_layer_norm: a LayerNorm after the embedding sum (<root>.embeddings.LayerNorm).
  bool post_layer_norm = false;
  bool embedding_layer_norm = false;
  // ESM: embeddings are multiplied by the attention mask (padding positions start at zero).
  bool mask_embeddings = false;
  // RoBERTa numbering: position of a real token = padding_idx + 1 + its index among the real
  // tokens, padding tokens get padding_idx (-1: positions 0, 1, 2, ... as ours).
  int64_t position_padding_idx = -1;
  // Llama: RMSNorm (a weight, no bias) instead of LayerNorm, a gated SiLU feed-forward
  // (output.dense(silu(intermediate.gate(x)) * intermediate.dense(x))) and no biases in the
  // blocks' linears.
  bool rms_norm = false;
  bool gated_mlp = false;
  bool linear_bias = true;
  // DNABERT-2 (MosaicBERT), Note [ALiBi]: attention biases -slope_h * |i - j| instead of
  // position embeddings (no table: any length); the gated feed-forward's gate through exact
  // GELU instead of SiLU (GEGLU), its input projections without bias (ffn_in_bias, the others
  // keep theirs); a token-type table whose row 0 is added to every token (type_vocab_size > 0,
  // <root>.embeddings.token_type_embeddings.weight).
  bool alibi = false;
  enum class GateActivation { kSilu, kGelu };
  GateActivation gate_activation = GateActivation::kSilu;
  bool ffn_in_bias = true;
  int64_t type_vocab_size = 0;
  // Nucleotide Transformer v2 (add_bias_fnn = false): the feed-forward linears without biases,
  // the attention's with them.
  bool ffn_bias = true;
  // LoRA
  int64_t lora_r = 0;
  double lora_alpha = 16.0;
  double lora_dropout = 0.0;
  std::vector<std::string> lora_targets = {"query", "value"};
};

// Key/value heads of `o` (Note [Grouped-query attention] in attention.cpp).
inline int64_t key_value_heads(const ModelOptions& o) {
  return o.kv_heads > 0 ? o.kv_heads : o.heads;
}

// The channels of each head that rotary positions rotate: int(head_dim * rotary_fraction), as
// transformers' GPT-NeoX truncates it (the whole head when rotary_fraction is 1).
inline int64_t rotary_dims(const ModelOptions& o) {
  return static_cast<int64_t>(double(o.hidden / o.heads) * o.rotary_fraction);
}

// The positions at the start of the table that RoBERTa numbering never gives a real token
// (padding_idx + 1; 0 without it): ModelSpec::reserved_positions.
inline int64_t reserved_positions(const ModelOptions& o) {
  return o.position_padding_idx >= 0 ? o.position_padding_idx + 1 : 0;
}

// Note [Model shape limits]: a model directory (config.json: ours or a Hugging Face one) is
// untrusted, so its sizes are checked before anything is allocated: every size positive,
// hidden a multiple of heads, heads a multiple of kv_heads, layers <= kMaxLayers, each size within
// its bound below, layer_norm_eps > 0 and finite, pad and padding ids inside their ranges, the
// parameter count (computed without overflow) <= kMaxParameters, and the fp32 weights within the
// memory this process may use (MemAvailable, or the cgroup's memory.max).
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxHidden = int64_t{1} << 16;
inline constexpr int64_t kMaxFfn = int64_t{1} << 18;
inline constexpr int64_t kMaxVocab = int64_t{1} << 24;
inline constexpr int64_t kMaxPositions = int64_t{1} << 20;
inline constexpr int64_t kMaxLabels = int64_t{1} << 16;
inline constexpr double kMaxParameters = 68719476736.0;  // 2^36

// Parameters of a model with these options (LoRA adapters not counted), in double so that
// no size overflows.
double parameter_count(const ModelOptions& o);
// The weights of one block's linear layers (what QLoRA quantizes: quantize_block_linears).
double block_linear_weight_count(const ModelOptions& o);

// Note [Model shape limits]: throws Error(kUsage) naming `where` (the config.json) and the key
// when `o` is outside the limits, before any allocation.
void check_model_shape(const ModelOptions& o, const std::string& where);

// Validates and converts the [model]/[lora] sections; throws Error(kUsage) naming the key.
// "auto" attention resolves to sdpa.
ModelOptions model_options_from_config(const Config& config, int64_t vocab_size);

// model.task as a model's Task, and the model.task a model was built from.
Task task_of(cfg::Task task);
cfg::Task config_task(Task task);

}  // namespace dnallm::models
