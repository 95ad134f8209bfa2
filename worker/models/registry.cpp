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
#include "worker/models/caduceus/caduceus_model.hpp"
#include "worker/models/hf_directory.hpp"
#include "worker/models/hyena/hyena_model.hpp"
#include "worker/models/transformer/transformer.hpp"

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

// What an export writes of one tensor: its name and shape in the file (fp32), the tensors
// computing it reads, and the computation (Note [Exports unit by unit]).
struct ExportedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<torch::Tensor> reads;
  std::function<torch::Tensor()> value;
};

// model.safetensors: the named weights, a LoRA or quantized linear's weight in full precision
// with its adapter merged (a copy: the live model keeps training with its adapters).
std::vector<ExportedTensor> exported_weights(LanguageModel& model) {
  const auto linears = lora_or_quantized_linears(*model);
  std::vector<ExportedTensor> out;
  for (auto& [name, t] : model->named_weights()) {
    auto it = linears.find(name);
    if (it == linears.end()) {
      out.push_back({name, t.sizes().vec(), {t}, [t] { return t.detach().to(torch::kFloat32); }});
      continue;
    }
    const auto linear = it->second;
    std::vector<torch::Tensor> reads = linear->parameters();
    for (const auto& b : linear->buffers()) reads.push_back(b);
    // A quantized base's shape is its dequantized weight's (never sharded: not a parameter).
    const auto shape =
        linear->quantized() ? linear->full_weight().sizes().vec() : linear->weight.sizes().vec();
    out.push_back(
        {name, shape, std::move(reads), [linear] {
           return full_linear_weight(*linear, /*merge_adapters=*/true).to(torch::kFloat32);
         }});
  }
  return out;
}

// The LoRA adapters alone, under PEFT's names, for users who keep the base separate: the
// module names of the model's Hugging Face layout (ours for the transformer and HyenaDNA;
// Note [Caduceus PEFT names]).
std::vector<ExportedTensor> lora_adapters(LanguageModel& model) {
  auto* caduceus_model = dynamic_cast<caduceus::CaduceusModelImpl*>(model.get());
  std::vector<ExportedTensor> adapters;
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const auto at = name.rfind(".lora_");
    if (at == std::string::npos) continue;
    const std::string module = name.substr(0, at), which = name.substr(at);
    const auto modules = caduceus_model != nullptr
                             ? caduceus::hf_module_names(caduceus_model->lm()->options(), module)
                             : std::vector<std::string>{module};
    const torch::Tensor p = item.value();
    for (const auto& m : modules) {
      adapters.push_back({"base_model.model." + m + which + ".weight", p.sizes().vec(), {p}, [p] {
                            return p.detach().to(torch::kFloat32);
                          }});
    }
  }
  return adapters;
}

// Writes `tensors` into one safetensors file as `units` holds what they read.
class StreamedFile {
 public:
  StreamedFile(const std::filesystem::path& path, std::vector<ExportedTensor> tensors,
               const std::map<std::string, std::string>& metadata)
      : tensors_(std::move(tensors)), done_(tensors_.size(), false) {
    std::vector<checkpoint::TensorSpec> specs;
    for (const auto& t : tensors_) specs.push_back({t.name, DType::kFloat32, t.shape});
    writer_.emplace(path, std::move(specs), metadata);
  }
  // Writes every tensor not yet written whose reads `held` holds.
  void write_held(const HeldTensor& held) {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (done_[i]) continue;
      const auto& reads = tensors_[i].reads;
      if (!std::all_of(reads.begin(), reads.end(), held)) continue;
      writer_->write(i, safetensors_tensor(tensors_[i].name, tensors_[i].value()).write_data);
      done_[i] = true;
    }
  }
  void commit() { writer_->commit(); }  // Error(kFailure) naming a tensor never written

 private:
  std::vector<ExportedTensor> tensors_;
  std::vector<bool> done_;
  std::optional<checkpoint::SafetensorsWriter> writer_;
};

}  // namespace

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {transformer_family(), hyena::hyena_family(),
                                                    caduceus::caduceus_family()};
  return families;
}

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
    return family.init_from_hf(config, tokenizer);
  }
  return family_for_arch(config.model.arch).build(config, tokenizer, context);
}

void export_live_model(LanguageModel model, const std::string& dir) {
  // Every tensor of a model on one process holds its value: one call.
  export_live_model(
      model, dir, [](const auto& visit) { visit([](const torch::Tensor&) { return true; }); },
      /*write=*/true);
}

void export_live_model(LanguageModel model, const std::string& dir, const ParameterUnits& units,
                       bool write) {
  if (!write) {  // a rank that only takes part in the gathers
    units([](const HeldTensor&) {});
    return;
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  DNALLM_CHECK(!ec, ExitCode::kFailure, "cannot create the model directory {}: {}", dir,
               ec.message());
  const auto& spec = model->spec();
  std::optional<StreamedFile> adapters;
  if (!lora_or_quantized_linears(*model).empty() && spec.lora_r > 0) {
    // (a quantized base alone has no adapters)
    adapters.emplace(
        fs::path(dir) / "adapter_model.safetensors", lora_adapters(model),
        std::map<std::string, std::string>{{"format", "pt"},
                                           {"lora_r", std::to_string(spec.lora_r)},
                                           {"lora_alpha", std::to_string(spec.lora_alpha)}});
  }
  StreamedFile weights(fs::path(dir) / "model.safetensors", exported_weights(model),
                       {{"format", "pt"}});
  units([&](const HeldTensor& held) {
    if (adapters) adapters->write_held(held);
    weights.write_held(held);
  });
  // The files of checkpoint::write_model_directory(), in its order.
  if (adapters) adapters->commit();
  weights.commit();
  checkpoint::write_file_durable(fs::path(dir) / "config.json",
                                 model->export_config().dump(2) + "\n");
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
  const auto& family = model->spec().family;
  for (const auto& f : model_families()) {
    if (f.name != family) continue;
    if (f.export_hf == nullptr) {
      spdlog::warn("no Hugging Face layout for a {} model: {} not written", family, dir);
      return false;
    }
    return f.export_hf(model, tokenizer, dir, source_dir);
  }
  fail(ExitCode::kFailure, "internal: the model family \"{}\" is not registered", family);
}

}  // namespace dnallm::models
