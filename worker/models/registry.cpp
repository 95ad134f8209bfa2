#include "worker/models/registry.hpp"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/hf_directory.hpp"

namespace dnallm::models {
namespace {

// Every model_type of our model directories, for "use one of ..." messages.
std::string known_exported_types() {
  std::vector<std::string> names;
  for (const auto& f : model_families()) {
    for (const auto& n : f.exported_types) names.push_back("\"" + n + "\"");
  }
  return fmt::format("{}", fmt::join(names, ", "));
}

// The model.arch values of `f`, quoted.
std::string arch_names(const ModelFamily& f) {
  std::vector<std::string> names;
  for (const auto a : f.arches) names.push_back(fmt::format("\"{}\"", cfg::spelling(a)));
  return fmt::format("{}", fmt::join(names, ", "));
}

// model.safetensors: the named weights, a LoRA or quantized linear's weight in full precision
// with its adapter merged (computed into a copy: the live model keeps training with its adapters).
std::vector<ExportedTensor> exported_weights(LanguageModel& model) {
  const LiveWeights weights(*model, /*merge_adapters=*/true);
  std::vector<ExportedTensor> out;
  for (auto& [name, t] : model->named_weights()) out.push_back(weights(name, t));
  return out;
}

// The registered family called `name` (spec().family); null when none is.
const ModelFamily* family_named(const std::string& name) {
  const auto f = std::find_if(model_families().begin(), model_families().end(),
                              [&](const ModelFamily& m) { return m.name == name; });
  return f == model_families().end() ? nullptr : &*f;
}

// The LoRA adapters alone, under PEFT's names, for users who keep the base separate: the
// module names of the model's Hugging Face layout (its family's peft_module_names; ours for the
// transformer and HyenaDNA, Note [Caduceus PEFT names]).
std::vector<ExportedTensor> lora_adapters(LanguageModel& model) {
  const ModelFamily* family = family_named(model->spec().family);
  const auto names = family != nullptr ? family->peft_module_names : nullptr;
  std::vector<ExportedTensor> adapters;
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const auto at = name.rfind(".lora_");
    if (at == std::string::npos) continue;
    const std::string module = name.substr(0, at), which = name.substr(at);
    const auto modules = names != nullptr ? names(model, module) : std::vector<std::string>{module};
    for (const auto& m : modules) {
      adapters.push_back(live_tensor("base_model.model." + m + which + ".weight", item.value()));
    }
  }
  return adapters;
}

}  // namespace

const ModelFamily& family_for_arch(cfg::Arch arch) {
  for (const auto& f : model_families()) {
    for (const auto a : f.arches) {
      if (a == arch) return f;
    }
  }
  fail(ExitCode::kFailure, "internal: model.arch = \"{}\" has no model family",
       cfg::spelling(arch));
}

const ModelFamily& family_for_hf_config(const nlohmann::json& config, const std::string& where) {
  for (const auto& f : model_families()) {
    if (f.recognises_hf != nullptr && f.recognises_hf(config)) return f;
  }
  const auto type = config.is_object() && config.contains("model_type")
                        ? config["model_type"].dump()
                        : std::string("(none)");
  fail(ExitCode::kUsage,
       "{}: model_type {} is not a Hugging Face layout this program reads: supported are "
       "bert (DNABERT-1, and DNABERT-2 by its auto_map), esm (Nucleotide Transformer v1/v2), "
       "roberta-prelayernorm, gpt_neox, llama, hyenadna and caduceus",
       where, clip_for_message(type));
}

void check_model_memory(const Config& config, const data::Tokenizer& tokenizer,
                        const BuildContext& context) {
  const auto& from = config.model.init_from;
  const auto& family = family_for_arch(config.model.arch);
  if (!from.empty() && is_hf_model_dir(from)) {
    // A directory of another family: build_model_for() says so.
    const std::string where = from + "/config.json";
    const auto c = read_directory_json(where, "a Hugging Face model directory");
    if (&family_for_hf_config(c, where) != &family) return;
  }
  if (family.check_memory != nullptr) family.check_memory(config, tokenizer, context);
}

bool streams_blocks(const Config& config) {
  return config.training.batch_size != cfg::BatchSize::kAuto;
}

