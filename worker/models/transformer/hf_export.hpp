// Export in Hugging Face layouts that compute the same function as our model (the inverse of
// hf_import.hpp; CI proves it by importing the export again and comparing logits, and
// tests/hf/check_export.py does it with transformers' Auto classes and PEFT).
//
// Our model -> transformers model type:
//   encoder, pre-LN, no embedding LayerNorm (this project's BERT), rotary or learned
//       -> esm (EsmForMaskedLM / EsmForSequenceClassification; learned positions are
//          written at ESM's offset padding_idx + 1)
//   encoder, post-LN with embedding LayerNorm (an imported BERT) -> bert
//   encoder, pre-LN with embedding LayerNorm and RoBERTa positions -> roberta-prelayernorm
//   causal, rotary -> gpt_neox (GPTNeoXForCausalLM: rotary_emb_base, rotary_pct and
//       use_parallel_residual from the model's rope_theta, rotary_fraction, parallel_residual)
//   causal, rotary, RMSNorm + gated SiLU MLP + no biases (an imported Llama) -> llama (its
//       rope_theta; the whole head rotates and the residual is sequential)
//   encoder, ALiBi, post-LN, GEGLU feed-forward (DNABERT-2, imported or our preset) -> bert
//       with DNABERT-2's remote code in auto_map (Note [DNABERT-2 export] in hf_export.cpp;
//       LoRA: the merged model only, no PEFT adapter)
// Not exportable (Error(kUsage) saying so): mean pooling (transformers pools the first
// token), a causal model with learned positions or a task head, an encoder with a rotary base
// other than 10000 or a partial rotary, a parallel residual outside gpt_neox.
#pragma once

#include <optional>
#include <string>

#include "worker/models/registry.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::data {
class Tokenizer;
}

namespace dnallm::models {

// config.json + model.safetensors (LoRA merged into copies; the live model is unchanged).
// Returns the model type written.
// `source_dir`: the Hugging Face directory the model was imported from, if any (a DNABERT-2
// export keeps its config.json keys and copies its remote-code files: Note [DNABERT-2 export]).
// Returns the model type written ("dnabert2" for DNABERT-2's layout).
std::string export_hf_model(TransformerLM& model, const std::string& dir,
                            const std::string& source_dir = "");

// tokenizer.json (tokenizers' WordLevel format, loaded by PreTrainedTokenizerFast),
// tokenizer_config.json and special_tokens_map.json for `tokenizer` with the framing our objectives
// use ([CLS] ... [SEP] for encoders, [CLS] ... for causal models). One token a base, or overlapping
// k-mers (the input transformers expects is then the k-mers separated by spaces, as for DNABERT).
// model_max_length is the model's max_seq_length (framing tokens included), so that
// `tokenizer(..., truncation=True)` cuts where dnallm-infer does instead of overrunning the
// position table.
void export_hf_tokenizer(const data::Tokenizer& tokenizer, Arch arch, int64_t max_seq_length,
                         const std::string& dir);

// All of the above as one Hugging Face layout (dnallm-train's <final>/hf, ModelFamily::hf_export):
// the merged model and tokenizer in the directory, with LoRA also adapter/ (PEFT's
// adapter_config.json + adapter_model.safetensors: "base_model.model.<HF module>.lora_A.weight",
// task heads as modules_to_save) and base/ (the frozen weights it applies to, adapters not
// merged, with the tokenizer). The safetensors files stream (Note [Exports unit by unit]).
// What has no transformers equivalent is Error(kUsage) naming why (export_hf_directory skips
// the layout with a warning; the model's own export next to it is unaffected).
std::optional<HfExport> hf_export_transformer(TransformerLM& model,
                                              const data::Tokenizer& tokenizer,
                                              const std::string& source_dir = "");
// That layout written into `dir` from a model on one process (export_hf_directory): false when
// it is skipped.
bool export_hf_transformer(TransformerLM& model, const data::Tokenizer& tokenizer,
                           const std::string& dir, const std::string& source_dir = "");

}  // namespace dnallm::models
