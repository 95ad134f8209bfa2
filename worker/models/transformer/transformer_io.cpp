// The export and load of the transformer's own model directory.
#include <limits>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/transformer/transformer.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models {

using torch::Tensor;

// ---------------------------------------------------------------------------------------------
// Export / load

nlohmann::ordered_json export_config(const ModelOptions& o) {
  nlohmann::ordered_json c;
  c["architectures"] = {
      o.arch == Arch::kBert
          ? (o.task == Task::kPretrain ? "BertForMaskedLM" : "BertForSequenceClassification")
          : "DnallmGptForCausalLM"};
  c["model_type"] = o.arch == Arch::kBert ? "bert" : "dnallm-gpt";
  c["dnallm_arch"] = arch_name(o.arch);
  c["task"] = task_name(o.task);
  c["vocab_size"] = o.vocab_size;
  c["hidden_size"] = o.hidden;
  c["num_hidden_layers"] = o.layers;
  c["num_attention_heads"] = o.heads;
  if (key_value_heads(o) != o.heads) c["num_key_value_heads"] = key_value_heads(o);
  c["intermediate_size"] = o.ffn;
  c["max_position_embeddings"] = o.max_seq_length;
  c["position_embedding_type"] = o.rotary ? "rotary" : o.alibi ? "alibi" : "absolute";
  // Note [Rotary variants], Note [Parallel residual]: written when not the defaults, so that
  // the config.json of every other model stays as it was.
  if (o.rope_theta != ModelOptions().rope_theta) c["rope_theta"] = o.rope_theta;
  if (o.rotary_fraction != ModelOptions().rotary_fraction) {
    c["rotary_fraction"] = o.rotary_fraction;
  }
  if (o.parallel_residual) c["parallel_residual"] = true;
  c["hidden_act"] = "gelu";
  c["layer_norm_eps"] = o.layer_norm_eps;
  c["pre_layer_norm"] = !o.post_layer_norm;
  if (o.embedding_layer_norm) c["embedding_layer_norm"] = true;
  if (o.mask_embeddings) c["mask_embeddings"] = true;
  if (o.position_padding_idx >= 0) c["position_padding_idx"] = o.position_padding_idx;
  if (o.rms_norm) c["rms_norm"] = true;
  if (o.gated_mlp) c["gated_mlp"] = true;
  if (!o.linear_bias) c["linear_bias"] = false;
  if (o.gate_activation == ModelOptions::GateActivation::kGelu) c["gate_activation"] = "gelu";
  if (!o.ffn_in_bias) c["ffn_in_bias"] = false;
  if (!o.ffn_bias) c["ffn_bias"] = false;
  c["tie_word_embeddings"] = o.tie_embeddings;
  c["num_labels"] = o.num_labels;
  c["pooling"] = o.mean_pooling ? "mean" : "cls";
  c["pad_token_id"] = o.pad_id;
  c["type_vocab_size"] = o.type_vocab_size;
  c["shift_labels"] = o.shift_labels;
  return c;
}

