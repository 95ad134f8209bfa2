// What the families with a module of their own (HyenaDNA, Caduceus) share: their published
// checkpoints' character vocabulary, and strict loading of our model directory.
//
// Note [Character vocabularies]: HyenaDNA's and Caduceus' CharacterTokenizer number [CLS] 0,
// [SEP] 1, [BOS] 2, [MASK] 3, [PAD] 4, [RESERVED] 5, [UNK] 6 and the characters from 7 (A C G
// T N in the published models); ours numbers [PAD] 0 [UNK] 1 [CLS] 2 [SEP] 3 [MASK] 4 and the
// bases from 5. Fine-tuning a published checkpoint (model.init_from) gathers its embedding and
// output rows into our order once, so the data pipeline needs no second tokenizer; the export
// to the hub layout (final/hf) scatters them back (rows we have no token for, [BOS] and
// [RESERVED], come back as the checkpoint had them).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include "core/config.hpp"

#include "core/dtype.hpp"
#include "worker/models/lora_linear.hpp"

namespace dnallm::data {
class Tokenizer;
}

namespace dnallm::models {

// Note [Character vocabularies]: our token id -> the checkpoint's (-1: none), for `ours` (one
// token a base: tokenizer.kind = "char", else exit 2) against the CharacterTokenizer layout,
// checked against `dir`'s tokenizer_config.json where it has one. `family` names the model in
// messages.
std::vector<int64_t> character_vocabulary_map(const data::Tokenizer& ours, const std::string& dir,
                                              int64_t their_vocab, const std::string& family);

// Rows `map[i]` of `theirs` ([their rows, ...]) in our order [map.size(), ...]; rows without a
// counterpart keep `fresh`'s.
torch::Tensor gather_rows(const torch::Tensor& theirs, const std::vector<int64_t>& map,
                          const torch::Tensor& fresh);
// The inverse, in place: `theirs` (a tensor in the checkpoint's token order) becomes `source`
// (its rows as imported; undefined: its own values) with rows map[i] replaced by ours[i].
void scatter_rows(torch::Tensor& theirs, const torch::Tensor& ours, const std::vector<int64_t>& map,
                  const torch::Tensor& source);

// The parameters of `from` copied into `to` where name and shape agree (a new head keeps its
// fresh values); returns how many.
int64_t copy_matching_parameters(torch::nn::Module& from, torch::nn::Module& to);

// A hub layout's tokenizer files (tokenizer_config.json, special_tokens_map.json) copied from
// the directory `from` (the one a model was imported from; "" or absent files: nothing) to `dir`.
void copy_tokenizer_files(const std::string& from, const std::string& dir);

// Every tensor of `targets` from <dir>/model.safetensors, by name; a missing tensor (unless
// `derived` says it is computed from config.json, as a buffer the model regenerates), a shape
// that disagrees or a tensor the model does not have is exit 5 naming it.
void load_named_tensors(const std::vector<std::pair<std::string, torch::Tensor>>& targets,
                        const std::string& dir,
                        const std::function<bool(const std::string&)>& derived = nullptr);

// Note [Family LoRA targets]: [lora] for a family whose target linears are named `all`
// (HyenaDNA: in_proj out_proj fc1 fc2; Caduceus: in_proj out_proj). lora.target_modules
// selects among them; its default, the transformer's ["query", "value"], means all of them. A
// name outside `all` is exit 2 naming it, as is lora.quantize_base other than "none" (QLoRA is
// the transformer's), with or without adapters. lora.r = 0: r = 0 (no adapters).
LoraOptions family_lora_options(const Config& config, const std::vector<std::string>& all,
                                const std::string& family);

// Note [Exports unit by unit]: a model sharded across ranks (ZeRO-3) is never whole on one rank,
// so its exports gather it a unit at a time. `units` calls its argument once or more, the same
// calls on every rank (collective); during each call `held(t)` tells whether tensor `t` (a
// parameter or buffer of the model) holds its current value, in fp32 where it trains in fp32
// (the master values under bf16 gathers). Every tensor an export reads must be held in some
// call, and each exported tensor is written in the first call that holds all it reads: a
// weight as itself, a LoRA linear's merged weight from its base and adapters (one block's,
// gathered together), a fused or renamed Hugging Face tensor from what it is made of (one
// block's), a table computed from the config from nothing. Each file's header is written first
// (names, dtypes, shapes) and each tensor at its offset (checkpoint::SafetensorsWriter), so the
// writing rank holds one exported tensor at a time besides what `units` gathers, and each file
// appears (rename) only when complete. Our own directory (export_live_model, registry.hpp) and
// every family's Hugging Face layout (ModelFamily::hf_export) are written this way.
using HeldTensor = std::function<bool(const torch::Tensor&)>;
using ParameterUnits = std::function<void(const std::function<void(const HeldTensor& held)>&)>;
// A model on one process: one call, every tensor held.
ParameterUnits whole_model_units();

// What an export writes of one tensor: its name, dtype and shape in the file, the tensors
// computing it reads, and the computation (run once, when everything it reads is held).
struct ExportedTensor {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  std::vector<torch::Tensor> reads;
  std::function<torch::Tensor()> value;
};
// `t` as it is, on the host (floating point in fp32, integers in their own type); reads `t`.
ExportedTensor live_tensor(const std::string& name, const torch::Tensor& t);
// A tensor that reads nothing the ranks shard (zeros, a table from the config): `make` runs
// when the file is written.
ExportedTensor computed_tensor(const std::string& name, std::vector<int64_t> shape,
                               std::function<torch::Tensor()> make);
// `from`'s value under another name.
ExportedTensor renamed_tensor(const ExportedTensor& from, const std::string& name);
// `combine` of `inputs`' values (in fp32), of `shape`: reads what they read.
ExportedTensor combined_tensor(
    const std::string& name, std::vector<int64_t> shape, const std::vector<ExportedTensor>& inputs,
    std::function<torch::Tensor(const std::vector<torch::Tensor>&)> combine);
// How an export reads the tensors of `module`: a LoRA or quantized linear's weight (by its
// tensor) in full precision, its adapters merged when `merge_adapters` (from its base and
// adapters: the linear's parameters and buffers), every other tensor as itself (live_tensor).
class LiveWeights {
 public:
  LiveWeights(torch::nn::Module& module, bool merge_adapters);
  ExportedTensor operator()(const std::string& name, const torch::Tensor& t) const;

