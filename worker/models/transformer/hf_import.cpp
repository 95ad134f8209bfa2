#include "worker/models/transformer/hf_import.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <set>

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/block_hooks.hpp"
#include "worker/models/hf_directory.hpp"
#include "worker/models/torch_pickle.hpp"
#include "worker/models/transformer/hf_names.hpp"

namespace dnallm::models {
namespace {

using nlohmann::json;
using torch::Tensor;

const char* const kSupported =
    "supported are bert (BertForMaskedLM, BertForSequenceClassification), esm "
    "(EsmForMaskedLM, EsmForSequenceClassification; also the Nucleotide Transformer v2 "
    "remote code), roberta-prelayernorm "
    "(RobertaPreLayerNormForMaskedLM, ...ForSequenceClassification), gpt_neox "
    "(GPTNeoXForCausalLM), llama (LlamaForCausalLM) and DNABERT-2 (model_type bert with "
    "DNABERT-2's remote code: auto_map bert_layers.BertForMaskedLM / "
    "BertForSequenceClassification, configuration_bert.BertConfig)";

// Note [DNABERT-2 import]: DNABERT-2 (zhihan1996/DNABERT-2-117M, MosaicBERT) says model_type
// "bert" but runs its own code (auto_map -> bert_layers.py): ALiBi instead of positions, a
// fused Wqkv (rows: all heads' queries, then keys, then values), a GLU feed-forward
// gated_layers [2 x intermediate, hidden] without bias whose first half goes through exact
// GELU and multiplies the second half, then wo; post-LN blocks; token-type embeddings (row 0
// added); MLM head decoder tied to the word embeddings with its own bias. It is recognised by
// its auto_map (every entry one of those classes, optionally "<repo>--" prefixed), never by
// model_type alone; a tensor of another layout is then refused by name. The reference code is
// not run here: its config keys that change nothing we compute (alibi_starting_size: our
// biases extend to any length; max_position_embeddings: only its token-type buffer) are read
// and checked.
// One DNABERT-2 auto_map target ("<repo>--" prefix allowed): "" when `value` is none of its
// classes, else the class without the prefix.
std::string dnabert2_target(const json& value) {
  static const std::set<std::string> known = {
      "configuration_bert.BertConfig", "bert_layers.BertModel", "bert_layers.BertForMaskedLM",
      "bert_layers.BertForSequenceClassification"};
  if (!value.is_string()) return "";
  std::string ref = value.get<std::string>();
  if (const auto sep = ref.find("--"); sep != std::string::npos) ref = ref.substr(sep + 2);
  return known.count(ref) ? ref : "";
}

bool is_dnabert2_auto_map(const json& auto_map) {
  if (!auto_map.is_object() || auto_map.empty()) return false;
  bool has_config = false;
  for (const auto& [key, value] : auto_map.items()) {
    const std::string ref = dnabert2_target(value);
    if (ref.empty()) return false;
    has_config = has_config || ref == "configuration_bert.BertConfig";
  }
  return has_config;
}

// At most `n` names of `names`, then how many more: a bounded message.
std::string some_names(const std::vector<std::string>& names, size_t n = 10) {
  std::vector<std::string> head;
  for (size_t i = 0; i < names.size() && i < n; ++i) head.push_back(clip_for_message(names[i]));
  std::string out = fmt::format("{}", fmt::join(head, ", "));
  if (names.size() > n) out += fmt::format(" and {} more", names.size() - n);
  return out;
}

// `c[key]`, when present and not null, must be `wanted`; else Error(kUsage) saying `what`.
void expect_value(const json& c, const std::string& path, const char* key, const json& wanted,
                  const char* what) {
  if (!c.contains(key) || c[key].is_null()) return;
  DNALLM_CHECK(c[key] == wanted, ExitCode::kUsage, "{}: {} = {} is not supported: {}", path, key,
               clip_for_message(c[key].dump()), what);
}

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

// Llama: multi-head or grouped-query attention (num_key_value_heads, checked with the other
// sizes by check_model_shape) and the standard MLP.
void check_llama_config(const json& c, const std::string& path) {
  const auto heads = c.value("num_attention_heads", int64_t{0});
  if (c.contains("head_dim") && !c["head_dim"].is_null() && heads > 0) {
    DNALLM_CHECK(c["head_dim"] == c.value("hidden_size", int64_t{0}) / heads, ExitCode::kUsage,
                 "{}: head_dim = {} is not supported: supported is hidden_size / "
                 "num_attention_heads",
                 path, c["head_dim"].dump());
  }
  expect_value(c, path, "mlp_bias", false, "supported is false");
  expect_value(c, path, "pretraining_tp", 1, "supported is 1");
}

// Note [Rotary config]: where a config.json says the rotary base and the rotating share of
// each head (Note [Rotary variants] in positions.cpp), read as transformers reads them. Several
// keys say the same thing, written by different transformers versions:
//   base:     rope_parameters.rope_theta (transformers 5), rope_theta (Llama), rotary_emb_base
//             (GPT-NeoX);
//   fraction: rope_parameters.partial_rotary_factor (5), rotary_pct (GPT-NeoX),
//             partial_rotary_factor.
// transformers 5 reads, for gpt_neox, rope_parameters first, else rotary_emb_base (10000) and
// rotary_pct (0.25: GPTNeoXConfig's default, as in transformers 4); for llama rope_parameters,
// else rope_theta (10000), and the whole head (its rotary ignores partial_rotary_factor);
// ESM's rotary is base 10000 over the whole head whatever the file says. Every such key present
// must agree with the value read: a file whose keys disagree would compute differently under
// another transformers version, and one asking a model type for what its code ignores (ESM with
// rope_theta 500000, Llama with a partial rotary) was not made by that code: both are refused.
struct RotaryConfig {
  double theta = 10000.0;
  double fraction = 1.0;
};

RotaryConfig read_rotary_config(const json& c, const std::string& path,
                                const std::string& model_type) {
  DNALLM_CHECK(c.value("rope_scaling", json()).is_null(), ExitCode::kUsage,
               "{}: rope_scaling = {} is not supported (unscaled rotary only)", path,
               clip_for_message(c["rope_scaling"].dump()));
  json rp = c.value("rope_parameters", json());
  DNALLM_CHECK(rp.is_null() || rp.is_object(), ExitCode::kUsage,
               "{}: rope_parameters = {} is not supported: supported is an object with "
               "rope_theta, partial_rotary_factor and rope_type",
               path, clip_for_message(rp.dump()));
  if (rp.is_null()) rp = json::object();
  for (const auto& [key, value] : rp.items()) {
    DNALLM_CHECK(key == "rope_theta" || key == "rope_type" || key == "partial_rotary_factor",
                 ExitCode::kUsage,
                 "{}: rope_parameters.{} is not supported: supported are rope_theta, "
                 "partial_rotary_factor and rope_type = \"default\"",
                 path, clip_for_message(key));
  }
  const std::string rope_type = rp.value("rope_type", std::string("default"));
  DNALLM_CHECK(rope_type == "default", ExitCode::kUsage,
               "{}: rope_parameters.rope_type = \"{}\" is not supported: supported is "
               "\"default\"",
               path, clip_for_message(rope_type));
  const bool neox = model_type == "gpt_neox", llama = model_type == "llama";
  // One setting's keys in the order transformers looks at them, each with whether this model
  // type's code reads it: the value is the first present key that is read (else `fallback`),
  // and every present key must equal it.
  struct Key {
    const char* name;  // "rope_parameters.<key>" or a top-level key
    bool read;
  };
  auto agreed = [&](const std::vector<Key>& keys, double fallback, const char* what) {
    std::vector<std::pair<std::string, double>> found;
    std::optional<double> value;
    for (const auto& k : keys) {
      const std::string name = k.name;
      const bool nested = name.rfind("rope_parameters.", 0) == 0;
      const std::string key = nested ? name.substr(std::strlen("rope_parameters.")) : name;
      const json& holder = nested ? rp : c;
      if (!holder.contains(key) || holder[key].is_null()) continue;
      DNALLM_CHECK(holder[key].is_number(), ExitCode::kUsage, "{}: {} = {} is not a number", path,
                   name, clip_for_message(holder[key].dump()));
      found.emplace_back(name, holder[key].get<double>());
      if (k.read && !value) value = found.back().second;
    }
    for (const auto& [name, v] : found) {
      DNALLM_CHECK(v == value.value_or(fallback), ExitCode::kUsage,
                   "{}: {} = {} is not supported: {} reads {} = {} (keys that disagree compute "
                   "differently under other transformers versions, and a value the model "
                   "type's code ignores was not made by it: make them equal)",
                   path, name, v, model_type, what, value.value_or(fallback));
    }
    return value.value_or(fallback);
  };
  RotaryConfig r;
  r.theta = agreed({{"rope_parameters.rope_theta", neox || llama},
                    {"rotary_emb_base", neox},
                    {"rope_theta", llama}},
                   10000.0, "the rotary base");
  // GPTNeoXConfig's default rotary_pct is 0.25 (transformers 4 and 5).
  r.fraction = agreed({{"rope_parameters.partial_rotary_factor", neox},
                       {"rotary_pct", neox},
                       {"partial_rotary_factor", false}},
                      neox ? 0.25 : 1.0, "the rotating share of each head");
  return r;
}

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

// HF parameter name -> ours: old LayerNorm spellings (gamma, beta) first, then the family's
// table read backwards (hf_names.hpp; hf_export.cpp reads it forwards).
std::string rename(const std::string& model_type, std::string name) {
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends(".gamma")) name.replace(name.size() - 6, 6, ".weight");
  if (ends(".beta")) name.replace(name.size() - 5, 5, ".bias");
  return hf_names::translate(name, hf_names::rules(model_type), /*to_theirs=*/false);
}

std::string shape_of(const Tensor& t) { return fmt::format("{}", fmt::join(t.sizes(), "x")); }

using Shape = std::vector<int64_t>;
std::string shape_text(const Shape& s) { return fmt::format("{}", fmt::join(s, "x")); }

// Note [Remote code]: auto_map names a repository's own Python classes (trust_remote_code),
// which are never run here. Accepted are only the targets whose code was read and whose function
// this import computes: the Nucleotide Transformer v2 / AgroNT repositories' (InstaDeepAI on the
// Hugging Face hub) esm_config.EsmConfig and modeling_esm.EsmFor*: transformers' ESM (model_type
// "esm") with a SwiGLU feed-forward, intermediate.dense [2 x intermediate_size, hidden] giving
// silu(first half) * second half, biases only with add_bias_fnn, and an
// embeddings.position_embeddings table that rotary models carry without reading it.
const std::map<std::string, std::string>& nt_v2_auto_map() {
  static const std::map<std::string, std::string> targets = {
      {"AutoConfig", "esm_config.EsmConfig"},
      {"AutoModelForMaskedLM", "modeling_esm.EsmForMaskedLM"},
      {"AutoModelForSequenceClassification", "modeling_esm.EsmForSequenceClassification"},
      {"AutoModelForTokenClassification", "modeling_esm.EsmForTokenClassification"}};
  return targets;
}

// True for a config.json of the Nucleotide Transformer v2 remote code (checked by read_auto_map).
bool nt_v2_remote_code(const json& c) {
  return c.contains("auto_map") && c["auto_map"].is_object() &&
         c["auto_map"].value("AutoConfig", json()) == "esm_config.EsmConfig";
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

// gpt_neox's fused query_key_value, per head rows [head][q|k|v][head_dim]: split into our
// query, key and value tensors.
void split_fused_qkv(const std::string& weights_path, const std::string& hf_name,
                     const Shape& shape, HfCheckpoint& h) {
  const ModelOptions& o = h.options;
  const bool is_weight =
      hf_name.size() > 7 && hf_name.compare(hf_name.size() - 7, 7, ".weight") == 0;
  DNALLM_CHECK(shape.size() == (is_weight ? 2u : 1u) && shape[0] == 3 * o.hidden &&
                   (!is_weight || shape[1] == o.hidden),
               ExitCode::kUsage, "{}: {} has shape {} but config.json implies {}x{}", weights_path,
               hf_name, shape_text(shape), 3 * o.hidden, o.hidden);
  const std::string prefix = rename(h.model_type, hf_name.substr(0, hf_name.find(".attention.")));
  const char* parts[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    HfTensorSource source{hf_name, i,
                          3,       /*per_head_qkv=*/true,
                          "",      is_weight ? Shape{o.hidden, o.hidden} : Shape{o.hidden}};
    h.tensors[prefix + ".attention.self." + parts[i] + (is_weight ? ".weight" : ".bias")] = source;
  }
}

// Row block `part` of `parts` of the file's `hf_name` (dimension 0) as our `ours`.
void add_row_block(HfCheckpoint& h, const std::string& ours, const std::string& hf_name,
                   const Shape& shape, int64_t part, int64_t parts) {
  Shape mine = shape;
  mine[0] /= parts;
  h.tensors[ours] = HfTensorSource{hf_name, part, parts, false, "", mine};
}

// DNABERT-2's fused tensors (Note [DNABERT-2 import]): Wqkv [3 x hidden, hidden] and its bias
// split into query, key and value (row blocks in that order); gated_layers [2 x ffn, hidden]
// into the gate (first half, through GELU) and the up projection (second half). Returns false
// for any other tensor.
bool split_dnabert2_fused(const std::string& weights_path, const std::string& hf_name,
                          const Shape& t, HfCheckpoint& h) {
  const ModelOptions& o = h.options;
  auto ends = [&](const std::string& s) {
    return hf_name.size() >= s.size() &&
           hf_name.compare(hf_name.size() - s.size(), s.size(), s) == 0;
  };
  const std::string layer = hf_name.substr(0, hf_name.find(".attention.") < hf_name.find(".mlp.")
                                                  ? hf_name.find(".attention.")
                                                  : hf_name.find(".mlp."));
  if (ends(".attention.self.Wqkv.weight") || ends(".attention.self.Wqkv.bias")) {
    const bool is_weight = ends(".weight");
    DNALLM_CHECK(t.size() == (is_weight ? 2u : 1u) && t[0] == 3 * o.hidden &&
                     (!is_weight || t[1] == o.hidden),
                 ExitCode::kUsage, "{}: {} has shape {} but config.json implies {}x{}",
                 weights_path, hf_name, shape_text(t), 3 * o.hidden, o.hidden);
    const char* names[] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) {
      add_row_block(h, layer + ".attention.self." + names[i] + (is_weight ? ".weight" : ".bias"),
                    hf_name, t, i, 3);
    }
    return true;
  }
  if (ends(".mlp.gated_layers.weight")) {
    DNALLM_CHECK(t.size() == 2 && t[0] == 2 * o.ffn && t[1] == o.hidden, ExitCode::kUsage,
                 "{}: {} has shape {} but config.json implies {}x{}", weights_path, hf_name,
                 shape_text(t), 2 * o.ffn, o.hidden);
    add_row_block(h, layer + ".intermediate.gate.weight", hf_name, t, 0, 2);
    add_row_block(h, layer + ".intermediate.dense.weight", hf_name, t, 1, 2);
    return true;
  }
  return false;
}

// Nucleotide Transformer v2's intermediate.dense [2 x ffn, hidden] (Note [Remote code]): the
// first half is the SiLU-gated one (our intermediate.gate), the second our intermediate.dense.
void split_gated_dense(const std::string& weights_path, const std::string& hf_name, const Shape& t,
                       HfCheckpoint& h) {
  const int64_t f = h.options.ffn;
  DNALLM_CHECK(!t.empty() && t[0] == 2 * f, ExitCode::kUsage,
               "{}: {} has shape {} but config.json implies {} rows (2 x intermediate_size)",
               weights_path, hf_name, shape_text(t), 2 * f);
  std::string dense = rename(h.model_type, hf_name), gate = dense;
  const std::string part = ".intermediate.dense.";
  gate.replace(gate.find(part), part.size(), ".intermediate.gate.");
  add_row_block(h, gate, hf_name, t, 0, 2);
  add_row_block(h, dense, hf_name, t, 1, 2);
}

// A stored rotary frequency table must be the base-10000 one this import computes.
void check_rotary_table(const std::string& weights_path, const std::string& hf_name,
                        const Tensor& t, const ModelOptions& o) {
  const int64_t hd = o.hidden / o.heads;
  auto expected = torch::pow(10000.0, -torch::arange(0, hd, 2, torch::kFloat64) / double(hd));
  DNALLM_CHECK(o.rotary && t.numel() == expected.numel() &&
                   torch::allclose(t.to(torch::kFloat64).flatten(), expected, 1e-6, 0),
               ExitCode::kUsage,
               "{}: {} is not the base-10000 rotary frequency table this import computes",
               weights_path, hf_name);
}

// Buffers that hold nothing to load: the rotary table we compute (base 10000, checked where
// stored as rotary_embeddings.inv_freq) and gpt_neox's old causal-mask buffers.
bool is_computed_buffer(const std::string& model_type, const std::string& hf_name) {
  if (hf_name.find("rotary_emb.inv_freq") != std::string::npos) return true;
  return model_type == "gpt_neox" && (hf_name.find(".attention.bias") != std::string::npos ||
                                      hf_name.find(".attention.masked_bias") != std::string::npos);
}

// Note [pytorch_model.bin]: DNABERT-2's hub repository ships only a torch.save pickle of its
// state dict, read by our state-dict unpickler (torch_pickle.hpp, which builds tensors and
// containers and nothing else); read for DNABERT-2 directories only, when they hold no
// model.safetensors. Weights that are NaN or infinite are a damaged file, as in safetensors.
std::map<std::string, Tensor> load_weights(const std::string& path) {
  const bool pickle = path.size() > 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
  if (!pickle) return load_safetensors(path);
  auto weights = load_torch_state_dict(path);
  for (const auto& [name, t] : weights) {
    DNALLM_CHECK(!t.is_floating_point() || t.numel() == 0 || torch::isfinite(t).all().item<bool>(),
                 ExitCode::kCheckpointCorrupt,
                 "{}: tensor {} holds NaN or infinite values: the file is damaged; re-download it",
                 path, clip_for_message(name));
  }
  return weights;
}

}  // namespace

