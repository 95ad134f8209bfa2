// Caduceus's Hugging Face files: config.json to options, the hub import (load_hf_caduceus) and
// the export (export_hf_caduceus, hf_config_of, hf_tensors). The model itself: caduceus.cpp.
#include "worker/models/caduceus/caduceus.hpp"

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/family_io.hpp"
#include "worker/models/hf_directory.hpp"

namespace dnallm::models::caduceus {

using nlohmann::json;
using torch::Tensor;

// ---------------------------------------------------------------------------------------------
// Import

namespace {

int64_t int_key(const json& c, const std::string& key, int64_t fallback, int64_t lo, int64_t hi,
                const std::string& where) {
  return family_int(c, key, fallback, lo, hi, where, "Caduceus");
}

}  // namespace

bool tie_word_embeddings(const json& c, bool fallback, const std::string& where) {
  return family_bool(c, "tie_word_embeddings", fallback, where);
}

namespace {

CaduceusOptions options_from(const json& c, const std::string& where) {
  CaduceusOptions o;
  o.d_model = int_key(c, "d_model", 256, 1, 1 << 16, where);
  o.n_layer = int_key(c, "n_layer", 16, 1, 1024, where);
  const int64_t multiple = int_key(c, "pad_vocab_size_multiple", 8, 1, 1024, where);
  const int64_t vocab = int_key(c, "vocab_size", 16, 1, 1 << 20, where);
  o.vocab_size = (vocab + multiple - 1) / multiple * multiple;
  const json ssm =
      c.contains("ssm_cfg") && c["ssm_cfg"].is_object() ? c["ssm_cfg"] : json::object();
  o.d_state = int_key(ssm, "d_state", 16, 1, 1024, where + " ssm_cfg");
  o.d_conv = int_key(ssm, "d_conv", 4, 1, 64, where + " ssm_cfg");
  o.expand = int_key(ssm, "expand", 2, 1, 64, where + " ssm_cfg");
  o.dt_rank = (o.d_model + 15) / 16;
  if (ssm.contains("dt_rank") && !(ssm["dt_rank"].is_string() && ssm["dt_rank"] == "auto")) {
    o.dt_rank = int_key(ssm, "dt_rank", o.dt_rank, 1, 1 << 16, where + " ssm_cfg");
  }
  for (const char* key : {"bias", "conv_bias"}) {
    DNALLM_CHECK(!ssm.contains(key) || ssm[key] == (std::string(key) == "conv_bias"),
                 ExitCode::kUsage,
                 "{}: ssm_cfg \"{}\" = {} is not supported (Caduceus uses the "
                 "Mamba defaults)",
                 where, key, ssm.contains(key) ? ssm[key].dump() : "");
  }
  o.rms_norm = family_bool(c, "rms_norm", true, where);
  o.rcps = family_bool(c, "rcps", false, where);
  // CaduceusConfig's default is true (our exports always write the key).
  o.fused_add_norm = family_bool(c, "fused_add_norm", true, where);
  // Note [Caduceus tied head]: CaduceusForMaskedLM ties an RCPS head whatever the config says.
  const bool tie = tie_word_embeddings(c, false, where);  // (read, so a damaged value refuses)
  o.tie_head = o.rcps || tie;
  o.bidirectional = family_bool(c, "bidirectional", true, where);
  DNALLM_CHECK(family_string(c, "bidirectional_strategy", "add", where) == "add", ExitCode::kUsage,
               "{}: bidirectional_strategy {} is not supported: \"add\" (every published model)",
               where, c.value("bidirectional_strategy", json()).dump());
  DNALLM_CHECK(family_bool(c, "bidirectional_weight_tie", true, where), ExitCode::kUsage,
               "{}: bidirectional_weight_tie = false is not supported (every published model ties)",
               where);
  if (c.contains("norm_epsilon") && c["norm_epsilon"].is_number()) {
    o.norm_eps = c["norm_epsilon"].get<double>();
    DNALLM_CHECK(std::isfinite(o.norm_eps) && o.norm_eps > 0, ExitCode::kUsage,
                 "{}: \"norm_epsilon\" = {} must be positive", where, o.norm_eps);
  }
  if (c.contains("complement_map") && c["complement_map"].is_object()) {
    std::vector<int64_t> map(static_cast<size_t>(o.vocab_size));
    for (int64_t i = 0; i < o.vocab_size; ++i) map[i] = i;
    for (auto& [k, v] : c["complement_map"].items()) {
      int64_t from = -1;
      try {
        from = std::stoll(k);
      } catch (...) {
      }
      DNALLM_CHECK(from >= 0 && from < o.vocab_size && v.is_number_integer() &&
                       v.get<int64_t>() >= 0 && v.get<int64_t>() < o.vocab_size,
                   ExitCode::kUsage, "{}: complement_map entry \"{}\": {} is not a token id pair",
                   where, clip_for_message(k), clip_for_message(v.dump()));
      map[from] = v.get<int64_t>();
    }
    o.complement = map;
  }
  DNALLM_CHECK(!o.rcps || !o.complement.empty(), ExitCode::kUsage,
               "{}: rcps = true needs a complement_map", where);
  return o;
}

// The task head's name in the Hugging Face layout.
std::string hf_head_name(const CaduceusOptions& o) {
  return o.classifier ? "score.weight" : (o.rcps ? "lm_head.lm_head.weight" : "lm_head.weight");
}

std::string hf_embedding_name(const CaduceusOptions& o) {
  return std::string("caduceus.backbone.embeddings.word_embeddings") +
         (o.rcps ? ".embedding" : "") + ".weight";
}

// name in the Hugging Face layout -> the tensor it fills.
std::map<std::string, Tensor> hf_names(CaduceusLMImpl& m) {
  const auto& o = m.options();
  const std::string sub = o.rcps ? ".submodule" : "";
  // The fused path's norms are plain RMSNorm/LayerNorm modules, not RCPSAddNormWrapper's.
  const std::string norm_sub = o.rcps && !o.fused_add_norm ? ".submodule" : "";
  std::map<std::string, Tensor> out;
  const std::string bb = "caduceus.backbone.";
  out[hf_embedding_name(o)] = m.word_embeddings->weight;
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const std::string l = bb + "layers." + std::to_string(i) + ".";
    out[l + "norm" + norm_sub + ".weight"] = m.norm_weight[i];
    if (!o.rms_norm) out[l + "norm" + norm_sub + ".bias"] = m.norm_bias[i];
    for (int dir = 0; dir < (o.bidirectional ? 2 : 1); ++dir) {
      auto& mm = dir == 0 ? m.fwd[i] : m.rev[i];
      const std::string p = l + "mixer" + sub + (dir == 0 ? ".mamba_fwd." : ".mamba_rev.");
      out[p + "A_log"] = mm->A_log;
      out[p + "D"] = mm->D;
      out[p + "conv1d.weight"] = mm->conv1d->weight;
      out[p + "conv1d.bias"] = mm->conv1d->bias;
      out[p + "x_proj.weight"] = mm->x_proj->weight;
      out[p + "dt_proj.weight"] = mm->dt_proj->weight;
      out[p + "dt_proj.bias"] = mm->dt_proj->bias;
      if (dir == 0) {
        out[p + "in_proj.weight"] = mm->in_proj->weight;
        out[p + "out_proj.weight"] = mm->out_proj->weight;
      }
    }
  }
  out[bb + "norm_f" + norm_sub + ".weight"] = m.norm_f_weight;
  if (!o.rms_norm) out[bb + "norm_f" + norm_sub + ".bias"] = m.norm_f_bias;
  // Note [Caduceus tied head]: a tied head is the embedding, read and written under its name.
  if (!o.tied_head()) out[hf_head_name(o)] = m.head_weight;
  return out;
}

}  // namespace

