// HyenaDNA's Hugging Face files: config.json to options, the hub import (load_hf_hyena) and the
// export (export_hf_hyena, hf_config_of, hf_tensors). The model itself: hyena.cpp.
#include "worker/models/hyena/hyena.hpp"

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
#include "worker/models/hyena/hyena_mixer.hpp"

namespace dnallm::models::hyena {

using nlohmann::json;
using torch::Tensor;

namespace {

// Note [Model shape limits] (transformer.hpp) for this family.
inline constexpr int64_t kMaxWidth = int64_t{1} << 16;
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxSeqLen = int64_t{1} << 24;  // 16M positions
inline constexpr int64_t kMaxVocab = int64_t{1} << 20;

int64_t int_key(const json& c, const std::string& key, int64_t fallback, int64_t lo, int64_t hi,
                const std::string& where) {
  return family_int(c, key, fallback, lo, hi, where, "HyenaDNA");
}

double number_key(const json& c, const std::string& key, double fallback,
                  const std::string& where) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  DNALLM_CHECK(c[key].is_number(), ExitCode::kUsage, "{}: \"{}\" = {} is not a number", where, key,
               clip_for_message(c[key].dump()));
  const double v = c[key].get<double>();
  DNALLM_CHECK(std::isfinite(v) && v > 0, ExitCode::kUsage,
               "{}: \"{}\" = {} must be positive and finite", where, key, v);
  return v;
}

}  // namespace

HyenaOptions options_from_hf_config(const json& c, const std::string& where) {
  HyenaOptions o;
  o.vocab_size = int_key(c, "vocab_size", kHubVocabSize, 1, kMaxVocab, where);
  o.pad_vocab_size_multiple = int_key(c, "pad_vocab_size_multiple", 8, 1, 1024, where);
  o.d_model = int_key(c, "d_model", 256, 1, kMaxWidth, where);
  o.d_inner = int_key(c, "d_inner", 4 * o.d_model, 1, 4 * kMaxWidth, where);
  o.n_layer = int_key(c, "n_layer", 12, 1, kMaxLayers, where);
  o.max_seq_len = int_key(c, "max_seq_len", 1024, 2, kMaxSeqLen, where);
  o.emb_dim = int_key(c, "emb_dim", 3, 3, 1023, where);
  DNALLM_CHECK(o.emb_dim % 2 == 1, ExitCode::kUsage,
               "{}: \"emb_dim\" = {} must be odd (time, then cosine and sine bands)", where,
               o.emb_dim);
  o.filter_order = int_key(c, "filter_order", 64, 1, kMaxWidth, where);
  o.num_inner_mlps = int_key(c, "num_inner_mlps", 2, 0, 64, where);
  const int64_t order = int_key(c, "hyena_order", 2, 1, 64, where);
  DNALLM_CHECK(order == 2, ExitCode::kUsage,
               "{}: \"hyena_order\" = {} is not supported: HyenaDNA's published models use 2",
               where, order);
  const int64_t short_order = int_key(c, "short_filter_order", 3, 1, 64, where);
  DNALLM_CHECK(
      short_order == 3, ExitCode::kUsage,
      "{}: \"short_filter_order\" = {} is not supported: HyenaDNA's published models use 3 "
      "(the reference pads by 2, so only 3 is causal)",
      where, short_order);
  o.activation_freq = number_key(c, "activation_freq", 1.0, where);
  o.layer_norm_eps = number_key(c, "layer_norm_epsilon", 1e-5, where);
  o.pad_token_id = int_key(c, "pad_token_id", 4, 0, o.padded_vocab() - 1, where);
  DNALLM_CHECK(family_bool(c, "train_freq", true, where), ExitCode::kUsage,
               "{}: \"train_freq\" = false is not supported (every published model trains it)",
               where);
  return o;
}

// ---------------------------------------------------------------------------------------------
// Import