// Note [Lazy Hugging Face import]: the file's header (names, shapes) at once, a tensor's data
// when it is read; the last tensor read is kept, so a fused tensor's parts cost one read.
class HfWeightsFile {
 public:
  explicit HfWeightsFile(const std::string& path) : path_(path) {
    if (path.size() > 4 && path.compare(path.size() - 4, 4, ".bin") == 0) {
      pickled_ = load_weights(path);  // Note [pytorch_model.bin]: whole, checked
      for (const auto& [name, t] : pickled_) shapes_.emplace(name, t.sizes().vec());
      return;
    }
    reader_.emplace(path);  // the header checked (Note [Untrusted files])
    for (const auto& [name, e] : reader_->file().tensors) {
      shapes_.emplace(name, Shape(e.spec.shape.begin(), e.spec.shape.end()));
    }
  }
  const std::string& path() const { return path_; }
  const std::map<std::string, Shape>& shapes() const { return shapes_; }

  // The file's tensor `name` as fp32 (NaN or infinite: exit 5).
  Tensor read(const std::string& name) {
    if (name == last_name_) return last_;
    Tensor t;
    if (reader_) {
      const auto& tensors = reader_->file().tensors;
      auto it = tensors.find(name);
      DNALLM_CHECK(it != tensors.end(), ExitCode::kFailure, "{}: no tensor {}", path_, name);
      t = read_finite_tensor(*reader_, it->second, path_, name);
    } else {
      t = pickled_.at(name).to(torch::kFloat32);
    }
    last_name_ = name;
    last_ = t;
    return t;
  }

