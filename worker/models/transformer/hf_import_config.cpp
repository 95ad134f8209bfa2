// config.json of a Hugging Face directory: the keys understood and the options they give
// (Note [Nothing silently ignored] in hf_import.hpp).
#include <iterator>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/transformer/hf_import_detail.hpp"

namespace dnallm::models {

using nlohmann::json;
using namespace detail;  // hf_import_detail.hpp

namespace detail {

const char* const kSupported =
    "supported are bert (BertForMaskedLM, BertForSequenceClassification), esm "
    "(EsmForMaskedLM, EsmForSequenceClassification; also the Nucleotide Transformer v2 "
    "remote code), roberta-prelayernorm "
    "(RobertaPreLayerNormForMaskedLM, ...ForSequenceClassification), gpt_neox "
    "(GPTNeoXForCausalLM), llama (LlamaForCausalLM) and DNABERT-2 (model_type bert with "
    "DNABERT-2's remote code: auto_map bert_layers.BertForMaskedLM / "
    "BertForSequenceClassification, configuration_bert.BertConfig)";

// `c[key]`, when present and not null, must be `wanted`; else Error(kUsage) saying `what`.
void expect_value(const json& c, const std::string& path, const char* key, const json& wanted,
                  const char* what) {
  if (!c.contains(key) || c[key].is_null()) return;
  DNALLM_CHECK(c[key] == wanted, ExitCode::kUsage, "{}: {} = {} is not supported: {}", path, key,
               clip_for_message(c[key].dump()), what);
}

}  // namespace detail

namespace {

// Keys that do not change the function computed at inference (or are checked elsewhere).
const char* const kNeutralKeys[] = {
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "initializer_range",
    "use_cache",
    "id2label",
    "label2id",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "mask_token_id",
    "sep_token_id",
    "cls_token_id",
    "decoder_start_token_id",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    "hidden_dropout",
    "attention_dropout",
    "classifier_dropout",
    "gradient_checkpointing",
    "output_past",
    "tokenizer_class",
    "max_length",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "tie_encoder_decoder",
    "chunk_size_feed_forward",
    "prefix",
    "task_specific_params",
    "problem_type",
    "num_labels",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "layer_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
    "type_vocab_size",
    "position_embedding_type",
    "is_decoder",
    "add_cross_attention",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rotary_pct",
    "rotary_emb_base",
    "partial_rotary_factor",
    "use_parallel_residual",
    "attention_bias",
    "emb_layer_norm_before",
    "token_dropout",
    "vocab_list",
    "esmfold_config",
    "is_folding_model",
    "layer_norm_epsilon",
    "bos_token",
    "eos_token",
    "is_encoder_decoder",
    "pruned_heads",
    "torchscript",
    "finetuning_task",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "mlp_bias",
    "pretraining_tp",
    "auto_map",      // read_model_class: only the remote code of Note [Remote code]
    "add_bias_fnn",  // set_model_type_options: Nucleotide Transformer v2 only
};

const std::set<std::string>& neutral_keys() {
  static const std::set<std::string> keys(std::begin(kNeutralKeys), std::end(kNeutralKeys));
  return keys;
}

int64_t get_int(const json& c, const char* key, const std::string& path) {
  DNALLM_CHECK(c.contains(key) && c[key].is_number_integer(), ExitCode::kUsage,
               "{}: \"{}\" is missing or not an integer", path, key);
  DNALLM_CHECK(!c[key].is_number_unsigned() ||
                   c[key].get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
               ExitCode::kUsage, "{}: \"{}\" = {} is too large", path, key,
               clip_for_message(c[key].dump()));
  return c[key].get<int64_t>();
}

// `c[key]` as a number when present (else `fallback`); Error(kUsage) when it is not one.
double get_number(const json& c, const char* key, double fallback, const std::string& path) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  DNALLM_CHECK(c[key].is_number(), ExitCode::kUsage, "{}: \"{}\" = {} is not a number", path, key,
               clip_for_message(c[key].dump()));
  return c[key].get<double>();
}

// Every auto_map entry must be one of a verified family's targets: Note [Remote code]'s (the
// Nucleotide Transformer v2) or Note [DNABERT-2 import]'s; anything else is refused, naming it.
void read_auto_map(const json& c, const std::string& path) {
  if (!c.contains("auto_map") || is_dnabert2_auto_map(c["auto_map"])) return;
  const auto& targets = nt_v2_auto_map();
  DNALLM_CHECK(c["auto_map"].is_object() && c["auto_map"].contains("AutoConfig"), ExitCode::kUsage,
               "{}: \"auto_map\" = {} asks for the model's own remote code (trust_remote_code), "
               "which is not run here: {}",
               path, clip_for_message(c["auto_map"].dump()), kSupported);
  // DNABERT-2's AutoConfig: every entry must be one of its classes (Note [DNABERT-2 import]).
  const bool dnabert2_config =
      dnabert2_target(c["auto_map"]["AutoConfig"]) == "configuration_bert.BertConfig";
  for (const auto& [key, value] : c["auto_map"].items()) {
    const auto it = targets.find(key);
    const bool known = dnabert2_config ? !dnabert2_target(value).empty()
                                       : it != targets.end() && value == it->second;
    DNALLM_CHECK(known, ExitCode::kUsage,
                 "{}: \"auto_map\" has {} = {}: the model's own remote code "
                 "(trust_remote_code) is not run here, and this is not the Nucleotide "
                 "Transformer v2's (esm_config.EsmConfig, modeling_esm.EsmForMaskedLM / "
                 "EsmForSequenceClassification) nor DNABERT-2's (configuration_bert.BertConfig, "
                 "bert_layers.BertForMaskedLM / BertForSequenceClassification), whose function "
                 "the import computes; {}",
                 path, clip_for_message(key), clip_for_message(value.dump()), kSupported);
  }
}

}  // namespace