 private:
  std::map<const void*, std::shared_ptr<LoraLinearImpl>> linears_;
  bool merge_;
};

// How an export reads one named tensor of a model (a LiveWeights, or one wrapping it).
using WeightReader = std::function<ExportedTensor(const std::string&, const torch::Tensor&)>;

// Note [Character vocabularies]: the hub export of a model imported with a vocabulary map reads
// `embedding` (and the output rows `head`, when defined) scattered back into the checkpoint's
// token order (scatter_rows into `source_embedding` / `source_head`, as imported; rows we have
// no token for come back as the checkpoint had them, or zero where it kept none), every other
// tensor through `weight`.
WeightReader vocabulary_scatter(WeightReader weight, std::vector<int64_t> map,
                                const torch::Tensor& embedding,
                                const torch::Tensor& source_embedding, const torch::Tensor& head,
                                const torch::Tensor& source_head);

// One safetensors file of an export: its path under the export's directory, its tensors in
// header order, its metadata.
struct ExportedFile {
  std::string path;
  std::vector<ExportedTensor> tensors;
  std::map<std::string, std::string> metadata;
};
// Writes `files` under `dir` as `units` holds what their tensors read (Note [Exports unit by
// unit]); `write`: this rank writes (creating the directories), the others only take part in
// `units`. Error(kFailure) naming a tensor whose reads no call held.
void write_exported_files(const std::string& dir, const std::vector<ExportedFile>& files,
                          const ParameterUnits& units, bool write);

// A Hugging Face layout to write (Note [Exports unit by unit]): the safetensors
// files, streamed as the ranks gather the model, then the small files (config.json, the
// tokenizer's, remote code) that `finish` writes into the directory on the writing rank, and
// logs what it wrote.
struct HfExport {
  std::vector<ExportedFile> files;
  std::function<void(const std::string& dir)> finish;
};

// Note [Character vocabularies]: the options a model imported with a vocabulary map exports
// under: the checkpoint's (`source`) with our task head (`ours`), the imported config.json's
// architectures (`classifier_arch` or `lm_arch`) and num_labels saying so.
template <class Options>
Options hub_options(Options source, const Options& ours, const char* classifier_arch,
                    const char* lm_arch) {
  source.classifier = ours.classifier;
  source.num_labels = ours.num_labels;
  if (!source.hf_config.is_null()) {
    source.hf_config["architectures"] = {source.classifier ? classifier_arch : lm_arch};
    if (source.classifier) source.hf_config["num_labels"] = source.num_labels;
  }
  return source;
}

// A hub layout of a family with a module of its own (HyenaDNA's, Caduceus'): model.safetensors
// of `tensors`, then `config` as config.json and the tokenizer files of `source_dir`
// (copy_tokenizer_files); `family` names it in the log.
HfExport hub_layout_export(std::vector<ExportedTensor> tensors, nlohmann::json config,
                           const std::string& source_dir, const std::string& family);

}  // namespace dnallm::models