 private:
  std::string path_;
  std::optional<checkpoint::SafetensorsReader> reader_;
  std::map<std::string, Tensor> pickled_;
  std::map<std::string, Shape> shapes_;
  std::string last_name_;
  Tensor last_;
};

Tensor HfCheckpoint::read(const std::string& name) const {
  auto it = tensors.find(name);
  DNALLM_CHECK(it != tensors.end(), ExitCode::kFailure, "{}: no tensor {} (our name)", dir, name);
  const HfTensorSource& s = it->second;
  Tensor t = file->read(s.name);
  if (s.per_head_qkv) {  // [head][q|k|v][head_dim](, hidden)
    const int64_t heads = options.heads, hd = options.hidden / options.heads;
    t = (t.dim() == 2 ? t.view({heads, 3, hd, t.size(1)}) : t.view({heads, 3, hd}))
            .select(1, s.part)
            .reshape(s.shape);
  } else if (s.parts > 1) {
    t = t.chunk(s.parts, 0)[size_t(s.part)];
  }
  t = t.contiguous();
  if (!s.plus_row0.empty()) t = t + file->read(s.plus_row0)[0];
  return t;
}

namespace {

// Every tensor of the weights file mapped onto our names (Note [Lazy Hugging Face import]);
// the token-type table's name goes to `token_type` (folded afterwards), other tasks' tensors
// are logged and skipped.
void map_tensors(const std::string& weights_path, HfCheckpoint& h, std::string& token_type) {
  std::vector<std::string> skipped;
  const bool nt_v2 = h.model_type == "esm" && h.options.gated_mlp;  // Note [Remote code]
  for (const auto& [hf_name, t] : h.file->shapes()) {
    if (hf_name.rfind("esm.contact_head.", 0) == 0) {  // contact prediction: another task
      skipped.push_back(hf_name);
    } else if (nt_v2 && h.options.rotary &&
               hf_name == "esm.embeddings.position_embeddings.weight") {
      skipped.push_back(hf_name);  // built by the remote EsmEmbeddings, read only when absolute
    } else if (nt_v2 && hf_name.find(".intermediate.dense.") != std::string::npos) {
      split_gated_dense(weights_path, hf_name, t, h);
    } else if (hf_name.find("rotary_embeddings.inv_freq") != std::string::npos) {
      check_rotary_table(weights_path, hf_name, h.file->read(hf_name), h.options);
    } else if (h.model_type == "dnabert2" && split_dnabert2_fused(weights_path, hf_name, t, h)) {
      // (Note [DNABERT-2 import]: its token-type table is a parameter of ours, below)
    } else if (hf_name.find("token_type_embeddings") != std::string::npos &&
               h.model_type != "dnabert2") {
      DNALLM_CHECK(t.size() == 2 && t[1] == h.options.hidden, ExitCode::kUsage,
                   "{}: {} has shape {} but config.json implies rows of {}", weights_path, hf_name,
                   shape_text(t), h.options.hidden);
      token_type = hf_name;
    } else if (h.model_type == "gpt_neox" &&
               hf_name.find(".attention.query_key_value.") != std::string::npos) {
      split_fused_qkv(weights_path, hf_name, t, h);
    } else if (!is_computed_buffer(h.model_type, hf_name)) {
      h.tensors[rename(h.model_type, hf_name)] = HfTensorSource{hf_name, 0, 1, false, "", t};
    }
  }
  if (!skipped.empty()) {
    spdlog::info("{}: not part of the {} model, not loaded: {}", weights_path, h.architecture,
                 fmt::join(skipped, ", "));
  }
}

// Folds token-type row 0 into the positions and drops stored copies of tied tensors.
// (The root's tensors are read here: a few rows of the vocabulary's size.)
void fold_and_untie(const std::string& weights_path, const std::string& token_type,
                    HfCheckpoint& h) {
  // Fold token-type row 0 (every token is segment 0) into the learned positions.
  if (!token_type.empty()) {
    auto it = h.tensors.find("bert.embeddings.position_embeddings.weight");
    DNALLM_CHECK(it != h.tensors.end(), ExitCode::kUsage,
                 "{}: token_type_embeddings without position_embeddings", weights_path);
    it->second.plus_row0 = token_type;
  }
  // Tied decoders: a stored copy must equal the embedding it is tied to.
  for (const char* tied : {"cls.predictions.decoder.weight", "lm_head.weight"}) {
    auto it = h.tensors.find(tied);
    if (it == h.tensors.end() || !h.options.tie_embeddings) continue;
    const std::string emb = h.options.arch == Arch::kBert ? "bert.embeddings.word_embeddings.weight"
                                                          : "gpt.embeddings.word_embeddings.weight";
    DNALLM_CHECK(h.tensors.count(emb) && h.tensors.at(emb).shape == it->second.shape &&
                     torch::equal(h.read(emb), h.read(tied)),
                 ExitCode::kUsage,
                 "{}: {} differs from the word embeddings although tie_word_embeddings is true",
                 weights_path, tied);
    h.tensors.erase(it);
  }
  if (auto it = h.tensors.find("cls.predictions.decoder.bias"); it != h.tensors.end()) {
    DNALLM_CHECK(h.tensors.count("cls.predictions.bias") &&
                     h.tensors.at("cls.predictions.bias").shape == it->second.shape &&
                     torch::equal(h.read("cls.predictions.bias"), h.read(it->first)),
                 ExitCode::kUsage, "{}: lm_head.decoder.bias differs from lm_head.bias",
                 weights_path);
    h.tensors.erase(it);
  }
}

// Records the names and shapes of the blocks a model builds (and nothing else).
class ShapeSink final : public BlockSink {
 public:
  void block_built(size_t, const std::string& path, torch::nn::Module& block) override {
    path_ = path;
    for (const auto& p : block.named_parameters())
      shapes_.emplace_back(p.key(), p.value().sizes().vec());
  }
  std::string path_;
  std::vector<std::pair<std::string, Shape>> shapes_;
};

// Every name and shape of the model `o` describes, from a one-layer model: the root's, and
// the one block's repeated under each layer's prefix (ours end "<index>.").
std::map<std::string, Shape> model_shapes(const ModelOptions& o) {
  ModelOptions one = o;
  one.layers = std::min<int64_t>(o.layers, 1);
  ShapeSink sink;
  TransformerLM probe(nullptr);
  {
    StreamedBuild streamed(&sink);
    probe = TransformerLM(one);
  }
  std::map<std::string, Shape> out;
  for (auto& [name, p] : probe->named_weights()) {
    if (sink.path_.empty() || name.rfind(sink.path_, 0) != 0) out.emplace(name, p.sizes().vec());
  }
  if (o.layers == 0) return out;
  DNALLM_CHECK(sink.path_.size() > 2 && sink.path_.compare(sink.path_.size() - 2, 2, "0.") == 0,
               ExitCode::kFailure, "block prefix {} does not end with its index", sink.path_);
  const std::string stem = sink.path_.substr(0, sink.path_.size() - 2);
  for (int64_t i = 0; i < o.layers; ++i) {
    for (const auto& [name, shape] : sink.shapes_) {
      out.emplace(stem + std::to_string(i) + "." + name, shape);
    }
  }
  return out;
}

// Every mapped tensor must be a parameter of the model, with its shape, and every parameter
// must be there.
void check_against_model(const std::string& weights_path, const HfCheckpoint& h) {
  const std::map<std::string, Shape> ours = model_shapes(h.options);
  std::vector<std::string> unused;
  for (const auto& [name, t] : h.tensors) {
    auto it = ours.find(name);
    if (it == ours.end()) {
      unused.push_back(name);
      continue;
    }
    DNALLM_CHECK(it->second == t.shape, ExitCode::kUsage,
                 "{}: {} has shape {} but config.json implies {}", weights_path, name,
                 shape_text(t.shape), shape_text(it->second));
  }
  DNALLM_CHECK(unused.empty(), ExitCode::kUsage,
               "{}: tensors not used by the {} import (the model they belong to computes "
               "something this import does not): {} (our names); {}",
               weights_path, h.architecture, some_names(unused), kSupported);
  std::vector<std::string> missing;
  for (const auto& [name, p] : ours) {
    if (!h.tensors.count(name)) missing.push_back(name);
  }
  DNALLM_CHECK(missing.empty(), ExitCode::kUsage,
               "{}: {} needs tensors the file lacks: {} (our names)", weights_path, h.architecture,
               some_names(missing));
}

}  // namespace