namespace detail {

// Note [Nothing silently ignored]: checks of the keys that change the function.
// (auto_map was refused by read_model_class already.)
void check_config(const json& c, const std::string& path, const std::string& model_type) {
  const bool dnabert2 = model_type == "dnabert2";
  for (const auto& [key, value] : c.items()) {
    if (dnabert2 && (key == "auto_map" || key == "alibi_starting_size")) continue;
    DNALLM_CHECK(neutral_keys().count(key) == 1, ExitCode::kUsage,
                 "{}: key \"{}\" (= {}) is not understood by the {} import, so the model it "
                 "describes may compute something else: remove it if it does not change the "
                 "model; {}",
                 path, clip_for_message(key), clip_for_message(value.dump()), model_type,
                 kSupported);
  }
  auto expect = [&](const char* key, const json& wanted, const char* what) {
    expect_value(c, path, key, wanted, what);
  };
  expect("is_decoder", false, "only encoders (is_decoder = false)");
  expect("add_cross_attention", false, "no cross-attention");
  expect("chunk_size_feed_forward", 0, "set it to 0");
  expect("pruned_heads", json::object(), "pruned heads are not supported");
  const bool llama = model_type == "llama";
  if (c.contains("hidden_act")) {
    DNALLM_CHECK(c["hidden_act"] == (llama ? "silu" : "gelu"), ExitCode::kUsage,
                 "{}: hidden_act = {} is not supported for {}: supported is {}", path,
                 c["hidden_act"].dump(), model_type,
                 llama ? "\"silu\" (gated)" : "\"gelu\" (exact, erf)");
  }
  if (llama) check_llama_config(c, path);
  const std::string pos = c.value("position_embedding_type", std::string("absolute"));
  if (dnabert2) {
    // Its code ignores position_embedding_type (ALiBi always) and uses the token-type ids it
    // is given: the alibi table size must be a positive integer, nothing else is read.
    DNALLM_CHECK(
        !c.contains("alibi_starting_size") || (c["alibi_starting_size"].is_number_integer() &&
                                               c["alibi_starting_size"].get<int64_t>() > 0),
        ExitCode::kUsage, "{}: alibi_starting_size = {} must be a positive integer", path,
        clip_for_message(c.value("alibi_starting_size", json()).dump()));
    expect("attention_bias", true, "supported are biased attention projections (true)");
    return;
  }
  if (pos == "alibi" || c.contains("alibi") || c.value("use_alibi", false)) {
    fail(ExitCode::kUsage,
         "{}: position_embedding_type = \"alibi\" (ALiBi) is not supported: supported are "
         "\"absolute\" (learned) and \"rotary\" (esm, gpt_neox)",
         path);
  }
  DNALLM_CHECK(pos == "absolute" || (pos == "rotary" && model_type == "esm"), ExitCode::kUsage,
               "{}: position_embedding_type = \"{}\" is not supported for {}: supported are "
               "\"absolute\" (learned) and, for esm, \"rotary\"",
               path, pos, model_type);
  read_rotary_config(c, path, model_type);  // (the values: set_model_type_options)
  if (model_type != "gpt_neox") {           // (gpt_neox: Note [Parallel residual] in block.cpp)
    expect("use_parallel_residual", false,
           "supported is the sequential residual (use_parallel_residual = false)");
  }
  if (llama) {
    expect("attention_bias", false, "supported are unbiased attention projections (false)");
  } else {
    expect("attention_bias", true, "supported are biased attention projections (true)");
  }
  expect("token_dropout", false,
         "token_dropout rescales the embeddings at inference: supported is false");
  expect("vocab_list", json(), "supported is null (the vocabulary comes from vocab.txt)");
  expect("esmfold_config", json(), "ESMFold is not supported");
  expect("is_folding_model", false, "ESMFold is not supported");
}

// config.json's model_type and single architecture, checked against what is supported.
void read_model_class(const json& c, const std::string& path, HfCheckpoint& h) {
  read_auto_map(c, path);
  const bool remote = nt_v2_remote_code(c);
  DNALLM_CHECK((remote && !c.contains("model_type")) ||
                   (c.contains("model_type") && c["model_type"].is_string()),
               ExitCode::kUsage, "{}: \"model_type\" is missing or not a string: {}", path,
               kSupported);
  h.model_type = c.value("model_type", std::string("esm"));
  DNALLM_CHECK(!remote || h.model_type == "esm", ExitCode::kUsage,
               "{}: model_type = \"{}\" with the Nucleotide Transformer v2 remote code "
               "(auto_map): supported is \"esm\"",
               path, clip_for_message(h.model_type));
  // See Note [DNABERT-2 import]: DNABERT-2's remote code says model_type "bert".
  const bool dnabert2 = c.contains("auto_map") && is_dnabert2_auto_map(c["auto_map"]);
  DNALLM_CHECK(!dnabert2 || h.model_type == "bert", ExitCode::kUsage,
               "{}: model_type = \"{}\" with DNABERT-2's remote code (auto_map): supported is "
               "\"bert\"",
               path, clip_for_message(h.model_type));
  if (dnabert2) h.model_type = "dnabert2";
  DNALLM_CHECK(h.model_type == "bert" || (dnabert2 && h.model_type == "dnabert2") ||
                   h.model_type == "esm" || h.model_type == "roberta-prelayernorm" ||
                   h.model_type == "gpt_neox" || h.model_type == "llama",
               ExitCode::kUsage, "{}: model_type = \"{}\" is not supported: {}", path,
               clip_for_message(h.model_type), kSupported);
  DNALLM_CHECK(c.contains("architectures") && c["architectures"].is_array() &&
                   c["architectures"].size() == 1,
               ExitCode::kUsage,
               "{}: \"architectures\" must name exactly one class (e.g. [\"BertForMaskedLM\"])",
               path);
  DNALLM_CHECK(c["architectures"][0].is_string(), ExitCode::kUsage,
               "{}: \"architectures\" must name a class (a string)", path);
  h.architecture = c["architectures"][0].get<std::string>();
}

// Our arch and task from the architecture class (and problem_type).
void set_arch_and_task(const json& c, const std::string& path, const HfCheckpoint& h,
                       ModelOptions& o) {
  const auto& a = h.architecture;
  auto ends = [&](const std::string& s) {
    return a.size() >= s.size() && a.compare(a.size() - s.size(), s.size(), s) == 0;
  };
  const bool causal = h.model_type == "gpt_neox" || h.model_type == "llama";
  if (causal) {
    DNALLM_CHECK(a == "GPTNeoXForCausalLM" || a == "LlamaForCausalLM", ExitCode::kUsage,
                 "{}: architectures = [\"{}\"] is not supported: supported are "
                 "GPTNeoXForCausalLM and LlamaForCausalLM",
                 path, a);
    o.arch = Arch::kGpt;
    o.task = Task::kPretrain;
  } else if (ends("ForMaskedLM")) {
    o.arch = Arch::kBert;
    o.task = Task::kPretrain;
  } else if (ends("ForSequenceClassification")) {
    o.arch = Arch::kBert;
    const std::string problem = c.value("problem_type", std::string());
    o.task = problem == "regression" ? Task::kRegression : Task::kClassification;
    DNALLM_CHECK(
        problem.empty() || problem == "regression" || problem == "single_label_classification",
        ExitCode::kUsage,
        "{}: problem_type = \"{}\" is not supported: supported are "
        "single_label_classification and regression",
        path, problem);
  } else {
    fail(ExitCode::kUsage,
         "{}: architectures = [\"{}\"] is not supported: supported are *ForMaskedLM, "
         "*ForSequenceClassification and GPTNeoXForCausalLM",
         path, a);
  }
}

// Sizes, epsilon, tying, padding and labels: the keys every model type shares.
void set_common_options(const json& c, const std::string& path, ModelOptions& o) {
  o.vocab_size = get_int(c, "vocab_size", path);
  o.hidden = get_int(c, "hidden_size", path);
  o.layers = get_int(c, "num_hidden_layers", path);
  o.heads = get_int(c, "num_attention_heads", path);
  o.ffn = get_int(c, "intermediate_size", path);
  o.max_seq_length = get_int(c, "max_position_embeddings", path);
  // (hidden % heads and every other size: check_model_shape, before any allocation)
  o.layer_norm_eps =
      get_number(c, "layer_norm_eps", get_number(c, "layer_norm_epsilon", 1e-12, path), path);
  o.tie_embeddings = c.value("tie_word_embeddings", true);
  o.pad_id =
      c.value("pad_token_id", json()).is_number_integer() ? c["pad_token_id"].get<int64_t>() : 0;
  o.dropout = 0.0;
  o.lora_r = 0;
  if (o.task == Task::kRegression) {
    o.num_labels = 1;
  } else if (o.task == Task::kClassification) {
    o.num_labels =
        c.contains("id2label") ? int64_t(c["id2label"].size()) : c.value("num_labels", int64_t{2});
  }
}

// What each model type computes differently: norms, positions, MLP, tying.
void set_model_type_options(const json& c, const std::string& path, const std::string& model_type,
                            ModelOptions& o) {
  const std::string pos = c.value("position_embedding_type", std::string("absolute"));
  if (model_type != "dnabert2") {  // Note [Rotary config]
    const RotaryConfig rotary = read_rotary_config(c, path, model_type);
    o.rope_theta = rotary.theta;
    o.rotary_fraction = rotary.fraction;
  }
  if (model_type == "dnabert2") {  // Note [DNABERT-2 import]
    o.post_layer_norm = true;
    o.embedding_layer_norm = true;
    o.alibi = true;
    o.gated_mlp = true;
    o.gate_activation = ModelOptions::GateActivation::kGelu;
    o.ffn_in_bias = false;
    o.tie_embeddings = true;  // its decoder IS the word-embedding parameter
    o.type_vocab_size = c.contains("type_vocab_size") ? get_int(c, "type_vocab_size", path) : 2;
  } else if (model_type == "bert") {
    o.post_layer_norm = true;
    o.embedding_layer_norm = true;
  } else if (model_type == "esm") {
    if (nt_v2_remote_code(c)) {  // Note [Remote code]
      o.gated_mlp = true;
      o.ffn_bias = c.value("add_bias_fnn", true);  // EsmConfig's default
    } else {
      DNALLM_CHECK(!c.contains("add_bias_fnn"), ExitCode::kUsage,
                   "{}: add_bias_fnn is a key of the Nucleotide Transformer v2 remote code, "
                   "whose config.json names it in \"auto_map\" (esm_config.EsmConfig); without "
                   "it this is transformers' own ESM, which the checkpoint is not: restore "
                   "auto_map",
                   path);
    }
    o.rotary = pos == "rotary";
    o.mask_embeddings = true;
    o.embedding_layer_norm = c.value("emb_layer_norm_before", false);
    if (!o.rotary) o.position_padding_idx = o.pad_id;
  } else if (model_type == "roberta-prelayernorm") {
    o.embedding_layer_norm = true;
    o.position_padding_idx = o.pad_id;
  } else {
    o.rotary = true;
    o.tie_embeddings = c.value("tie_word_embeddings", false);
    o.shift_labels = true;
    // GPTNeoXConfig's default is the parallel residual (Pythia's), in transformers 4 and 5.
    if (model_type == "gpt_neox") o.parallel_residual = c.value("use_parallel_residual", true);
    if (model_type == "llama") {
      o.rms_norm = true;
      o.gated_mlp = true;
      o.linear_bias = false;
      o.layer_norm_eps = get_number(c, "rms_norm_eps", 1e-6, path);
      if (c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()) {
        o.kv_heads = get_int(c, "num_key_value_heads", path);
        DNALLM_CHECK(o.kv_heads > 0, ExitCode::kUsage,
                     "{}: num_key_value_heads = {} must be a positive divisor of "
                     "num_attention_heads: the file is damaged",
                     path, o.kv_heads);
      }
    }
  }
}

}  // namespace detail

}  // namespace dnallm::models
