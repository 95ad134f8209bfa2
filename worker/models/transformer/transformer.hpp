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

#include "core/config.hpp"
#include "worker/models/language_model.hpp"
#include "worker/models/lora_linear.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/torch_safetensors.hpp"
#include "worker/models/transformer/attention.hpp"
#include "worker/models/transformer/block.hpp"
#include "worker/models/transformer/model_options.hpp"
#include "worker/models/transformer/positions.hpp"
#include "worker/models/transformer/quantized_linear.hpp"

namespace dnallm::models {

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