bool is_transformer_hf_config(const json& c) {
  if (nt_v2_remote_code(c)) return true;
  const auto type = c.value("model_type", std::string());
  return type == "bert" || type == "esm" || type == "roberta-prelayernorm" || type == "gpt_neox" ||
         type == "llama";
}

bool is_hf_model_dir(const std::string& dir) {
  try {  // (a file that cannot be read is reported by whoever reads it next)
    const auto c = json::parse(
        read_bounded_file(dir + "/config.json", kMaxConfigFileBytes, ExitCode::kUsage, "config"));
    return c.is_object() && (c.contains("model_type") || nt_v2_remote_code(c)) &&
           !c.contains("dnallm_arch");
  } catch (const std::exception&) {
    return false;
  }
}

HfCheckpoint read_hf_checkpoint(const std::string& dir) {
  const std::string path = dir + "/config.json";
  const json c = read_directory_json(
      path, "a Hugging Face model directory holds config.json and model.safetensors");
  HfCheckpoint h;
  h.dir = dir;
  try {
    read_model_class(c, path, h);
    check_config(c, path, h.model_type);
    set_arch_and_task(c, path, h, h.options);
    set_common_options(c, path, h.options);
    set_model_type_options(c, path, h.model_type, h.options);
  } catch (const json::exception& e) {  // a value of the wrong JSON type
    fail(ExitCode::kUsage, "{}: a value has the wrong type ({}): repair or re-download the file",
         path, clip_for_message(e.what(), 200));
  }
  check_model_shape(h.options, path);  // Note [Model shape limits], before any allocation

  std::string weights_path = dir + "/model.safetensors";
  std::error_code ec;
  if (h.model_type == "dnabert2" && !std::filesystem::exists(weights_path, ec) &&
      std::filesystem::exists(dir + "/pytorch_model.bin", ec)) {
    weights_path = dir + "/pytorch_model.bin";  // Note [pytorch_model.bin]
  }
  DNALLM_CHECK(
      std::filesystem::symlink_status(weights_path, ec).type() !=
          std::filesystem::file_type::not_found,
      ExitCode::kUsage,
      "{} not found{}: save the model with safe_serialization (model.safetensors); "
      "sharded and .bin checkpoints are not read",
      weights_path,
      std::filesystem::exists(dir + "/pytorch_model.bin", ec) ? " (pytorch_model.bin is)" : "");
  h.file = std::make_shared<HfWeightsFile>(weights_path);
  std::string token_type;
  map_tensors(weights_path, h, token_type);
  fold_and_untie(weights_path, token_type, h);
  check_against_model(weights_path, h);
  return h;
}