std::vector<std::string> hf_module_names(const CaduceusOptions& o, const std::string& ours) {
  const std::string prefix = "mamba_fwd_";
  const auto dot = ours.find('.');
  if (ours.rfind(prefix, 0) != 0 || dot == std::string::npos) return {ours};
  const std::string layer = ours.substr(prefix.size(), dot - prefix.size());
  const std::string linear = ours.substr(dot + 1);
  if (layer.empty() || layer.find_first_not_of("0123456789") != std::string::npos ||
      (linear != "in_proj" && linear != "out_proj")) {
    return {ours};
  }
  const std::string mixer =
      "caduceus.backbone.layers." + layer + ".mixer" + (o.rcps ? ".submodule" : "") + ".mamba_";
  std::vector<std::string> out = {mixer + "fwd." + linear};
  if (o.bidirectional) out.push_back(mixer + "rev." + linear);
  return out;
}

CaduceusOptions options_from_hf_config(const json& config, const std::string& where) {
  return options_from(config, where);
}

CaduceusLM load_hf_caduceus(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  const auto c = read_family_config(dir, "caduceus", "Caduceus");
  auto o = options_from(c, config_path);
  o.hf_config = c;
  const std::string weights = family_weights(dir, "Caduceus");
  checkpoint::SafetensorsReader reader(weights);
  o.classifier = reader.file().tensors.count("score.weight") != 0;
  if (o.classifier) o.num_labels = reader.file().tensors.at("score.weight").spec.shape.at(0);
  torch::manual_seed(0);
  CaduceusLM model(o);
  auto expected = hf_names(*model);
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  const std::string tied = ".mamba_rev.";
  for (const auto& [name, entry] : reader.file().tensors) {
    if (name.size() > 15 && name.compare(name.size() - 15, 15, ".complement_map") == 0) continue;
    const bool rev_projection =
        name.find(tied) != std::string::npos && (name.find(".in_proj.") != std::string::npos ||
                                                 name.find(".out_proj.") != std::string::npos);
    if (rev_projection) continue;  // tied to mamba_fwd's (Note [Caduceus])
    // Note [Caduceus tied head]: a tied head is the embedding (the hub code ties it on load).
    if (o.tied_head() && (name == "lm_head.weight" || name == "lm_head.lm_head.weight")) continue;
    auto it = expected.find(name);
    DNALLM_CHECK(it != expected.end(), ExitCode::kUsage,
                 "{}: unexpected tensor {} for this config.json (n_layer {}, rcps {}, "
                 "fused_add_norm {}): the directory mixes files of different models",
                 weights, clip_for_message(name), o.n_layer, o.rcps, o.fused_add_norm);
    const auto t = read_finite_tensor(reader, entry, weights, name);
    DNALLM_CHECK(t.sizes() == it->second.sizes(), ExitCode::kUsage,
                 "{}: {} has shape {} but config.json implies {}", weights, name,
                 fmt::format("{}", fmt::join(t.sizes(), "x")),
                 fmt::format("{}", fmt::join(it->second.sizes(), "x")));
    it->second.copy_(t);
    loaded.insert(name);
  }
  // An untied head missing from the file starts as the embedding.
  for (const auto& [name, t] : expected) {
    if (loaded.count(name) != 0) continue;
    const bool head = name == "lm_head.weight" || name == "lm_head.lm_head.weight";
    const std::string emb = hf_embedding_name(o);
    DNALLM_CHECK(head && loaded.count(emb) != 0, ExitCode::kUsage,
                 "{}: tensor {} is missing: the download is incomplete or of another model",
                 weights, name);
    t.copy_(expected.at(emb));
  }
  model->eval();
  return model;
}