TransformerLM load_exported_transformer(const std::string& dir, const nlohmann::json& c) {
  const std::string config_path = dir + "/config.json";
  ModelOptions o;
  auto integer = [&](const char* key) {
    DNALLM_CHECK(c.contains(key) && c[key].is_number_integer(), ExitCode::kUsage,
                 "{}: \"{}\" is missing or not an integer", config_path, key);
    DNALLM_CHECK(!c[key].is_number_unsigned() ||
                     c[key].get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
                 ExitCode::kUsage, "{}: \"{}\" = {} is too large", config_path, key, c[key].dump());
    return c[key].get<int64_t>();
  };
  try {
    const auto type = c.at("model_type").get<std::string>();
    DNALLM_CHECK(type == "bert" || type == "dnallm-gpt", ExitCode::kUsage,
                 "{}: model_type \"{}\" is not a transformer of ours (\"bert\" or \"dnallm-gpt\")",
                 config_path, clip_for_message(type));
    o.arch = type == "bert" ? Arch::kBert : Arch::kGpt;
    o.task = task_from_name(c.value("task", std::string("pretrain")), config_path);
    o.vocab_size = integer("vocab_size");
    o.hidden = integer("hidden_size");
    o.layers = integer("num_hidden_layers");
    o.heads = integer("num_attention_heads");
    if (c.contains("num_key_value_heads")) o.kv_heads = integer("num_key_value_heads");
    o.ffn = integer("intermediate_size");
    o.max_seq_length = integer("max_position_embeddings");
    const auto position = c.value("position_embedding_type", std::string("absolute"));
    DNALLM_CHECK(position == "absolute" || position == "rotary" || position == "alibi",
                 ExitCode::kUsage,
                 "{}: position_embedding_type \"{}\" is not supported (\"absolute\", \"rotary\" "
                 "or \"alibi\")",
                 config_path, clip_for_message(position));
    o.rotary = position == "rotary";
    o.alibi = position == "alibi";
    o.rope_theta = c.value("rope_theta", ModelOptions().rope_theta);
    o.rotary_fraction = c.value("rotary_fraction", ModelOptions().rotary_fraction);
    o.parallel_residual = c.value("parallel_residual", false);
    o.type_vocab_size = c.value("type_vocab_size", int64_t{0});
    o.layer_norm_eps = c.value("layer_norm_eps", 1e-12);
    o.tie_embeddings = c.value("tie_word_embeddings", true);
    o.num_labels = c.value("num_labels", int64_t{2});
    const auto pooling = c.value("pooling", std::string("cls"));
    DNALLM_CHECK(pooling == "cls" || pooling == "mean", ExitCode::kUsage,
                 "{}: pooling \"{}\" is not supported (\"cls\" or \"mean\")", config_path,
                 clip_for_message(pooling));
    o.mean_pooling = pooling == "mean";
    o.pad_id = c.value("pad_token_id", int64_t{0});
    o.shift_labels = c.value("shift_labels", true);
    o.post_layer_norm = !c.value("pre_layer_norm", true);
    o.embedding_layer_norm = c.value("embedding_layer_norm", false);
    o.mask_embeddings = c.value("mask_embeddings", false);
    o.position_padding_idx = c.value("position_padding_idx", int64_t{-1});
    o.rms_norm = c.value("rms_norm", false);
    o.gated_mlp = c.value("gated_mlp", false);
    o.linear_bias = c.value("linear_bias", true);
    const auto gate = c.value("gate_activation", std::string("silu"));
    DNALLM_CHECK(gate == "silu" || gate == "gelu", ExitCode::kUsage,
                 "{}: gate_activation \"{}\" is not supported (\"silu\" or \"gelu\")", config_path,
                 clip_for_message(gate));
    o.gate_activation =
        gate == "gelu" ? ModelOptions::GateActivation::kGelu : ModelOptions::GateActivation::kSilu;
    o.ffn_in_bias = c.value("ffn_in_bias", true);
    o.ffn_bias = c.value("ffn_bias", true);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(ExitCode::kBadData, "{}: missing or bad field: {}", config_path,
         clip_for_message(e.what(), 200));
  }
  o.lora_r = 0;
  check_model_shape(o, config_path);
  TransformerLM model(o);
  auto weights = load_safetensors(dir + "/model.safetensors");
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_weights()) {
    auto it = weights.find(name);
    DNALLM_CHECK(it != weights.end(), ExitCode::kBadData, "{}/model.safetensors lacks tensor {}",
                 dir, name);
    DNALLM_CHECK(it->second.sizes() == p.sizes(), ExitCode::kBadData,
                 "{}/model.safetensors: {} has shape {} but config.json implies {}", dir, name,
                 fmt::format("{}", fmt::join(it->second.sizes(), "x")),
                 fmt::format("{}", fmt::join(p.sizes(), "x")));
    p.copy_(it->second);
  }
  model->eval();
  return model;
}

}  // namespace dnallm::models