TransformerLM build_hf_model(const HfCheckpoint& h) {
  TransformerLM model(h.options);
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_weights()) p.copy_(h.read(name));
  model->eval();
  return model;
}

PeftAdapter read_peft_adapter(const std::string& adapter_dir, const HfCheckpoint& base) {
  const std::string path = adapter_dir + "/adapter_config.json";
  const json c = read_directory_json(
      path, "a PEFT adapter directory holds adapter_config.json and adapter_model.safetensors");
  auto expect = [&](const char* key, const json& wanted, const char* what) {
    expect_value(c, path, key, wanted, what);
  };
  DNALLM_CHECK(c.value("peft_type", std::string()) == "LORA", ExitCode::kUsage,
               "{}: peft_type = {} is not supported: supported is \"LORA\"", path,
               c.value("peft_type", json()).dump());
  expect("use_dora", false, "DoRA is not supported");
  expect("use_rslora", false, "rsLoRA scaling is not supported");
  expect("fan_in_fan_out", false, "supported is false (nn.Linear layout)");
  expect("bias", "none", "supported is \"none\"");
  expect("lora_bias", false, "supported is false");
  expect("rank_pattern", json::object(), "per-module ranks are not supported");
  expect("alpha_pattern", json::object(), "per-module alphas are not supported");
  expect("layers_to_transform", json(), "supported is every layer (null)");
  expect("layer_replication", json(), "supported is null");
  expect("target_parameters", json(), "supported is null");
  expect("trainable_token_indices", json(), "supported is null");
  PeftAdapter a;
  a.r = c.value("r", int64_t{0});
  a.alpha = c.value("lora_alpha", 8.0);
  a.dropout = c.value("lora_dropout", 0.0);
  DNALLM_CHECK(a.r > 0, ExitCode::kUsage, "{}: r must be > 0", path);
  const auto& targets = c.value("target_modules", json());
  DNALLM_CHECK(targets.is_array(), ExitCode::kUsage,
               "{}: target_modules = {} is not supported: give a list of module names", path,
               targets.dump());
  for (const auto& t : targets) {
    const auto name = t.get<std::string>();
    DNALLM_CHECK(name == "query" || name == "key" || name == "value", ExitCode::kUsage,
                 "{}: target_modules has \"{}\": supported are \"query\", \"key\", \"value\"", path,
                 name);
    a.targets.push_back(name);
  }
  const std::string weights_path = adapter_dir + "/adapter_model.safetensors";
  DNALLM_CHECK(std::filesystem::exists(weights_path), ExitCode::kUsage, "{} not found",
               weights_path);
  const std::string prefix = "base_model.model.";
  for (auto& [name, t] : load_safetensors(weights_path)) {
    DNALLM_CHECK(name.rfind(prefix, 0) == 0, ExitCode::kUsage,
                 "{}: tensor {} does not start with \"{}\"", weights_path, name, prefix);
    std::string rest = name.substr(prefix.size());
    std::string ours;
    for (const char* part : {".lora_A.weight", ".lora_B.weight"}) {
      const auto pos = rest.find(part);
      if (pos != std::string::npos && pos + std::strlen(part) == rest.size()) {
        ours = rename(base.model_type, rest.substr(0, pos) + ".weight");
        ours = ours.substr(0, ours.size() - 7) + std::string(part).substr(0, 7);
      }
    }
    if (ours.empty()) ours = rename(base.model_type, rest);  // modules_to_save
    a.weights[ours] = t.to(torch::kFloat32);
  }
  return a;
}