json hf_config_of(const CaduceusOptions& o) {
  json ssm = {
      {"d_state", o.d_state}, {"d_conv", o.d_conv}, {"expand", o.expand}, {"dt_rank", o.dt_rank}};
  json config = {{"model_type", "caduceus"},
                 {"architectures",
                  {o.classifier ? "CaduceusForSequenceClassification" : "CaduceusForMaskedLM"}},
                 {"d_model", o.d_model},
                 {"n_layer", o.n_layer},
                 {"vocab_size", o.vocab_size},
                 {"pad_vocab_size_multiple", 8},
                 {"ssm_cfg", ssm},
                 {"rms_norm", o.rms_norm},
                 {"norm_epsilon", o.norm_eps},
                 {"residual_in_fp32", false},
                 {"fused_add_norm", o.fused_add_norm},
                 {"bidirectional", o.bidirectional},
                 {"bidirectional_strategy", "add"},
                 {"bidirectional_weight_tie", true},
                 {"rcps", o.rcps},
                 {"tie_word_embeddings", o.tie_head},
                 {"pad_token_id", 4}};
  if (!o.complement.empty()) {
    json map = json::object();
    for (size_t i = 0; i < o.complement.size(); ++i) map[std::to_string(i)] = o.complement[i];
    config["complement_map"] = map;
  }
  if (o.classifier) config["num_labels"] = o.num_labels;
  return config;
}

