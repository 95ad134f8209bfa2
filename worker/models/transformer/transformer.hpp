// DNA language models: a pre-LN transformer used as a BERT encoder (masked LM), a GPT
// decoder (causal LM with KV-cache generation) and sequence classification/regression.
//
// Parameter names (Note [Parameter names]) follow Hugging Face BERT so that an export loads
// into transformers where shapes correspond:
//   <root>.embeddings.word_embeddings.weight            [vocab, hidden]
//   <root>.embeddings.position_embeddings.weight        [max_seq, hidden] (learned only)
//   <root>.encoder.layer.N.attention.self.{query,key,value}.{weight,bias}
//   <root>.encoder.layer.N.attention.output.dense.{weight,bias}
//   <root>.encoder.layer.N.attention.output.LayerNorm.* (pre-LN: applied BEFORE attention)
//   <root>.encoder.layer.N.intermediate.dense.*          [ffn, hidden]
//   <root>.encoder.layer.N.output.dense.*                [hidden, ffn]
//   <root>.encoder.layer.N.output.LayerNorm.*            (pre-LN: applied BEFORE the FFN)
//   <root>.encoder.final_layer_norm.*                    (pre-LN needs a final norm)
//   MLM head:   cls.predictions.transform.dense.*, cls.predictions.transform.LayerNorm.*,
//               cls.predictions.bias [vocab] (decoder weight tied to word_embeddings,
//               or cls.predictions.decoder.weight when untied)
//   causal LM:  lm_head.weight (untied) / tied to word_embeddings, lm_head.bias
//   cls/reg:    <root>.pooler.dense.*, classifier.* [num_labels, hidden]
// <root> is "bert" for arch = "bert" and "gpt" for arch = "gpt". HF BERT is post-LN, so the
// weights load by name and shape but the computation differs: config.json records
// "pre_layer_norm": true and our own loader (load_exported_model) is the exact inverse.
// LoRA adds <linear>.lora_A [r, in] and <linear>.lora_B [out, r] (PEFT's shapes).
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.hpp"
#include "core/config.hpp"
#include "worker/models/language_model.hpp"
#include "worker/models/lora_linear.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/transformer/quantized_linear.hpp"