TransformerLM build_hf_model_with_adapter(const HfCheckpoint& base, const PeftAdapter& a) {
  ModelOptions o = base.options;
  o.lora_r = a.r;
  o.lora_alpha = a.alpha;
  o.lora_dropout = a.dropout;
  o.lora_targets = a.targets;
  TransformerLM model(o);
  std::map<std::string, Tensor> params;
  for (const auto& item : model->named_parameters()) params.emplace(item.key(), item.value());
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_weights()) p.copy_(base.read(name));
  std::set<std::string> adapters_seen;
  for (const auto& [name, t] : a.weights) {
    auto it = params.find(name);
    DNALLM_CHECK(it != params.end(), ExitCode::kUsage,
                 "adapter tensor {} (our name) has no place in the {} base: the adapter was "
                 "made for another model",
                 name, base.architecture);
    DNALLM_CHECK(it->second.sizes() == t.sizes(), ExitCode::kUsage,
                 "adapter tensor {} has shape {} but the base needs {}", name, shape_of(t),
                 shape_of(it->second));
    it->second.copy_(t);
    adapters_seen.insert(name);
  }
  for (const auto& [name, p] : params) {
    const bool lora =
        name.find(".lora_A") != std::string::npos || name.find(".lora_B") != std::string::npos;
    DNALLM_CHECK(!lora || adapters_seen.count(name), ExitCode::kUsage,
                 "the adapter lacks {} (our name) for its target_modules", name);
  }
  model->eval();
  return model;
}

std::vector<int64_t> vocabulary_map(const data::Tokenizer& ours, const data::HfTokenizer& theirs,
                                    const std::string& dir) {
  const auto& sp = theirs.special();
  std::vector<int64_t> map(static_cast<size_t>(ours.vocab_size()), -1);
  for (int64_t id = 0; id < ours.vocab_size(); ++id) {
    int64_t t = -1;
    switch (id) {
      case data::kPadId:
        t = sp.pad;
        break;
      case data::kUnkId:
        t = sp.unk;
        break;
      case data::kClsId:
        t = sp.cls >= 0 ? sp.cls : sp.bos;
        break;
      case data::kSepId:
        t = sp.sep >= 0 ? sp.sep : sp.eos;
        break;
      case data::kMaskId:
        t = sp.mask;
        break;
      default:
        t = theirs.id_of(ours.id_to_piece(id));
        break;
    }
    DNALLM_CHECK(t >= 0 || ours.is_special(id), ExitCode::kUsage,
                 "model.init_from = \"{}\": its vocabulary lacks \"{}\" of [tokenizer]: use the "
                 "tokenizer settings the model was trained with",
                 dir, ours.id_to_piece(id));
    map[static_cast<size_t>(id)] = t;
  }
  return map;
}