namespace {

// Note [Hyena positional features]: the name of layer i's stored z and t.
std::string pos_emb_name(int64_t layer, const char* which) {
  return "hyena.backbone.layers." + std::to_string(layer) + ".mixer.filter_fn.pos_emb." + which;
}

// The reference appends one Sin module after each hidden Linear, so its shared frequency has
// one name per Sin (implicit_filter.1/3/5.freq); safetensors keeps one or all of them.
bool is_shared_freq(const std::string& name, std::string& canonical) {
  const std::string marker = ".mixer.filter_fn.implicit_filter.";
  const auto at = name.find(marker);
  if (at == std::string::npos || name.size() < 5 || name.compare(name.size() - 5, 5, ".freq") != 0)
    return false;
  canonical = name.substr(0, at + marker.size()) + "1.freq";
  return true;
}

}  // namespace

HyenaLM load_hf_hyena(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  const auto c = read_family_config(dir, "hyenadna", "HyenaDNA");
  auto o = options_from_hf_config(c, config_path);
  const std::string weights = family_weights(dir, "HyenaDNA");
  checkpoint::SafetensorsReader reader(weights);
  // The head from the tensors (score: a classifier; lm_head: a causal LM); config.json's
  // architectures, when it has one, must agree.
  const bool has_score = reader.file().tensors.count("score.weight") != 0;
  std::string arch = has_score ? "HyenaDNAForSequenceClassification" : "HyenaDNAForCausalLM";
  if (c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty() &&
      c["architectures"][0].is_string()) {
    const auto named = c["architectures"][0].get<std::string>();
    DNALLM_CHECK(
        named == arch || named == "HyenaDNAModel", ExitCode::kUsage,
        "{}: architectures names {} but model.safetensors holds {} (the head of a {}): the "
        "directory mixes files of different models",
        config_path, clip_for_message(named), has_score ? "score.weight" : "no score.weight", arch);
  }
  o.classifier = arch == "HyenaDNAForSequenceClassification";
  o.hf_config = c;
  if (o.classifier) {
    int64_t labels = 2;
    if (c.contains("id2label") && c["id2label"].is_object()) labels = c["id2label"].size();
    o.num_labels = int_key(c, "num_labels", labels, 1, int64_t{1} << 16, config_path);
  }
  torch::manual_seed(0);  // the random init is overwritten; determinism for missing-key errors
  HyenaLM model(o);
  std::map<std::string, Tensor> expected;
  for (auto& [name, t] : model->named_weights()) expected.emplace(name, t);
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  for (const auto& [name, entry] : reader.file().tensors) {
    std::string target = name;
    std::string canonical;
    if (is_shared_freq(name, canonical)) target = canonical;
    int64_t layer = -1;
    for (int64_t i = 0; i < o.n_layer && layer < 0; ++i) {
      if (name == pos_emb_name(i, "z") || name == pos_emb_name(i, "t")) layer = i;
    }
    if (layer >= 0) {
      if (name == pos_emb_name(layer, "t")) continue;  // a linspace: nothing trained in it
      // Note [Hyena positional features]: kept only when training moved it.
      const auto stored = read_finite_tensor(reader, entry, weights, name);
      DNALLM_CHECK(stored.dim() == 3 && stored.size(0) == 1 && stored.size(1) == o.max_seq_len &&
                       stored.size(2) == o.emb_dim,
                   ExitCode::kUsage, "{}: {} has shape {} but config.json implies 1x{}x{}", weights,
                   name, fmt::format("{}", fmt::join(stored.sizes(), "x")), o.max_seq_len,
                   o.emb_dim);
      const auto regenerated = positional_features(o, o.max_seq_len, torch::kCPU).first;
      const auto z = stored[0];
      if (!torch::allclose(z, regenerated, /*rtol=*/0, /*atol=*/1e-6)) {
        model->blocks[layer]->mixer->filter_fn->stored_z = z.contiguous();
      }
      continue;
    }
    auto it = expected.find(target);
    DNALLM_CHECK(it != expected.end(), ExitCode::kUsage,
                 "{}: unexpected tensor {} for a {} of this config.json (n_layer {}, "
                 "num_inner_mlps {}): the directory mixes files of different models",
                 weights, clip_for_message(name), arch, o.n_layer, o.num_inner_mlps);
    const auto t = read_finite_tensor(reader, entry, weights, name);
    DNALLM_CHECK(t.sizes() == it->second.sizes(), ExitCode::kUsage,
                 "{}: {} has shape {} but config.json implies {}", weights, name,
                 fmt::format("{}", fmt::join(t.sizes(), "x")),
                 fmt::format("{}", fmt::join(it->second.sizes(), "x")));
    if (loaded.count(target) != 0) {  // a second name of the shared frequency
      DNALLM_CHECK(torch::equal(it->second, t), ExitCode::kUsage,
                   "{}: {} differs from the other Sin frequencies of its filter, which HyenaDNA "
                   "shares: the file is damaged",
                   weights, name);
      continue;
    }
    it->second.copy_(t);
    loaded.insert(target);
  }
  for (const auto& [name, t] : expected) {
    if (name.find("modulation.deltas") != std::string::npos) continue;  // a buffer: regenerated
    DNALLM_CHECK(loaded.count(name) != 0, ExitCode::kUsage,
                 "{}: tensor {} is missing (a {} with n_layer {} has it): the download is "
                 "incomplete or of another model",
                 weights, name, arch, o.n_layer);
  }
  model->eval();
  return model;
}