LanguageModel build_model_for(const Config& config, const data::Tokenizer& tokenizer,
                              const BuildContext& context) {
  const auto& from = config.model.init_from;
  if (!from.empty() && is_hf_model_dir(from)) {
    const std::string where = from + "/config.json";
    const auto c = read_directory_json(where, "a Hugging Face model directory");
    const auto& family = family_for_hf_config(c, where);
    const auto& wanted = family_for_arch(config.model.arch);
    DNALLM_CHECK(&family == &wanted, ExitCode::kUsage,
                 "model.init_from = \"{}\" holds a {} model but model.arch = \"{}\" is the {} "
                 "family (it fixes how batches are framed): set model.arch to one of {}",
                 from, family.name, cfg::spelling(config.model.arch), wanted.name,
                 arch_names(family));
    DNALLM_CHECK(family.init_from_hf != nullptr, ExitCode::kUsage,
                 "model.init_from = \"{}\": the {} family cannot be fine-tuned from a Hugging "
                 "Face directory yet",
                 from, family.name);
    return family.init_from_hf(config, tokenizer, context);
  }
  return family_for_arch(config.model.arch).build(config, tokenizer, context);
}

void export_live_model(LanguageModel model, const std::string& dir) {
  export_live_model(model, dir, whole_model_units(), /*write=*/true);
}

void export_live_model(LanguageModel model, const std::string& dir, const ParameterUnits& units,
                       bool write) {
  const auto& spec = model->spec();
  std::vector<ExportedFile> files;
  // (a quantized base alone has no adapters)
  if (write && !lora_or_quantized_linears(*model).empty() && spec.lora_r > 0) {
    files.push_back({"adapter_model.safetensors",
                     lora_adapters(model),
                     {{"format", "pt"},
                      {"lora_r", std::to_string(spec.lora_r)},
                      {"lora_alpha", std::to_string(spec.lora_alpha)}}});
  }
  if (write) files.push_back({"model.safetensors", exported_weights(model), {{"format", "pt"}}});
  write_exported_files(dir, files, units, write);
  if (!write) return;
  // The files of checkpoint::write_model_directory(), in its order.
  checkpoint::write_json_durable(std::filesystem::path(dir) / "config.json",
                                 model->export_config());
  checkpoint::fsync_dir(dir);
}

LanguageModel load_exported_model(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  std::error_code ec;
  DNALLM_CHECK(std::filesystem::symlink_status(config_path, ec).type() !=
                   std::filesystem::file_type::not_found,
               ExitCode::kBadData,
               "{} not found: --model must be a directory written by dnallm-train (final/)",
               config_path);
  const nlohmann::json c = parse_json_strict(
      read_bounded_file(config_path, kMaxConfigFileBytes, ExitCode::kUsage, "config.json"),
      config_path, ExitCode::kUsage);
  DNALLM_CHECK(c.is_object(), ExitCode::kUsage, "{}: not a JSON object", config_path);
  DNALLM_CHECK(c.contains("model_type") && c["model_type"].is_string(), ExitCode::kUsage,
               "{}: \"model_type\" is missing or not a string", config_path);
  const auto type = c["model_type"].get<std::string>();
  for (const auto& f : model_families()) {
    for (const auto& t : f.exported_types) {
      if (t == type) return f.load_exported(dir, c);
    }
  }
  fail(ExitCode::kUsage, "{}: model_type \"{}\" is not a model of ours: known are {}", config_path,
       clip_for_message(type), known_exported_types());
}

bool export_hf_directory(LanguageModel model, const data::Tokenizer& tokenizer,
                         const std::string& dir, const std::string& source_dir) {
  return export_hf_directory(model, tokenizer, dir, source_dir, whole_model_units(),
                             /*write=*/true);
}

bool export_hf_directory(LanguageModel model, const data::Tokenizer& tokenizer,
                         const std::string& dir, const std::string& source_dir,
                         const ParameterUnits& units, bool write) {
  const auto& family = model->spec().family;
  const ModelFamily* f = family_named(family);
  DNALLM_CHECK(f != nullptr, ExitCode::kFailure,
               "internal: the model family \"{}\" is not registered", family);
  const auto skipped = [&](const std::string& why) {
    std::error_code ec;
    if (write) {
      std::filesystem::remove_all(dir, ec);
      spdlog::warn("no Hugging Face export: {}", why);
    }
    return false;
  };
  if (f->hf_export == nullptr) {
    return skipped(
        fmt::format("a {} model has no Hugging Face layout: {} not written", family, dir));
  }
  // Planned on every rank alike, so that either all of them take part in the gathers or none.
  std::optional<HfExport> plan;
  try {
    plan = f->hf_export(model, tokenizer, source_dir);
  } catch (const Error& e) {
    if (e.code() != ExitCode::kUsage) throw;
    return skipped(e.what());
  }
  if (!plan) return false;
  write_exported_files(dir, plan->files, units, write);
  if (!write) return true;
  try {
    plan->finish(dir);
  } catch (const Error& e) {  // (a tokenizer with no transformers layout)
    if (e.code() != ExitCode::kUsage) throw;
    return skipped(e.what());
  }
  checkpoint::fsync_dir(dir);
  return true;
}

}  // namespace dnallm::models
