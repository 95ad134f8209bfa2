#include "worker/models/transformer/hf_export.hpp"

#include <filesystem>
#include <map>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/transformer/hf_names.hpp"

namespace dnallm::models {
namespace {

using nlohmann::ordered_json;
using torch::Tensor;

// kNtV2: ESM with the Nucleotide Transformer v2 remote code's SwiGLU (Note [Remote code] in
// hf_import_esm.cpp); config.json names that code in auto_map, as the hub's repositories do.
// kDnabert2: Note [DNABERT-2 export].
enum class Family { kEsm, kBert, kRobertaPreLn, kGptNeoX, kLlama, kNtV2, kDnabert2 };

// The family by norms, MLP, positions and heads (family_of adds the rotary variants).
Family layout_family(const ModelOptions& o) {
  DNALLM_CHECK(!o.mean_pooling || o.task == Task::kPretrain, ExitCode::kUsage,
               "model.pooling = \"mean\" has no transformers equivalent (its classification "
               "heads pool the first token): use pooling = \"cls\" for a Hugging Face export");
  if (o.alibi) {  // Note [DNABERT-2 export]
    DNALLM_CHECK(o.arch == Arch::kBert && o.post_layer_norm && o.embedding_layer_norm &&
                     o.gated_mlp && o.gate_activation == ModelOptions::GateActivation::kGelu &&
                     !o.ffn_in_bias && o.ffn_bias && o.linear_bias && !o.rms_norm &&
                     o.tie_embeddings && !o.mask_embeddings && o.position_padding_idx < 0 &&
                     (o.type_vocab_size == 0 || o.type_vocab_size == 2) &&
                     key_value_heads(o) == o.heads,
                 ExitCode::kUsage,
                 "an ALiBi model exports to transformers only as DNABERT-2, which is an encoder "
                 "with model.post_layer_norm = true, model.mlp = \"geglu\", tied embeddings and "
                 "multi-head attention");
    return Family::kDnabert2;
  }
  // ESM numbers learned positions as RoBERTa does, from its pad id: with our [PAD] as padding_idx
  // the table is in its layout already (a fine-tuned Nucleotide Transformer v1).
  const bool esm_positions =
      o.position_padding_idx < 0 || (o.position_padding_idx == data::kPadId && !o.rotary &&
                                     !o.embedding_layer_norm && !o.post_layer_norm);
  if (o.gated_mlp && !o.rms_norm && o.linear_bias && o.arch == Arch::kBert) {
    DNALLM_CHECK(!o.post_layer_norm && !o.embedding_layer_norm && esm_positions &&
                     key_value_heads(o) == o.heads &&
                     o.gate_activation == ModelOptions::GateActivation::kSilu && o.ffn_in_bias,
                 ExitCode::kUsage,
                 "a gated-MLP encoder exports only as a Nucleotide Transformer v2 (pre-LN ESM, "
                 "no embedding LayerNorm, multi-head attention, SiLU gate)");
    return Family::kNtV2;
  }
  if (o.rms_norm || o.gated_mlp || !o.linear_bias) {
    DNALLM_CHECK(o.rms_norm && o.gated_mlp && !o.linear_bias && o.arch == Arch::kGpt && o.rotary &&
                     o.task == Task::kPretrain &&
                     o.gate_activation == ModelOptions::GateActivation::kSilu,
                 ExitCode::kUsage,
                 "only a causal, rotary model with RMSNorm, gated MLP and no biases (Llama) "
                 "exports as llama");
    return Family::kLlama;
  }
  DNALLM_CHECK(key_value_heads(o) == o.heads, ExitCode::kUsage,
               "grouped-query attention (model.kv_heads = {} < heads = {}) exports only as llama "
               "(RMSNorm, gated MLP, no biases): transformers' {} has no num_key_value_heads",
               key_value_heads(o), o.heads, o.arch == Arch::kGpt ? "gpt_neox" : "esm / bert");
  DNALLM_CHECK(o.ffn_bias, ExitCode::kUsage,
               "feed-forward linears without biases export only as a Nucleotide Transformer v2 "
               "(gated MLP) or llama");
  if (o.arch == Arch::kGpt) {
    DNALLM_CHECK(
        o.rotary && o.task == Task::kPretrain && !o.post_layer_norm && !o.embedding_layer_norm,
        ExitCode::kUsage,
        "a causal model exports to transformers as gpt_neox, which needs rotary "
        "positions (model.position = \"rotary\") and the language-model task");
    return Family::kGptNeoX;
  }
  if (o.post_layer_norm) {
    DNALLM_CHECK(o.embedding_layer_norm && !o.rotary && o.position_padding_idx < 0,
                 ExitCode::kUsage,
                 "a post-LN encoder exports as bert, which has learned positions");
    return Family::kBert;
  }
  if (o.embedding_layer_norm || !esm_positions) {
    DNALLM_CHECK(o.embedding_layer_norm && o.position_padding_idx >= 0 && !o.rotary,
                 ExitCode::kUsage,
                 "this encoder variant (embedding LayerNorm without RoBERTa positions) has no "
                 "transformers equivalent");
    return Family::kRobertaPreLn;
  }
  return Family::kEsm;
}

// How the export reads our weights: LoRA adapters merged into copies (or left out when
// !merge), quantized bases dequantized (their live parameter is empty).
std::map<std::string, ExportedTensor> our_weights(TransformerLM& model, bool merge) {
  const LiveWeights weights(*model, merge);
  std::map<std::string, ExportedTensor> out;
  for (auto& [name, t] : model->named_weights()) out.emplace(name, weights(name, t));
  return out;
}

const char* model_type_of(Family f) {
  switch (f) {
    case Family::kEsm:
    case Family::kNtV2:
      return "esm";
    case Family::kBert:
      return "bert";
    case Family::kRobertaPreLn:
      return "roberta-prelayernorm";
    case Family::kGptNeoX:
      return "gpt_neox";
    case Family::kLlama:
      return "llama";
    case Family::kDnabert2:
      return "dnabert2";  // (config.json says "bert": see common_config)
  }
  return "bert";
}

// Note [Rotary variants], Note [Parallel residual] (positions.cpp, block.cpp): a rotary base other
// than 10000 exports as gpt_neox (rotary_emb_base) or llama (rope_theta); a partial rotary and the
// parallel residual as gpt_neox (rotary_pct, use_parallel_residual) only.
Family family_of(const ModelOptions& o) {
  const Family f = layout_family(o);
  const ModelOptions defaults;
  DNALLM_CHECK(!o.rotary || o.rope_theta == defaults.rope_theta || f == Family::kGptNeoX ||
                   f == Family::kLlama,
               ExitCode::kUsage,
               "a rotary base (rope_theta) of {} exports only as gpt_neox or llama: this model "
               "exports as {}, whose rotary base is 10000",
               o.rope_theta, model_type_of(f));
  DNALLM_CHECK(!o.rotary || o.rotary_fraction == defaults.rotary_fraction || f == Family::kGptNeoX,
               ExitCode::kUsage,
               "a partial rotary ({} of each head) exports only as gpt_neox (rotary_pct): this "
               "model exports as {}, which rotates the whole head",
               o.rotary_fraction, model_type_of(f));
  DNALLM_CHECK(!o.parallel_residual || f == Family::kGptNeoX, ExitCode::kUsage,
               "the parallel residual exports only as gpt_neox (use_parallel_residual): this "
               "model exports as {}",
               model_type_of(f));
  return f;
}

// Our parameter name -> the family's (hf_names.hpp; hf_import's rename() reads it backwards).
std::string hf_name(Family f, const std::string& ours) {
  return hf_names::translate(ours, hf_names::rules(model_type_of(f)), /*to_theirs=*/true);
}

ordered_json labels(int64_t n) {
  ordered_json id2label = ordered_json::object(), label2id = ordered_json::object();
  for (int64_t i = 0; i < n; ++i) {
    id2label[std::to_string(i)] = "LABEL_" + std::to_string(i);
    label2id["LABEL_" + std::to_string(i)] = i;
  }
  return {id2label, label2id};
}

}  // namespace

namespace {

using NamedTensors = std::vector<ExportedTensor>;

// A table of zeros (a tensor their layout has and ours does not).
ExportedTensor zeros_tensor(const std::string& name, std::vector<int64_t> shape) {
  return computed_tensor(name, shape, [shape] { return torch::zeros(shape); });
}

// architectures, model_type and the fields every family's config.json has.
ordered_json common_config(Family f, const ModelOptions& o) {
  ordered_json c;
  const char* task_suffix = o.task == Task::kPretrain ? "ForMaskedLM" : "ForSequenceClassification";
  switch (f) {
    case Family::kEsm:
    case Family::kNtV2:
      c["architectures"] = {std::string("Esm") + task_suffix};
      break;
    case Family::kBert:
    case Family::kDnabert2:
      c["architectures"] = {std::string("Bert") + task_suffix};
      break;
    case Family::kRobertaPreLn:
      c["architectures"] = {std::string("RobertaPreLayerNorm") + task_suffix};
      break;
    case Family::kGptNeoX:
      c["architectures"] = {"GPTNeoXForCausalLM"};
      break;
    case Family::kLlama:
      c["architectures"] = {"LlamaForCausalLM"};
      break;
  }
  c["model_type"] = f == Family::kDnabert2 ? "bert" : model_type_of(f);
  c["vocab_size"] = o.vocab_size;
  c["hidden_size"] = o.hidden;
  c["num_hidden_layers"] = o.layers;
  c["num_attention_heads"] = o.heads;
  c["intermediate_size"] = o.ffn;
  c["hidden_act"] = f == Family::kLlama ? "silu" : "gelu";
  c[f == Family::kLlama ? "rms_norm_eps" : "layer_norm_eps"] = o.layer_norm_eps;
  c["pad_token_id"] = data::kPadId;
  const bool causal = f == Family::kGptNeoX || f == Family::kLlama;
  c["tie_word_embeddings"] = o.tie_embeddings && !causal;
  if (o.task == Task::kClassification) {
    auto l = labels(o.num_labels);
    c["id2label"] = l[0];
    c["label2id"] = l[1];
  }
  if (o.task == Task::kRegression) {
    c["id2label"] = labels(1)[0];
    c["label2id"] = labels(1)[1];
    c["problem_type"] = "regression";
  }
  return c;
}

// The encoder families' config fields and the tensors they have that we do not (ESM's contact
// head, the zero token-type table). Returns how far their learned positions are shifted:
// ours count from 0; ESM and RoBERTa from padding_idx + 1.
int64_t add_encoder_config(Family f, const ModelOptions& o, ordered_json& c, NamedTensors& out) {
  int64_t position_offset = 0;
  if (f == Family::kNtV2) {  // Note [Remote code] in hf_import_esm.cpp
    c["auto_map"] = {
        {"AutoConfig", "esm_config.EsmConfig"},
        {"AutoModelForMaskedLM", "modeling_esm.EsmForMaskedLM"},
        {"AutoModelForSequenceClassification", "modeling_esm.EsmForSequenceClassification"},
        {"AutoModelForTokenClassification", "modeling_esm.EsmForTokenClassification"}};
    c["add_bias_fnn"] = o.ffn_bias;
    if (o.rotary) {  // its EsmEmbeddings always has the table; rotary models never read it
      out.push_back(
          zeros_tensor("esm.embeddings.position_embeddings.weight", {o.max_seq_length, o.hidden}));
    }
  }
  if (f == Family::kEsm || f == Family::kNtV2) {
    c["position_embedding_type"] = o.rotary ? "rotary" : "absolute";
    c["mask_token_id"] = data::kMaskId;
    c["token_dropout"] = false;
    c["emb_layer_norm_before"] = false;
    c["hidden_dropout_prob"] = 0.0;
    c["attention_probs_dropout_prob"] = 0.0;
    if (!o.rotary && o.position_padding_idx < 0) position_offset = data::kPadId + 1;
    c["max_position_embeddings"] = o.max_seq_length + position_offset;
    c["is_folding_model"] = false;
    // EsmModel always has a contact head (attention maps -> contacts): zeros, unused by LM/cls.
    out.push_back(zeros_tensor("esm.contact_head.regression.weight", {1, o.layers * o.heads}));
    out.push_back(zeros_tensor("esm.contact_head.regression.bias", {1}));
    if (o.rotary) {
      // The rotary table is a persistent buffer of EsmModel: transformers saves it (per layer,
      // where 4.x keeps it; 5.x moves it to esm.rotary_embeddings on load) and reports it as
      // newly initialised when a file lacks it. Computed as transformers does, in fp32.
      const int64_t head_dim = o.hidden / o.heads;
      const auto inv_freq = [head_dim] {
        return 1.0 / torch::pow(10000.0,
                                torch::arange(0, head_dim, 2, torch::kFloat32) / double(head_dim));
      };
      for (int64_t i = 0; i < o.layers; ++i) {
        out.push_back(computed_tensor(
            "esm.encoder.layer." + std::to_string(i) + ".attention.self.rotary_embeddings.inv_freq",
            {(head_dim + 1) / 2}, inv_freq));
      }
    }
    return position_offset;
  }
  c["position_embedding_type"] = "absolute";
  c["max_position_embeddings"] = o.max_seq_length;
  c["hidden_dropout_prob"] = 0.0;
  c["attention_probs_dropout_prob"] = 0.0;
  // An imported model's token-type table is a parameter (Note [Token-type table], exported with
  // the others); a model of ours has none, and transformers' needs one: zeros.
  c["type_vocab_size"] = o.type_vocab_size > 0 ? o.type_vocab_size : f == Family::kBert ? 2 : 1;
  if (o.type_vocab_size == 0) {
    out.push_back(zeros_tensor(f == Family::kBert
                                   ? "bert.embeddings.token_type_embeddings.weight"
                                   : "roberta_prelayernorm.embeddings.token_type_embeddings.weight",
                               {f == Family::kBert ? 2 : 1, o.hidden}));
  }
  return position_offset;
}

// The causal families' config fields (rotary positions, no biases for Llama).
void add_causal_config(Family f, const ModelOptions& o, ordered_json& c) {
  c["max_position_embeddings"] = o.max_seq_length;
  if (f == Family::kLlama) {
    c["num_key_value_heads"] = key_value_heads(o);
    c["head_dim"] = o.hidden / o.heads;
    c["rope_theta"] = o.rope_theta;
    c["rope_parameters"] = {{"rope_theta", o.rope_theta}, {"rope_type", "default"}};
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
    c["attention_dropout"] = 0.0;
  } else {
    c["rotary_pct"] = o.rotary_fraction;
    c["rotary_emb_base"] = o.rope_theta;
    c["rope_parameters"] = {{"partial_rotary_factor", o.rotary_fraction},
                            {"rope_theta", o.rope_theta},
                            {"rope_type", "default"}};
    c["use_parallel_residual"] = o.parallel_residual;
    c["attention_bias"] = true;
    c["hidden_dropout"] = 0.0;
    c["attention_dropout"] = 0.0;
  }
  c["bos_token_id"] = data::kClsId;
  c["eos_token_id"] = data::kSepId;
}

// Our weights under the family's names (GPT-NeoX's attention projections: add_fused_qkv), and
// the tied decoder written out for loaders that do not tie (transformers ties them again).
void add_renamed_weights(Family f, TransformerLM& model,
                         const std::map<std::string, ExportedTensor>& w, int64_t position_offset,
                         NamedTensors& out) {
  const auto& o = model->options();
  for (auto& [name, t] : w) {
    if (name.find(".attention.self.") != std::string::npos &&
        (f == Family::kGptNeoX || f == Family::kDnabert2)) {
      continue;
    }
    if (name.find(".intermediate.") != std::string::npos && f == Family::kDnabert2) continue;
    if (name.find(".intermediate.") != std::string::npos && f == Family::kNtV2) continue;
    if (name == "bert.embeddings.position_embeddings.weight" && position_offset > 0) {
      out.push_back(combined_tensor(
          hf_name(f, name), {t.shape.at(0) + position_offset, t.shape.at(1)}, {t},
          [position_offset](const std::vector<Tensor>& v) {
            auto table = torch::zeros({v[0].size(0) + position_offset, v[0].size(1)});
            table.narrow(0, position_offset, v[0].size(0)).copy_(v[0]);
            return table;
          }));
      continue;
    }
    out.push_back(renamed_tensor(t, hf_name(f, name)));
  }
  if (o.tie_embeddings && o.task == Task::kPretrain) {
    out.push_back(renamed_tensor(w.at(model->root_name() + ".embeddings.word_embeddings.weight"),
                                 f == Family::kGptNeoX ? "embed_out.weight"
                                 : f == Family::kLlama ? "lm_head.weight"
                                 : f == Family::kBert || f == Family::kDnabert2
                                     ? "cls.predictions.decoder.weight"
                                     : "lm_head.decoder.weight"));
  }
}

// GPT-NeoX fuses query, key and value per head: rows [head][q|k|v][head_dim].
void add_fused_qkv(const ModelOptions& o, const std::map<std::string, ExportedTensor>& w,
                   NamedTensors& out) {
  const int64_t hd = o.hidden / o.heads, heads = o.heads, hidden = o.hidden;
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string ours = "gpt.encoder.layer." + std::to_string(i) + ".attention.self.";
    const std::string theirs =
        "gpt_neox.layers." + std::to_string(i) + ".attention.query_key_value.";
    auto parts = [&](const char* kind) {
      return std::vector<ExportedTensor>{w.at(ours + "query." + kind), w.at(ours + "key." + kind),
                                         w.at(ours + "value." + kind)};
    };
    out.push_back(combined_tensor(theirs + "weight", {3 * hidden, hidden}, parts("weight"),
                                  [heads, hd, hidden](const std::vector<Tensor>& v) {
                                    return torch::stack({v[0].view({heads, hd, hidden}),
                                                         v[1].view({heads, hd, hidden}),
                                                         v[2].view({heads, hd, hidden})},
                                                        1)
                                        .reshape({3 * hidden, hidden});
                                  }));
    out.push_back(combined_tensor(
        theirs + "bias", {3 * hidden}, parts("bias"),
        [heads, hd, hidden](const std::vector<Tensor>& v) {
          return torch::stack(
                     {v[0].view({heads, hd}), v[1].view({heads, hd}), v[2].view({heads, hd})}, 1)
              .reshape({3 * hidden});
        }));
  }
}

// Note [DNABERT-2 export]: the layout DNABERT-2's remote code loads (the inverse of Note
// [DNABERT-2 import]): Wqkv = [query; key; value] rows, gated_layers = [gate; up] rows, a
// token-type table (zeros when ours has none: exact), config.json "model_type": "bert" with the
// remote code's auto_map and keys. The remote code's Python files are not ours to write: they
// are copied from the directory the model was imported from when it had them (auto_map then
// names them locally), otherwise auto_map names them in zhihan1996/DNABERT-2-117M
// ("<repo>--<module>.<class>", which transformers fetches with trust_remote_code).
const char* const kDnabert2Files[] = {"bert_layers.py", "bert_padding.py", "configuration_bert.py",
                                      "flash_attn_triton.py"};
const char* const kDnabert2Repo = "zhihan1996/DNABERT-2-117M";

bool has_dnabert2_code(const std::string& source_dir) {
  if (source_dir.empty()) return false;
  std::error_code ec;
  for (const char* f : kDnabert2Files) {
    if (!std::filesystem::is_regular_file(source_dir + "/" + f, ec)) return false;
  }
  return true;
}

// The source directory's config.json when it is DNABERT-2's (its keys are kept), else null.
ordered_json dnabert2_source_config(const std::string& source_dir) {
  if (source_dir.empty()) return nullptr;
  const std::string path = source_dir + "/config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return nullptr;
  auto c = ordered_json::parse(
      read_bounded_file(path, kMaxConfigFileBytes, ExitCode::kUsage, "config.json"), nullptr,
      /*allow_exceptions=*/false);
  // (DNABERT-2's: its AutoConfig; a Nucleotide Transformer v2 source has an auto_map too)
  const ordered_json config_class =
      c.is_object() && c.contains("auto_map") && c["auto_map"].is_object()
          ? c["auto_map"].value("AutoConfig", ordered_json())
          : ordered_json();
  if (!config_class.is_string() ||
      config_class.get<std::string>().find("configuration_bert.BertConfig") == std::string::npos) {
    return nullptr;
  }
  return c;
}

void add_dnabert2_config(const ModelOptions& o, const std::string& source_dir, ordered_json& c,
                         NamedTensors& out) {
  ordered_json source = dnabert2_source_config(source_dir);
  ordered_json merged = source.is_object() ? source : ordered_json::object();
  // Ours win for everything the function depends on.
  for (const auto& [key, value] : c.items()) merged[key] = value;
  // The classes, named locally when the files come along, else in DNABERT-2's hub repository.
  const std::string prefix = has_dnabert2_code(source_dir) ? "" : std::string(kDnabert2Repo) + "--";
  ordered_json auto_map = {
      {"AutoConfig", "configuration_bert.BertConfig"},
      {"AutoModel", "bert_layers.BertModel"},
      {"AutoModelForMaskedLM", "bert_layers.BertForMaskedLM"},
      {"AutoModelForSequenceClassification", "bert_layers.BertForSequenceClassification"}};
  for (auto& [key, value] : auto_map.items()) value = prefix + value.get<std::string>();
  merged["auto_map"] = auto_map;
  if (!source.is_object()) {
    merged["alibi_starting_size"] = 512;
    merged["attention_probs_dropout_prob"] = 0.0;
    merged["hidden_dropout_prob"] = o.dropout;
    merged["classifier_dropout"] = nullptr;
    merged["max_position_embeddings"] = 512;
    merged["position_embedding_type"] = "absolute";
    merged["initializer_range"] = 0.02;
  }
  merged["type_vocab_size"] = 2;
  if (o.task == Task::kPretrain) {
    for (const char* key : {"id2label", "label2id", "problem_type", "num_labels"}) {
      merged.erase(key);
    }
  }
  c = merged;
  if (o.type_vocab_size == 0) {
    out.push_back(zeros_tensor("bert.embeddings.token_type_embeddings.weight", {2, o.hidden}));
  }
}

// The rows of `parts` one after the other.
ExportedTensor rows_of(const std::string& name, const std::vector<ExportedTensor>& parts) {
  std::vector<int64_t> shape = parts.at(0).shape;
  for (size_t i = 1; i < parts.size(); ++i) shape[0] += parts[i].shape.at(0);
  return combined_tensor(name, shape, parts,
                         [](const std::vector<Tensor>& v) { return torch::cat(v, 0); });
}

// Wqkv and gated_layers (Note [DNABERT-2 export]).
void add_dnabert2_fused(const ModelOptions& o, const std::map<std::string, ExportedTensor>& w,
                        NamedTensors& out) {
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string layer = "bert.encoder.layer." + std::to_string(i);
    auto at = [&](const std::string& name) { return w.at(layer + name); };
    out.push_back(rows_of(layer + ".attention.self.Wqkv.weight",
                          {at(".attention.self.query.weight"), at(".attention.self.key.weight"),
                           at(".attention.self.value.weight")}));
    out.push_back(rows_of(layer + ".attention.self.Wqkv.bias",
                          {at(".attention.self.query.bias"), at(".attention.self.key.bias"),
                           at(".attention.self.value.bias")}));
    out.push_back(rows_of(layer + ".mlp.gated_layers.weight",
                          {at(".intermediate.gate.weight"), at(".intermediate.dense.weight")}));
  }
}

