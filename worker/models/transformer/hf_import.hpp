// Import of Hugging Face model directories (config.json + model.safetensors + tokenizer
// files) into this project's TransformerLM, computing the same function as transformers.
//
// Families (config.json "model_type"; the class from "architectures"):
//   bert                  BertForMaskedLM / BertForSequenceClassification: post-LN
//                         (DNABERT-1), learned positions, embedding LayerNorm
//   esm                   EsmForMaskedLM / EsmForSequenceClassification: pre-LN, rotary or
//                         learned positions (Nucleotide Transformer v1); with the Nucleotide
//                         Transformer v2 remote code's auto_map (Note [Remote code]) its
//                         SwiGLU feed-forward
//   roberta-prelayernorm  RobertaPreLayerNormForMaskedLM / ...ForSequenceClassification
//   gpt_neox              GPTNeoXForCausalLM: rotary (any base; the whole head or its first
//                         rotary_pct share, Pythia's 0.25), sequential or parallel residual
//                         (use_parallel_residual, Pythia's)
//   llama                 LlamaForCausalLM: RMSNorm, gated SiLU MLP, no biases, rotary (any
//                         rope_theta: Llama 3's 500000) (grouped-query / multi-query:
//                         num_key_value_heads)
//   dnabert2              model_type "bert" with DNABERT-2's remote code in auto_map
//                         (bert_layers.BertForMaskedLM / BertForSequenceClassification):
//                         ALiBi, fused Wqkv, GEGLU feed-forward, post-LN (Note [DNABERT-2
//                         import] in hf_import_dnabert2.cpp); its Python files are not run
// Note [Nothing silently ignored]: every config.json key is either understood (and its value
// checked against what the import computes) or on a list of keys that do not change the
// function (dropout rates, token ids, bookkeeping); any other key, a value we do not compute
// (ALiBi outside DNABERT-2, relative positions, scaled rotary, a rotary setting the model
// type's code does not read (Note [Rotary config]), remote code "auto_map" other than Note
// [Remote code]'s and DNABERT-2's), and
// any tensor of model.safetensors the model does not use is an Error(kUsage) naming the key
// or tensor and what is supported. Tensors that exist only for another task (ESM's contact
// head) are listed by name in the log.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "worker/models/registry.hpp"
#include "worker/models/transformer/quantized_linear.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::data {
class Tokenizer;
class HfTokenizer;
}  // namespace dnallm::data

namespace dnallm::models {

// Note [Lazy Hugging Face import]: read_hf_checkpoint reads config.json and the weights file's
// header only: for each of our tensors it records where it lies in the file (a tensor, a row
// block of a fused one, a token-type row to fold in) and checks every name and shape against
// the model config.json describes. HfCheckpoint::read() reads one of our tensors when it is
// copied into the model (fp32; NaN or infinite values are exit 5 then). An import thus holds
// the model and one tensor of the file, not the whole file converted to fp32 next to a probe
// model and then next to the model (two whole fp32 copies: 20 GB for Nucleotide Transformer v2
// 2.5B, on every rank), and a fine-tune under ZeRO-3 fills each block as it is built (Note
// [Streamed build]): one block.
// DNABERT-2's pytorch_model.bin (a pickle, 117M parameters) is still read whole.
struct HfTensorSource {
  std::string name;             // the file's tensor
  int64_t part = 0, parts = 1;  // row block `part` of `parts` equal ones (dimension 0)
  bool per_head_qkv = false;    // gpt_neox's fused rows [head][q|k|v][head_dim]: `part` of 3
  std::vector<int64_t> shape;   // ours
};
class HfWeightsFile;  // model.safetensors read one tensor at a time (or a loaded pickle)

// A Hugging Face directory read and mapped onto our parameter names (vocabulary in the
// directory's own id order).
struct HfCheckpoint {
  std::string dir;
  std::string model_type;    // "bert", "esm", "roberta-prelayernorm", "gpt_neox", "llama",
                             // "dnabert2"
  std::string architecture;  // e.g. "BertForMaskedLM"
  ModelOptions options;      // lora_r = 0
  // By our names (TransformerLM::named_weights); every parameter of `options`' model, each
  // shape checked.
  std::map<std::string, HfTensorSource> tensors;
  std::shared_ptr<HfWeightsFile> file;

