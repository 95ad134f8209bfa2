// The transformer family's entry in the registry (Note [Model registry]): BERT/DNABERT-2/ESM/
// RoBERTa-PreLN encoders and GPT-NeoX/Llama/our GPT decoders, built from [model], imported from
// their Hugging Face layouts (hf_import.hpp) and exported to them (hf_export.hpp).
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <vector>

#include <spdlog/spdlog.h>

#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/host_memory.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/hf_directory.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/transformer/hf_export.hpp"
#include "worker/models/transformer/hf_import.hpp"
#include "worker/models/transformer/quantized_linear.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::models {

namespace {

// Note [Memory predicted]: before the model is built, a rank's memory is predicted from its
// shape: fp32 parameters, their gradients and AdamW's two moments (16 bytes a trainable
// parameter, 4 a frozen one, 4.127 bits a QLoRA base weight; divided over the ranks as the
// ZeRO stage shards them, plus, under
// ZeRO-3, the root unit (embeddings, heads) and two blocks gathered with their gradients, the
// parameters in 2 bytes under bf16 gathers: Note [Fully sharded]) and activations
// (about 8 [batch, seq, hidden] fp32 tensors a layer, one a layer with activation
// checkpointing, plus the logits twice). It is a lower bound, so a run predicted over the
// limit (training.memory_limit_gb, else available memory / ranks on the node, CPU only) would
// fail later anyway: exit 2 at once with the figures and what to lower, instead of
// allocating gigabytes first. dnallm-train predicts before the ranks connect
// (models::check_model_memory), so every rank refuses on its own; the build predicts again.
// A fine-tune of a Hugging Face directory is predicted from its config.json and weights header
// (hf_fine_tune_options: nothing of the weights is read but the root's), whose shape the user
// does not choose: the advice is then the rest (ZeRO-3, LoRA, more ranks, a shorter batch).
void check_predicted_memory(const Config& config, const ModelOptions& o, const BuildContext& ctx) {
  const auto& t = config.training;
  if (t.memory_limit_gb <= 0 && !ctx.on_cpu) return;
  const double ranks = double(std::max(1, ctx.local_world_size));
  const double world = double(std::max(1, ctx.world_size));
  const double params = parameter_count(o);
  const bool lora = o.lora_r > 0;
  // ZeRO shards the moments (stage >= 1), the gradients (>= 2) and the weights (3); ZeRO-3
  // also holds up to two whole blocks (and their gradients) while they compute.
  const int64_t stage = config.parallel.zero_stage;
  ModelOptions no_blocks = o;
  no_blocks.layers = 0;
  const double root = parameter_count(no_blocks);
  // QLoRA: the blocks' linear weights are 4.127 bits each (Note [NF4 layout]); the rest of the
  // base (norms, biases, the root) stays fp32. Whole on every rank, or under ZeRO-3 sharded with
  // their blocks, two of them gathered (Note [Fully sharded quantized base]).
  const bool qlora = lora && config.lora.quantize_base != cfg::QuantizeBase::kNone;
  const double block_linears = qlora ? block_linear_weight_count(o) : 0.0;
  const double quantized = double(o.layers) * block_linears;
  const double block = o.layers > 0 ? (params - root) / double(o.layers) - block_linears : 0.0;
  const double held = stage >= 3 ? root + 2 * block : 0.0;  // gathered elements
  const double gathered_bytes = t.precision == cfg::Precision::kBf16 ? 2.0 : 4.0;
  const double nf4_bytes = 4.127 / 8;
  const double weights =
      4 * (params - quantized) / (stage >= 3 ? world : 1.0) + gathered_bytes * held +
      nf4_bytes * (stage >= 3 ? quantized / world + 2 * block_linears : quantized);
  const double grads = lora ? 0.0 : 4 * params / (stage >= 2 ? world : 1.0) + 4 * held;
  // Offloaded from a GPU (Note [Optimizer offload]), the moments live on the host, outside the
  // device's budget; on the CPU the host is the device.
  const bool offloaded = t.optimizer_offload && !ctx.on_cpu;
  const double moments = lora || offloaded ? 0.0 : 8 * params / (stage >= 1 ? world : 1.0);
  const double batch = t.batch_size == cfg::BatchSize::kAuto ? 1.0 : double(t.micro_batch_size);
  // (config's length: an imported table may hold more positions than a sequence uses)
  const double tokens = batch * double(config.model.max_seq_length);
  const double per_layer = config.model.gradient_checkpointing ? 1.0 : 8.0;
  const double activations =
      4 * tokens * (double(o.layers) * per_layer * double(o.hidden) + 2.0 * double(o.vocab_size));
  const double need = weights + grads + moments + activations;
  const double limit =
      t.memory_limit_gb > 0 ? t.memory_limit_gb * 1e9 : available_memory_bytes() / ranks;
  if (limit <= 0 || need <= limit) return;
  const bool imported = !config.model.init_from.empty() && is_hf_model_dir(config.model.init_from);
  const std::string lower =
      imported ? fmt::format(
                     "the model is model.init_from = \"{}\": lower "
                     "training.micro_batch_size or model.max_seq_length, set "
                     "model.gradient_checkpointing = true, parallel.zero_stage = 3, "
                     "lora.r > 0 or (with it) lora.quantize_base = \"nf4\", or run more ranks",
                     config.model.init_from)
               : std::string(
                     "lower model.hidden, model.ffn, model.layers, "
                     "training.micro_batch_size or model.max_seq_length, or set "
                     "model.gradient_checkpointing = true");
  const std::string limit_text =
      t.memory_limit_gb > 0
          ? fmt::format("training.memory_limit_gb = {}", t.memory_limit_gb)
          : fmt::format(
                "the {:.2f} GB available to each of {} rank(s) here (MemAvailable / cgroup "
                "memory.max; set training.memory_limit_gb to override)",
                limit / 1e9, ranks);
  fail(ExitCode::kUsage,
       "this run needs at least {:.3g} GB a rank ({:.3g} parameters: weights {:.3g} GB, "
       "gradients {:.3g} GB, AdamW moments {:.3g} GB; activations {:.3g} GB at "
       "micro_batch_size {} x max_seq_length {}), more than {}: {}",
       need / 1e9, params, weights / 1e9, grads / 1e9, moments / 1e9, activations / 1e9, batch,
       config.model.max_seq_length, limit_text, lower);
}

}  // namespace