// Nucleotide Transformer v2 fuses the gated feed-forward's input linears: intermediate.dense
// [2 x ffn, hidden] = [our intermediate.gate; our intermediate.dense] (silu of the first half).
void add_fused_glu(const ModelOptions& o, const std::map<std::string, ExportedTensor>& w,
                   NamedTensors& out) {
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string ours = "bert.encoder.layer." + std::to_string(i) + ".intermediate.";
    const std::string theirs = "esm.encoder.layer." + std::to_string(i) + ".intermediate.dense.";
    for (const char* kind : {"weight", "bias"}) {
      auto gate = w.find(ours + "gate." + kind);
      if (gate == w.end()) continue;  // no biases (add_bias_fnn false)
      out.push_back(rows_of(theirs + kind, {gate->second, w.at(ours + "dense." + kind)}));
    }
  }
}

}  // namespace

namespace {

// What export_hf_model writes: the tensors (to compute: Note [Exports unit by unit]) and the
// config.json.
std::pair<std::vector<ExportedTensor>, ordered_json> hf_state(TransformerLM& model, bool merge_lora,
                                                              const std::string& source_dir = "") {
  const auto& o = model->options();
  const Family f = family_of(o);
  const auto w = our_weights(model, merge_lora);
  NamedTensors out;
  ordered_json c = common_config(f, o);
  const bool causal = f == Family::kGptNeoX || f == Family::kLlama;
  int64_t position_offset = 0;
  if (causal) {
    add_causal_config(f, o, c);
  } else if (f == Family::kDnabert2) {
    add_dnabert2_config(o, source_dir, c, out);
  } else {
    position_offset = add_encoder_config(f, o, c, out);
  }
  add_renamed_weights(f, model, w, position_offset, out);
  if (f == Family::kGptNeoX) add_fused_qkv(o, w, out);
  if (f == Family::kDnabert2) add_dnabert2_fused(o, w, out);
  if (f == Family::kNtV2) add_fused_glu(o, w, out);
  return {out, c};
}

// config.json, and DNABERT-2's remote code where the source directory has it (Note [DNABERT-2
// export]), next to model.safetensors.
void write_hf_config(const std::string& dir, const ordered_json& config, Family f,
                     const std::string& source_dir) {
  std::filesystem::create_directories(dir);
  checkpoint::write_json_durable(dir + "/config.json", config);
  if (f == Family::kDnabert2 && has_dnabert2_code(source_dir)) {
    for (const char* file : kDnabert2Files) {
      std::filesystem::copy_file(source_dir + "/" + file, dir + "/" + file,
                                 std::filesystem::copy_options::overwrite_existing);
    }
  }
}

}  // namespace