namespace dnallm::models {

enum class AttnImpl { kSdpa, kEager };

struct AttentionContext;  // worker/models/transformer/context_attention.hpp

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
  // Rotary variants (Note [Rotary variants] in transformer.cpp), as transformers computes them:
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

// Key/value heads of `o` (Note [Grouped-query attention] in transformer.cpp).
inline int64_t key_value_heads(const ModelOptions& o) {
  return o.kv_heads > 0 ? o.kv_heads : o.heads;
}

// The channels of each head that rotary positions rotate: int(head_dim * rotary_fraction), as
// transformers' GPT-NeoX truncates it (the whole head when rotary_fraction is 1).
inline int64_t rotary_dims(const ModelOptions& o) {
  return static_cast<int64_t>(double(o.hidden / o.heads) * o.rotary_fraction);
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

class TransformerLMImpl : public LanguageModelImpl {
 public:
  explicit TransformerLMImpl(ModelOptions options);

  const ModelSpec& spec() const override { return spec_; }
  ModelOutput forward(const ForwardInputs& inputs) override;
  // Final hidden states [B, T, hidden] (after the final norm).
  torch::Tensor encode(const ForwardInputs& inputs) override { return encode(inputs, nullptr, 0); }
  // The same, reading and extending a key/value cache whose first `past_len` positions exist.
  torch::Tensor encode(const ForwardInputs& inputs, std::vector<LayerCache>* cache,
                       int64_t past_len);

  std::vector<std::shared_ptr<torch::nn::Module>> blocks() const override;
  void set_activation_checkpointing(bool on) override;
  void set_block_hooks(std::shared_ptr<BlockHooks> hooks) override { hooks_ = std::move(hooks); }
  // Note [Attention context parallelism]: positions as cp->positions (zig-zag for a causal LM,
  // spec().context_layout); labels come shifted (spec().shift_labels turns false); a classifier
  // pools over the group (Note [Context-parallel pooling]). A regressor, RoBERTa positions or a
  // sequence longer than the position table refuse (exit 2). Collective
  // over cp->group (the positions are all-gathered).
  void set_context_parallel(std::shared_ptr<ContextParallel> cp) override;
  // Note [Model FLOPs] (worker/train/mfu.hpp): the parameters' 6/4 a token plus attention's
  // 12 x layers x hidden x sequence.
  double flops_per_token(int64_t seq_len) const override;

  // Causal LM only. `prompt` [B, P] (same length for every row). Returns [B, P + new].
  bool can_generate() const override {
    return options_.arch == Arch::kGpt && options_.task == Task::kPretrain;
  }
  torch::Tensor generate(const torch::Tensor& prompt, const GenerateOptions& options) override;

  // Enables LoRA on the target linears and freezes everything else except task heads.
  // `r` > 0 overrides options().lora_r (used after loading base weights).
  void enable_lora(int64_t r = 0) override;
  // Folds adapters into the base weights (after this the model has no adapters).
  void merge_lora() override;

  const ModelOptions& options() const { return options_; }
  std::string root_name() const { return options_.arch == Arch::kBert ? "bert" : "gpt"; }

  // Every parameter and buffer that an export holds, by its HF-style name (LoRA merged
  // copies are NOT made here: call merge_lora() first for an export).
  std::vector<std::pair<std::string, torch::Tensor>> named_weights() const override;
  nlohmann::ordered_json export_config() const override;

 private:
  torch::Tensor lm_logits(const torch::Tensor& hidden);
  void update_spec();

  ModelOptions options_;
  ModelSpec spec_;
  torch::nn::Embedding word_embeddings{nullptr}, position_embeddings{nullptr};
  torch::Tensor token_type_;  // options_.type_vocab_size > 0
  std::vector<Block> blocks_;
  std::shared_ptr<BlockHooks> hooks_;              // Note [Block hooks]
  std::shared_ptr<AttentionContext> context_;      // Note [Attention context parallelism]
  std::shared_ptr<ContextParallel> context_view_;  // what set_context_parallel() got
  int64_t context_length_ = -1;                    // the full length context_ was built for
  void refresh_context();
  void build_context(const std::shared_ptr<ContextParallel>& cp);
  torch::Tensor context_positions_;              // this rank's global positions (int64)
  torch::nn::LayerNorm embedding_norm{nullptr};  // options_.embedding_layer_norm
  torch::nn::LayerNorm final_norm{nullptr};      // absent with options_.post_layer_norm
  torch::Tensor rms_final_;                      // options_.rms_norm
  // heads
  LoraLinear mlm_dense{nullptr};
  torch::nn::LayerNorm mlm_norm{nullptr};
  torch::Tensor lm_bias_, lm_weight_;  // lm_weight_ undefined when tied
  LoraLinear pooler{nullptr}, classifier{nullptr};
};
TORCH_MODULE(TransformerLM);

// Note [ALiBi]: the per-head slopes (Press et al., as MosaicBERT/DNABERT-2 compute them): for
// n a power of two, 2^(-8 (i + 1) / n); otherwise the slopes of the power of two below n, then
// every second slope of twice that power, up to n.
std::vector<double> alibi_slopes(int64_t heads);
// The additive biases [1, H, Tq, Tk] = -slope_h * |q_i - k_j| for query positions
// [q_start, q_start + tq) and key positions [0, tk).
torch::Tensor alibi_bias(int64_t heads, int64_t q_start, int64_t tq, int64_t tk,
                         const torch::Device& device);

// Attention on [B, H, T, D] tensors with an additive mask (see the implementation note).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& bias, bool causal, AttnImpl impl);
torch::Tensor attention_with_dropout(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& bias, bool causal,
                                     AttnImpl impl, double dropout_p);

// Runs `block` without keeping activations; backward reruns it under grad mode.
// Note [Activation checkpointing]: a custom autograd Function whose forward runs under no_grad
// and whose backward reruns the block under grad mode and back-propagates through it
// (parameter gradients accumulate as usual). Dropout masks are re-drawn on the rerun, so with
// dropout > 0 the gradients are those of a different mask (as PyTorch without
// preserve_rng_state); with dropout = 0 they are identical.
torch::Tensor checkpointed_block(Block& block, const torch::Tensor& x, const torch::Tensor& bias,
                                 bool causal, const torch::Tensor& rope_cos,
                                 const torch::Tensor& rope_sin);

// safetensors (the format: checkpoint/safetensors.hpp), tensors as torch tensors. The file is
// written durably; a tensor is copied to the host, contiguous, in its own dtype.
checkpoint::SafetensorsTensor safetensors_tensor(const std::string& name, const torch::Tensor& t);
std::vector<checkpoint::SafetensorsTensor> safetensors_tensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors);
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path);

// Every LoRA or quantized linear of `model`, by parameter name ("<module>.weight"), and one such
// linear's full-precision weight: a quantized base dequantized, plus the adapter when
// `merge_adapters`. A copy: the live model keeps training with its adapters. Every export reads
// them so, one linear at a time (LiveWeights, Note [Exports unit by unit] in family_io.hpp).
std::map<std::string, std::shared_ptr<LoraLinearImpl>> lora_or_quantized_linears(
    torch::nn::Module& model);
torch::Tensor full_linear_weight(const LoraLinearImpl& linear, bool merge_adapters);

// A fresh transformer from [model] (model.init_from = one of our model directories: its
// tensors by name and shape), after Note [Memory predicted]; LoRA and QLoRA as configured.
TransformerLM build_transformer(const Config& config, int64_t vocab_size,
                                const BuildContext& context);

// The family's registry entry (worker/models/registry.hpp).
ModelFamily transformer_family();

// The config.json of an exported transformer (also stored in checkpoints, so dnallm-ckpt
// export writes the same file).
nlohmann::ordered_json export_config(const ModelOptions& options);

// The transformer family's loader of our model directory (registry.hpp: load_exported_model):
// `config` is its parsed config.json (model_type "bert" or "dnallm-gpt").
TransformerLM load_exported_transformer(const std::string& dir, const nlohmann::json& config);

}  // namespace dnallm::models