TransformerLM build_transformer(const Config& config, int64_t vocab_size,
                                const BuildContext& context) {
  auto options = model_options_from_config(config, vocab_size);
  check_predicted_memory(config, options, context);
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  const int64_t lora_r = options.lora_r;
  options.lora_r = 0;  // load base weights first, then add adapters
  // model.init_from = one of our directories: every tensor whose name and shape match, read
  // one at a time (a fresh head stays fresh).
  const bool from_dir = !config.model.init_from.empty();
  const std::string path = config.model.init_from + "/model.safetensors";
  std::optional<checkpoint::SafetensorsReader> reader;
  if (from_dir) {
    DNALLM_CHECK(std::filesystem::exists(path), ExitCode::kUsage,
                 "model.init_from = \"{}\" has no model.safetensors: point it at an exported "
                 "final/ directory",
                 config.model.init_from);
    reader.emplace(path);  // the header checked (Note [Untrusted files])
  }
  int64_t loaded = 0;
  std::function<void(const std::string&, const torch::Tensor&)> fill;
  if (from_dir) {
    fill = [&](const std::string& name, const torch::Tensor& p) {
      const auto& tensors = reader->file().tensors;
      auto it = tensors.find(name);
      if (it == tensors.end()) return;
      const auto& shape = it->second.spec.shape;
      if (std::vector<int64_t>(shape.begin(), shape.end()) != p.sizes().vec()) return;
      torch::NoGradGuard no_grad;
      p.copy_(read_finite_tensor(*reader, it->second, path, name));
      ++loaded;
    };
  }
  // Note [Streamed build], Note [LoRA block by block]: each block filled as it is built.
  TransformerLM model =
      build_filled(options, lora_r, qlora_base_format(config, lora_r), context.blocks, fill);
  if (from_dir) {
    DNALLM_CHECK(loaded > 0, ExitCode::kUsage,
                 "model.init_from = \"{}\": no tensor matches this model's names and shapes",
                 config.model.init_from);
    spdlog::info("initialised {} tensors from {}", loaded, path);
  }
  return model;
}

ModelFamily transformer_family() {
  ModelFamily f;
  f.name = "transformer";
  f.arches = {cfg::Arch::kBert, cfg::Arch::kGpt};
  f.exported_types = {"bert", "dnallm-gpt"};
  f.recognises_hf = is_transformer_hf_config;
  f.check_memory = [](const Config& config, const data::Tokenizer& tokenizer,
                      const BuildContext& context) {
    const auto& from = config.model.init_from;
    check_predicted_memory(config,
                           !from.empty() && is_hf_model_dir(from)
                               ? hf_fine_tune_options(config, tokenizer)
                               : model_options_from_config(config, tokenizer.vocab_size()),
                           context);
  };
  f.build = [](const Config& config, const data::Tokenizer& tokenizer,
               const BuildContext& context) {
    return as_language_model(build_transformer(config, tokenizer.vocab_size(), context));
  };
  f.init_from_hf = [](const Config& config, const data::Tokenizer& tokenizer,
                      const BuildContext& context) {
    return as_language_model(init_from_hf(config, tokenizer, context));
  };
  f.load_exported = [](const std::string& dir, const nlohmann::json& config) {
    return as_language_model(load_exported_transformer(dir, config));
  };
  f.load_hf = [](const std::string& dir) {
    return as_language_model(build_hf_model(read_hf_checkpoint(dir)));
  };
  f.load_hf_with_adapter = [](const std::string& base_dir, const std::string& adapter_dir) {
    const auto base = read_hf_checkpoint(base_dir);
    return as_language_model(
        build_hf_model_with_adapter(base, read_peft_adapter(adapter_dir, base)));
  };
  f.hf_tokenizer = [](const std::string& dir) {
    return std::make_shared<const data::HfTokenizer>(data::HfTokenizer::load(dir));
  };
  f.hf_export = [](LanguageModel& model, const data::Tokenizer& tokenizer,
                   const std::string& source_dir) {
    TransformerLM transformer(std::dynamic_pointer_cast<TransformerLMImpl>(model.ptr()));
    return hf_export_transformer(transformer, tokenizer, source_dir);
  };
  return f;
}

}  // namespace dnallm::models