json hf_config_of(const HyenaOptions& o) {
  json config = {{"model_type", "hyenadna"},
                 {"architectures",
                  {o.classifier ? "HyenaDNAForSequenceClassification" : "HyenaDNAForCausalLM"}},
                 {"vocab_size", o.vocab_size},
                 {"pad_vocab_size_multiple", o.pad_vocab_size_multiple},
                 {"d_model", o.d_model},
                 {"d_inner", o.d_inner},
                 {"n_layer", o.n_layer},
                 {"max_seq_len", o.max_seq_len},
                 {"emb_dim", o.emb_dim},
                 {"filter_order", o.filter_order},
                 {"num_inner_mlps", o.num_inner_mlps},
                 {"hyena_order", 2},
                 {"short_filter_order", 3},
                 {"activation_freq", o.activation_freq},
                 {"layer_norm_epsilon", o.layer_norm_eps},
                 {"pad_token_id", o.pad_token_id},
                 {"train_freq", true},
                 {"use_bias", true},
                 {"tie_word_embeddings", false}};
  if (o.classifier) config["num_labels"] = o.num_labels;
  return config;
}

std::vector<ExportedTensor> hf_tensors(HyenaLM& model, const WeightReader& weight) {
  const auto o = model->options();
  std::vector<ExportedTensor> tensors;
  for (auto& [name, t] : model->named_weights()) tensors.push_back(weight(name, t));
  // The regenerated positional features (z, t), the same for every layer: computed once, by the
  // first tensor written that needs them, and kept while the export lasts.
  auto features = std::make_shared<std::pair<Tensor, Tensor>>();
  const auto regenerated = [o, features] {
    if (!features->first.defined()) *features = positional_features(o, o.max_seq_len, torch::kCPU);
    return *features;
  };
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const auto& stored = model->blocks[i]->mixer->filter_fn->stored_z;
    // z: [t | cos | sin] over (emb_dim - 1) / 2 bands (positional_features).
    const std::vector<int64_t> shape =
        stored.defined() ? std::vector<int64_t>{1, stored.size(0), stored.size(1)}
                         : std::vector<int64_t>{1, o.max_seq_len, 1 + 2 * ((o.emb_dim - 1) / 2)};
    tensors.push_back(
        stored.defined()
            ? combined_tensor(pos_emb_name(i, "z"), shape, {live_tensor("z", stored)},
                              [](const std::vector<Tensor>& v) { return v[0].unsqueeze(0); })
            : computed_tensor(pos_emb_name(i, "z"), shape,
                              [regenerated] { return regenerated().first.unsqueeze(0); }));
    tensors.push_back(computed_tensor(pos_emb_name(i, "t"), {1, o.max_seq_len, 1},
                                      [regenerated] { return regenerated().second.unsqueeze(0); }));
  }
  return tensors;
}

void export_hf_hyena(HyenaLM& model, const std::string& dir, const std::string& tokenizer_from) {
  namespace fs = std::filesystem;
  const auto& o = model->options();
  json config = o.hf_config.is_null() ? hf_config_of(o) : o.hf_config;
  write_exported_files(
      dir,
      {{"model.safetensors", hf_tensors(model, LiveWeights(*model, true)), {{"format", "pt"}}}},
      whole_model_units(), /*write=*/true);
  checkpoint::write_json_durable(fs::path(dir) / "config.json", config);
  copy_tokenizer_files(tokenizer_from, dir);
}

}  // namespace dnallm::models::hyena