std::string export_hf_model(TransformerLM& model, const std::string& dir,
                            const std::string& source_dir) {
  auto [tensors, config] = hf_state(model, true, source_dir);
  write_exported_files(dir, {{"model.safetensors", tensors, {{"format", "pt"}}}},
                       whole_model_units(), /*write=*/true);
  const Family f = family_of(model->options());
  write_hf_config(dir, config, f, source_dir);
  return model_type_of(f);
}

namespace {

// PEFT's format for a model with LoRA: adapter/adapter_model.safetensors
// ("base_model.model.<HF module>.lora_A.weight", task heads as modules_to_save) and the base it
// applies to (the frozen weights, adapters not merged) in base/; the adapter_config.json and the
// base's config.json are `finish`'s.
struct PeftExport {
  std::vector<ExportedFile> files;
  ordered_json base_config, adapter_config;
};

PeftExport peft_export(TransformerLM& model) {
  const auto& o = model->options();
  DNALLM_CHECK(o.lora_r > 0, ExitCode::kFailure, "peft_export needs a model with LoRA");
  const Family f = family_of(o);
  DNALLM_CHECK(f != Family::kGptNeoX && f != Family::kLlama, ExitCode::kUsage,
               "LoRA on a causal model has no PEFT export yet");
  for (const auto& t : o.lora_targets) {
    DNALLM_CHECK(t == "query" || t == "key" || t == "value", ExitCode::kUsage,
                 "lora.target_modules \"{}\" has no PEFT export yet: supported are query, key, "
                 "value",
                 t);
  }
  PeftExport out;
  // The base: frozen weights, adapters not merged.
  auto [base, config] = hf_state(model, false);
  out.base_config = config;
  std::vector<ExportedTensor> adapters;
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const auto pos = name.rfind(".lora_");
    if (pos != std::string::npos) {
      const std::string module = hf_name(f, name.substr(0, pos) + ".weight");
      adapters.push_back(live_tensor(
          "base_model.model." + module.substr(0, module.size() - 7) + name.substr(pos) + ".weight",
          item.value()));
    }
  }
  std::vector<std::string> modules_to_save;
  if (o.task != Task::kPretrain) {
    // Task heads train in full: PEFT's modules_to_save.
    for (const auto& t : base) {
      if (t.name.rfind("classifier.", 0) == 0 ||
          (f == Family::kBert && t.name.rfind("bert.pooler.", 0) == 0)) {
        adapters.push_back(renamed_tensor(t, "base_model.model." + t.name));
      }
    }
    modules_to_save = f == Family::kBert ? std::vector<std::string>{"classifier", "pooler"}
                                         : std::vector<std::string>{"classifier"};
  }
  out.files.push_back({"base/model.safetensors", std::move(base), {{"format", "pt"}}});
  out.files.push_back(
      {"adapter/adapter_model.safetensors", std::move(adapters), {{"format", "pt"}}});
  ordered_json& a = out.adapter_config;
  a["peft_type"] = "LORA";
  a["task_type"] = o.task == Task::kPretrain ? "FEATURE_EXTRACTION" : "SEQ_CLS";
  a["base_model_name_or_path"] = nullptr;  // the base's absolute path, once written
  a["r"] = o.lora_r;
  a["lora_alpha"] = o.lora_alpha;
  a["lora_dropout"] = o.lora_dropout;
  a["target_modules"] = o.lora_targets;
  a["bias"] = "none";
  a["fan_in_fan_out"] = false;
  a["use_rslora"] = false;
  a["use_dora"] = false;
  a["inference_mode"] = true;
  a["modules_to_save"] =
      modules_to_save.empty() ? ordered_json(nullptr) : ordered_json(modules_to_save);
  return out;
}

}  // namespace