namespace {

// The same tokenization as the directory's, else every id would mean another thing.
void check_same_tokenization(const Config& config, const data::Tokenizer& ours,
                             const data::HfTokenizer& theirs, const std::string& dir) {
  using Scheme = data::HfTokenizer::Scheme;
  const bool same_scheme =
      (theirs.scheme() == Scheme::kOverlappingKmer &&
       ours.tokenizer_kind() == cfg::TokenizerKind::kKmer && config.tokenizer.k == theirs.k() &&
       config.tokenizer.stride == 1) ||
      (theirs.scheme() == Scheme::kLongestMatch &&
       ours.tokenizer_kind() == cfg::TokenizerKind::kNt && config.tokenizer.k == theirs.k()) ||
      (theirs.scheme() == Scheme::kCharacter &&
       ours.tokenizer_kind() == cfg::TokenizerKind::kChar) ||
      (theirs.scheme() == Scheme::kBpe && ours.tokenizer_kind() == cfg::TokenizerKind::kHf);
  std::string theirs_text, setting;
  switch (theirs.scheme()) {
    case Scheme::kOverlappingKmer:
      theirs_text = fmt::format("overlapping {}-mers (DNABERT)", theirs.k());
      setting = fmt::format("set tokenizer.kind = \"kmer\", tokenizer.k = {}, tokenizer.stride = 1",
                            theirs.k());
      break;
    case Scheme::kLongestMatch:
      theirs_text = fmt::format("non-overlapping {}-mers with single-base fallback (EsmTokenizer)",
                                theirs.k());
      setting = fmt::format("set tokenizer.kind = \"nt\", tokenizer.k = {}", theirs.k());
      break;
    case Scheme::kCharacter:
      theirs_text = "one token a base";
      setting = "set tokenizer.kind = \"char\"";
      break;
    case Scheme::kBpe:
      theirs_text = fmt::format("with BPE ({} merges in its tokenizer.json)", theirs.bpe_merges());
      setting = "set tokenizer.kind = \"hf\" (its own tokenizer; tokenizer.path empty)";
      break;
  }
  DNALLM_CHECK(same_scheme, ExitCode::kUsage,
               "model.init_from = \"{}\" tokenizes {}; [tokenizer] here is kind = \"{}\": {}", dir,
               theirs_text, ours.kind(), setting);
  if (ours.tokenizer_kind() == cfg::TokenizerKind::kHf) {
    // tokenizer.path may name another directory: its merges must be these.
    const auto own = data::load_hf_bpe_tokenizer(dir)->to_json();
    DNALLM_CHECK(own.at("hf_tokenizer_json") == ours.to_json().at("hf_tokenizer_json"),
                 ExitCode::kUsage,
                 "model.init_from = \"{}\": tokenizer.path names another tokenizer.json than the "
                 "model's: leave tokenizer.path empty to use the model's own",
                 dir);
  }
}

// The architecture from config.json; the task, heads, dropout and LoRA from `config`.
ModelOptions fine_tune_options(const Config& config, const data::Tokenizer& ours,
                               const HfCheckpoint& h) {
  const std::string& dir = config.model.init_from;
  const ModelOptions wanted = model_options_from_config(config, ours.vocab_size());
  const ModelOptions& a = h.options;
  DNALLM_CHECK(wanted.arch == a.arch, ExitCode::kUsage,
               "model.init_from = \"{}\" is a {} ({}): set model.arch = \"{}\"", dir,
               h.architecture, a.arch == Arch::kBert ? "encoder" : "causal LM",
               a.arch == Arch::kBert ? "bert" : "gpt");
  const int64_t usable =
      a.rotary || a.alibi
          ? config.model.max_seq_length
          : a.max_seq_length - (a.position_padding_idx >= 0 ? a.position_padding_idx + 1 : 0);
  DNALLM_CHECK(config.model.max_seq_length <= usable, ExitCode::kUsage,
               "model.max_seq_length = {} exceeds the {} positions of model.init_from = \"{}\": "
               "set model.max_seq_length <= {}",
               config.model.max_seq_length, usable, dir, usable);
  ModelOptions o = a;
  o.task = wanted.task;
  o.num_labels = wanted.num_labels;
  o.mean_pooling = wanted.mean_pooling;
  o.dropout = wanted.dropout;
  o.attn = wanted.attn;
  o.gradient_checkpointing = wanted.gradient_checkpointing;
  o.lora_r = wanted.lora_r;
  o.lora_alpha = wanted.lora_alpha;
  o.lora_dropout = wanted.lora_dropout;
  o.lora_targets = wanted.lora_targets;
  o.vocab_size = ours.vocab_size();
  o.pad_id = data::kPadId;
  if (a.rotary || a.alibi) o.max_seq_length = config.model.max_seq_length;
  if (a.position_padding_idx >= 0) {  // Note [Positions after another pad id]
    o.position_padding_idx = data::kPadId;
    o.max_seq_length = a.max_seq_length - (a.position_padding_idx - data::kPadId);
  }
  return o;
}

// Note [Positions after another pad id]: RoBERTa numbering (roberta-prelayernorm, ESM with
// learned positions: Nucleotide Transformer v1, pad id 1) gives the real tokens positions
// padding_idx + 1, + 2, ... and padding tokens padding_idx, where padding_idx is the pad token's
// id, which it also compares the ids with. Our [PAD] is data::kPadId, so the fine-tuned model
// numbers from kPadId and its table is theirs without the first padding_idx - kPadId rows: row i
// of ours is row i + that shift of theirs (load_hf_weights), the same positions for every token.
int64_t position_shift(const ModelOptions& theirs, const ModelOptions& ours) {
  return theirs.position_padding_idx >= 0 && ours.position_padding_idx >= 0
             ? theirs.position_padding_idx - ours.position_padding_idx
             : 0;
}

// Copies the checkpoint's tensors into a fine-tuned model's parameters (vocabulary rows
// through `map`; a tensor the checkpoint lacks or holds in another shape keeps its fresh
// initialisation), one at a time, and logs what it did.
class HfLoader {
 public:
  HfLoader(const HfCheckpoint& h, const ModelOptions& ours, const std::string& root,
           const std::vector<int64_t>& map, const data::Tokenizer& tokenizer)
      : h_(h),
        map_(map),
        by_vocab_({root + ".embeddings.word_embeddings.weight", "cls.predictions.bias",
                   "cls.predictions.decoder.weight", "lm_head.weight"}),
        positions_(root + ".embeddings.position_embeddings.weight"),
        shift_(position_shift(h.options, ours)) {
    for (size_t id = 0; id < map.size(); ++id) {
      DNALLM_CHECK(map[id] < h.options.vocab_size, ExitCode::kUsage,
                   "model.init_from = \"{}\": token id {} is outside vocab_size {}", h.dir, map[id],
                   h.options.vocab_size);
      if (map[id] < 0) fresh_.push_back(tokenizer.id_to_piece(static_cast<int64_t>(id)));
    }
  }