  // Our tensor `name` (fp32, contiguous), read from the file now (Note [Lazy Hugging Face
  // import]). Error(kCheckpointCorrupt) for NaN or infinite values.
  torch::Tensor read(const std::string& name) const;
};

// True when a Hugging Face config.json is one of the transformer layouts above (the registry's
// recognises_hf; read_hf_checkpoint then refuses what it does not compute, by name).
bool is_transformer_hf_config(const nlohmann::json& config);

// Reads and validates `dir` (see Note [Nothing silently ignored]). Throws Error(kUsage).
HfCheckpoint read_hf_checkpoint(const std::string& dir);

// A model with the checkpoint's weights loaded (eval mode).
TransformerLM build_hf_model(const HfCheckpoint& checkpoint);

// A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).
struct PeftAdapter {
  int64_t r = 0;
  double alpha = 0;
  double dropout = 0;
  std::vector<std::string> targets;              // our target names (query/key/value)
  std::map<std::string, torch::Tensor> weights;  // lora_A/lora_B and modules_to_save, our names
};
// Reads `adapter_dir` for a base of `base.model_type`; unsupported options (DoRA, rsLoRA,
// fan_in_fan_out, bias, layer patterns, other targets) are Error(kUsage).
PeftAdapter read_peft_adapter(const std::string& adapter_dir, const HfCheckpoint& base);
// `base` with the adapter applied (LoRA enabled on the targets, its tensors loaded).
TransformerLM build_hf_model_with_adapter(const HfCheckpoint& base, const PeftAdapter& adapter);

// model.init_from = a Hugging Face directory (fine-tuning): the architecture comes from its
// config.json, the task, heads, dropout and LoRA from `config`; `ours` (from [tokenizer]) must
// tokenize as the directory's tokenizer does (DNABERT k-mers: kind = "kmer", the same k,
// stride 1; one token a base: kind = "char"), and its vocabulary is mapped piece by piece
// onto the directory's (special tokens by role: [CLS] = <cls> or <bos>, [SEP] = <sep> or
// <eos>). Rows without a counterpart (e.g. [MASK] for a causal model) keep their fresh
// initialisation and are logged; heads the checkpoint lacks (a new classifier) too. Throws
// Error(kUsage) naming the setting to change.
// Under ZeRO-3 (`context.blocks`) each block is filled from the file as it is built (Note
// [Streamed build]).
TransformerLM init_from_hf(const Config& config, const data::Tokenizer& ours,
                           const BuildContext& context);

// Note [Streamed build], Note [LoRA block by block]: the model `options` describes (lora_r = 0),
// built block by block: `fill` (may be empty) gets each of a block's parameters by name, then the
// block gets its adapters (`lora_r` > 0) and, under QLoRA (`base` not kFull), its linears
// quantized, then `blocks` (ZeRO-3's sink; null: none) takes it; the rest of the parameters (the
// root's) go to `fill` after the build, and LoRA is enabled on the whole model last. The one
// order of a build from a directory, ours (family.cpp) or a Hugging Face one (init_from_hf), so
// that DDP and ZeRO-3 draw the same adapters, and a QLoRA base is never whole in fp32.
TransformerLM build_filled(
    const ModelOptions& options, int64_t lora_r, WeightFormat base, BlockSink* blocks,
    const std::function<void(const std::string&, const torch::Tensor&)>& fill);

// lora.quantize_base as the format build_filled() quantizes the blocks' linears to; Error(kUsage)
// when it is set without LoRA (`lora_r` = 0).
WeightFormat qlora_base_format(const Config& config, int64_t lora_r);

// The options of the model init_from_hf() builds (Note [Memory predicted]); reads config.json
// and the weights file's header (and the root's tied tensors), as read_hf_checkpoint does.
ModelOptions hf_fine_tune_options(const Config& config, const data::Tokenizer& ours);

// Our token id -> the directory's (-1: no counterpart, allowed for special tokens only), by
// piece and, for special tokens, by role. Throws Error(kUsage) naming a missing piece.
std::vector<int64_t> vocabulary_map(const data::Tokenizer& ours, const data::HfTokenizer& theirs,
                                    const std::string& dir);

}  // namespace dnallm::models
