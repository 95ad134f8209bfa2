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
#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"
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

}  // namespace dnallm::models