std::vector<ExportedTensor> hf_tensors(CaduceusLM& model, const Tensor& complement,
                                       const WeightReader& weight) {
  const auto& o = model->options();
  std::vector<ExportedTensor> tensors;
  for (const auto& [name, t] : hf_names(*model)) {
    tensors.push_back(weight(name, t));
    // Note [Caduceus tied projections].
    const auto fwd = name.find(".mamba_fwd.");
    if (o.bidirectional && fwd != std::string::npos &&
        (name.find(".in_proj.") != std::string::npos ||
         name.find(".out_proj.") != std::string::npos)) {
      tensors.push_back(renamed_tensor(
          tensors.back(), name.substr(0, fwd) + ".mamba_rev." + name.substr(fwd + 11)));
    }
  }
  if (o.tied_head()) {  // Note [Caduceus tied head]: the hub files hold it under its own name
    for (const auto& t : tensors) {
      if (t.name == hf_embedding_name(o)) {
        tensors.push_back(renamed_tensor(t, hf_head_name(o)));
        break;
      }
    }
  }
  if (o.rcps) {  // RCPSEmbedding's and RCPSLMHead's buffers, as the hub code saves them
    tensors.push_back(
        live_tensor("caduceus.backbone.embeddings.word_embeddings.complement_map", complement));
    if (!o.classifier) tensors.push_back(live_tensor("lm_head.complement_map", complement));
  }
  return tensors;
}

json hf_export_config(const CaduceusOptions& o) {
  json config = o.hf_config.is_null() ? hf_config_of(o) : o.hf_config;
  // Note [Caduceus tied head]: said, so that transformers 4 and 5 compute the same head.
  config["tie_word_embeddings"] = o.tie_head;
  if (!config.contains("auto_map")) {
    config["auto_map"] = {{"AutoConfig", "configuration_caduceus.CaduceusConfig"},
                          {"AutoModel", "modeling_caduceus.Caduceus"},
                          {"AutoModelForMaskedLM", "modeling_caduceus.CaduceusForMaskedLM"},
                          {"AutoModelForSequenceClassification",
                           "modeling_caduceus.CaduceusForSequenceClassification"}};
  }
  return config;
}

void export_hf_caduceus(CaduceusLM& model, const std::string& dir,
                        const std::string& tokenizer_from) {
  namespace fs = std::filesystem;
  write_exported_files(dir,
                       {{"model.safetensors",
                         hf_tensors(model, model->complement, LiveWeights(*model, true)),
                         {{"format", "pt"}}}},
                       whole_model_units(), /*write=*/true);
  checkpoint::write_json_durable(fs::path(dir) / "config.json", hf_export_config(model->options()));
  copy_tokenizer_files(tokenizer_from, dir);
}

}  // namespace dnallm::models::caduceus
