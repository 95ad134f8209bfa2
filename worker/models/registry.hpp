// Note [Model registry]: the families behind the model interface (Note [Model interface]), each
// found by the name a user writes (model.arch), by the model_type of our own model directory's
// config.json, or by recognising a Hugging Face directory (its model_type and auto_map, never
// model_type alone where remote code reuses one: DNABERT-2 says "bert"). An unknown value is
// exit 2 naming it and the known ones, never a default. The families are listed in
// families.cpp (explicitly: a static library drops self-registering objects nobody calls).
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "worker/models/family_io.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::data {
class Tokenizer;
class HfTokenizer;
}  // namespace dnallm::data

namespace dnallm::models {

// What building a model may depend on besides the config: where it will run and how many
// ranks share the memory (for the memory prediction, Note [Model shape limits]).
struct BuildContext {
  bool on_cpu = true;
  int world_size = 1;
  int local_world_size = 1;
  // Note [Streamed build]: where a fresh model's blocks go as they are built (ZeRO-3's sink);
  // null: built whole. Set only where nothing reads the whole model before placement
  // (streams_blocks()); a family's build installs it around its constructor alone.
  BlockSink* blocks = nullptr;
  // The trainable parameters of the checkpoint this run resumes (its layout's names); empty
  // for a fresh run. A family keeps a layout it has since changed (Note [Caduceus tied head]).
  std::set<std::string> resumed_parameters;
};

// Note [Streamed build]: whether `config` builds a model that nothing reads whole before
// placement: not under training.batch_size = "auto" (its probe runs the whole model). A family
// whose build starts from a directory (ours or a Hugging Face one), adds LoRA or quantizes its
// base (QLoRA) fills each block, adds its adapters and quantizes it as it is built (FillingSink,
// Note [LoRA block by block]) or builds whole (installs no sink).
bool streams_blocks(const Config& config);

struct ModelFamily {
  std::string name;                         // "transformer", "hyena", "caduceus"
  std::vector<cfg::Arch> arches;            // the model.arch values it builds
  std::vector<std::string> exported_types;  // model_type in our config.json
  // True when a Hugging Face config.json (not ours) is this family's.
  bool (*recognises_hf)(const nlohmann::json& config) = nullptr;
  // Note [Memory predicted]: Error(kUsage) when the model build_model_for() would build (from
  // [model], or model.init_from) would not fit, before anything is built (null: the family
  // predicts nothing).
  void (*check_memory)(const Config& config, const data::Tokenizer& tokenizer,
                       const BuildContext& context) = nullptr;
  // A fresh model from [model] (and model.init_from = one of our model directories).
  LanguageModel (*build)(const Config& config, const data::Tokenizer& tokenizer,
                         const BuildContext& context) = nullptr;
  // model.init_from = a Hugging Face directory of this family (fine-tuning); `context.blocks`
  // as for build.
  LanguageModel (*init_from_hf)(const Config& config, const data::Tokenizer& tokenizer,
                                const BuildContext& context) = nullptr;
  // Note [One model loader]: a Hugging Face directory of this family as downloaded, in its own
  // token ids (the logits' columns are its vocabulary's), eval mode; and its tokenizer as
  // transformers loads it (null: the family has no hub layout to run).
  LanguageModel (*load_hf)(const std::string& dir) = nullptr;
  std::shared_ptr<const data::HfTokenizer> (*hf_tokenizer)(const std::string& dir) = nullptr;
  // A PEFT LoRA adapter directory applied on a Hugging Face base of this family (null: none).
  LanguageModel (*load_hf_with_adapter)(const std::string& base_dir,
                                        const std::string& adapter_dir) = nullptr;
  // Our model directory (config.json already parsed) back into a model, eval mode.
  LanguageModel (*load_exported)(const std::string& dir, const nlohmann::json& config) = nullptr;
  // The Hugging Face layout of `model` next to our export (final/hf): what hf_export plans,
  // every rank the same (it reads only the model's structure and options); nullopt when this
  // model has no such layout (the family says why in a warning), Error(kUsage) when what it
  // holds has none. `source_dir`: the directory it was imported from, if any.
  std::optional<HfExport> (*hf_export)(LanguageModel& model, const data::Tokenizer& tokenizer,
                                       const std::string& source_dir) = nullptr;
  // The module names under which adapter_model.safetensors holds the adapter of `module`, one of
  // `model`'s LoRA targets, for PEFT to apply it to the Hugging Face layout (Note [Caduceus PEFT
  // names]); null: `module` itself (the layouts name it alike).
  std::vector<std::string> (*peft_module_names)(LanguageModel& model,
                                                const std::string& module) = nullptr;
};

// Every registered family, in families.cpp (the table: a new family adds its line there).
const std::vector<ModelFamily>& model_families();

// The family of model.arch. Every cfg::Arch has one (ModelRegistry.EveryFamily... builds each);
// one without is an internal error.
const ModelFamily& family_for_arch(cfg::Arch arch);
// The family whose Hugging Face layout `config` (a config.json, `where` names it) is; exit 2
// naming its model_type and the known ones.
const ModelFamily& family_for_hf_config(const nlohmann::json& config, const std::string& where);

// True when `dir`/config.json is a Hugging Face config (not one written by export_live_model).
bool is_hf_model_dir(const std::string& dir);

// Note [Memory predicted]: the model build_model_for() would build refused (Error(kUsage) with
// the figures) when it cannot fit, before anything is built; dnallm-train calls it before the
// ranks connect, so that each refuses on its own instead of leaving its peers in a collective.
// A Hugging Face base (model.init_from) is predicted by families that can (the transformer
// family, from its config.json and weights header).
void check_model_memory(const Config& config, const data::Tokenizer& tokenizer,
                        const BuildContext& context);

// The model a training run starts from: model.init_from's family when it names a Hugging Face
// directory, else model.arch's.
LanguageModel build_model_for(const Config& config, const data::Tokenizer& tokenizer,
                              const BuildContext& context);

// The live model as our model directory (Note [Exported model directory] in
// checkpoint/safetensors.hpp): <dir>/model.safetensors (fp32, LoRA merged into a copy),
// <dir>/config.json (export_config()), and with LoRA also <dir>/adapter_model.safetensors (the
// adapters alone, PEFT names "base_model.model.<module>.lora_A.weight"). tokenizer.json is the
// caller's (the trainer's write_tokenizer hook).
void export_live_model(LanguageModel model, const std::string& dir);

// Note [Exports unit by unit] (family_io.hpp): the same files from a model sharded across ranks
// (ZeRO-3), gathered a unit at a time by `units` (collective: every rank calls this); `write`:
// this rank writes the files (rank 0), the others only take part in `units`.
void export_live_model(LanguageModel model, const std::string& dir, const ParameterUnits& units,
                       bool write);

// Reads a directory written by export_live_model() or checkpoint::export_checkpoint_model():
// config.json's model_type picks the family (unknown: exit 2 naming it).
LanguageModel load_exported_model(const std::string& dir);

// The Hugging Face layout of `model` in `dir` (final/hf), through its family's hf_export. False
// (a warning naming why, `dir` removed) when the model has none. The second form is
// collective, as export_live_model()'s (Note [Exports unit by unit]).
bool export_hf_directory(LanguageModel model, const data::Tokenizer& tokenizer,
                         const std::string& dir, const std::string& source_dir = "");
bool export_hf_directory(LanguageModel model, const data::Tokenizer& tokenizer,
                         const std::string& dir, const std::string& source_dir,
                         const ParameterUnits& units, bool write);

}  // namespace dnallm::models