std::optional<HfExport> hf_export_transformer(TransformerLM& model,
                                              const data::Tokenizer& tokenizer,
                                              const std::string& source_dir) {
  const auto& o = model->options();
  auto [tensors, config] = hf_state(model, true, source_dir);
  const Family f = family_of(o);
  HfExport plan;
  plan.files.push_back({"model.safetensors", std::move(tensors), {{"format", "pt"}}});
  // PEFT would target DNABERT-2's fused Wqkv, which our query/value adapters are not.
  std::optional<PeftExport> peft;
  if (o.lora_r > 0 && f != Family::kDnabert2) {
    peft = peft_export(model);
    for (auto& file : peft->files) plan.files.push_back(std::move(file));
  }
  const auto arch = o.arch;
  // The tokenizer's model_max_length, where transformers cuts: the positions a real token can
  // take (a RoBERTa-numbered table reserves its first padding_idx + 1).
  const int64_t max_seq_length = o.max_seq_length - reserved_positions(o);
  const auto* tok = &tokenizer;  // (the caller's, alive until the export returns)
  const bool lora = o.lora_r > 0;
  plan.finish = [=, config = std::move(config)](const std::string& dir) {
    export_hf_tokenizer(*tok, arch, max_seq_length, dir);
    write_hf_config(dir, config, f, source_dir);
    if (lora && !peft) {
      spdlog::warn(
          "no PEFT adapter export for DNABERT-2 (its attention is one fused Wqkv): "
          "{} holds the model with the adapters merged",
          dir);
    } else if (peft) {
      write_hf_config(dir + "/base", peft->base_config, f, "");
      export_hf_tokenizer(*tok, arch, max_seq_length, dir + "/base");
      auto adapter_config = peft->adapter_config;
      adapter_config["base_model_name_or_path"] = std::filesystem::absolute(dir + "/base").string();
      checkpoint::write_json_durable(dir + "/adapter/adapter_config.json", adapter_config);
    }
    spdlog::info("exported a transformers {} model to {}", model_type_of(f), dir);
  };
  return plan;
}

bool export_hf_transformer(TransformerLM& model, const data::Tokenizer& tokenizer,
                           const std::string& dir, const std::string& source_dir) {
  return export_hf_directory(as_language_model(model), tokenizer, dir, source_dir);
}

}  // namespace dnallm::models