  void load(const std::string& name, const Tensor& p) {
    torch::NoGradGuard no_grad;
    auto it = h_.tensors.find(name);
    const bool vocab = by_vocab_.count(name) != 0;
    if (it != h_.tensors.end() && name == positions_ && shift_ > 0 &&
        it->second.shape[0] == p.size(0) + shift_) {
      p.copy_(h_.read(name).narrow(0, shift_, p.size(0)));  // Note [Positions after another pad id]
    } else if (it == h_.tensors.end() || (!vocab && it->second.shape != p.sizes().vec())) {
      kept_.push_back(name);  // a new head
      return;
    } else if (vocab) {
      const Tensor theirs = h_.read(name);
      for (size_t id = 0; id < map_.size(); ++id) {
        if (map_[id] >= 0) p[static_cast<int64_t>(id)].copy_(theirs[map_[id]]);
      }
    } else {
      p.copy_(h_.read(name));
    }
    ++loaded_;
  }

  void log() const {
    spdlog::info("initialised {} tensors from the Hugging Face {} in {}{}{}", loaded_,
                 h_.architecture, h_.dir,
                 kept_.empty() ? std::string()
                               : fmt::format("; newly initialised: {}", fmt::join(kept_, ", ")),
                 fresh_.empty()
                     ? std::string()
                     : fmt::format("; tokens without a row there: {}", fmt::join(fresh_, " ")));
  }

 private:
  const HfCheckpoint& h_;
  const std::vector<int64_t>& map_;
  const std::set<std::string> by_vocab_;
  const std::string positions_;
  const int64_t shift_;
  int64_t loaded_ = 0;
  std::vector<std::string> kept_, fresh_;
};

}  // namespace

TransformerLM build_filled(const ModelOptions& options, int64_t lora_r, WeightFormat base,
                           BlockSink* blocks,
                           const std::function<void(const std::string&, const Tensor&)>& fill) {
  ModelOptions lora_options = options;
  lora_options.lora_r = lora_r;
  std::set<const void*> offered;  // the blocks' parameters, given to `fill` as they were built
  QuantizeReport quantized;
  FillingSink filling(blocks, [&](const std::string& prefix, torch::nn::Module& block) {
    for (const auto& p : block.named_parameters()) {
      if (fill) fill(prefix + p.key(), p.value());
      offered.insert(p.value().unsafeGetTensorImpl());
    }
    if (lora_r > 0) enable_block_lora(block, lora_options);
    quantize_block_linears(block, base, quantized);
  });
  TransformerLM model(nullptr);
  {
    StreamedBuild streamed(&filling);
    model = TransformerLM(options);
  }
  if (fill) {
    for (auto& [name, p] : model->named_weights()) {
      if (offered.count(p.unsafeGetTensorImpl()) == 0) fill(name, p);
    }
  }
  if (lora_r > 0) model->enable_lora(lora_r);
  if (quantized.linears > 0) {
    spdlog::info(
        "QLoRA: {} base linears in {} ({:.2f} MB, {:.3f}x bf16)", quantized.linears,
        base == WeightFormat::kNf4 ? "nf4" : "int8", quantized.quantized_bytes / 1e6,
        double(quantized.quantized_bytes) / double(std::max<int64_t>(quantized.bf16_bytes(), 1)));
  }
  return model;
}

WeightFormat qlora_base_format(const Config& config, int64_t lora_r) {
  const auto base = config.lora.quantize_base;
  DNALLM_CHECK(base == cfg::QuantizeBase::kNone || lora_r > 0, ExitCode::kUsage,
               "lora.quantize_base = \"{}\" quantizes the frozen base of a LoRA fine-tune: "
               "set lora.r > 0",
               cfg::spelling(base));
  return weight_format_of(base);
}

ModelOptions hf_fine_tune_options(const Config& config, const data::Tokenizer& ours) {
  return fine_tune_options(config, ours, read_hf_checkpoint(config.model.init_from));
}

TransformerLM init_from_hf(const Config& config, const data::Tokenizer& ours,
                           const BuildContext& context) {
  const std::string& dir = config.model.init_from;
  const HfCheckpoint h = read_hf_checkpoint(dir);
  const auto theirs = data::HfTokenizer::load(dir);
  check_same_tokenization(config, ours, theirs, dir);
  ModelOptions o = fine_tune_options(config, ours, h);
  const int64_t lora_r = o.lora_r;
  o.lora_r = 0;  // LoRA is enabled block by block as the weights are loaded
  const auto map = vocabulary_map(ours, theirs, dir);
  HfLoader loader(h, o, o.arch == Arch::kBert ? "bert" : "gpt", map, ours);  // (root_name())
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  // Note [Lazy Hugging Face import]: each tensor read as it is copied in.
  TransformerLM model =
      build_filled(o, lora_r, qlora_base_format(config, lora_r), context.blocks,
                   [&](const std::string& name, const Tensor& p) { loader.load(name, p); });
  loader.log();
  return model;
}

}  // namespace dnallm::models
