// Note [One model loader]: `--model DIR` means the same in dnallm-eval and dnallm-infer, and
// the layouts are those dnallm-train's model.init_from reads (ours, a Hugging Face directory;
// the family's import builds the model in our token ids there, for training). What a directory
// is, is decided once, here, from its content, never by trying one reader and reporting its
// failure as bad data:
//   1. config.json with "dnallm_arch": a directory of ours (final/, best/, a checkpoint's
//      export), with our tokenizer.json;
//   2. adapter_config.json: a PEFT adapter, applied on its base (adapter_config.json's
//      base_model_name_or_path when it names a directory, else the caller's --base);
//   3. config.json that a family recognises (model_type, auto_map): a Hugging Face directory as
//      downloaded (BERT/DNABERT-1, DNABERT-2, ESM/NT-v1/NT-v2, RoBERTa-PreLN, GPT-NeoX, Llama,
//      HyenaDNA, Caduceus Ph and PS), run in its own token ids with its own tokenizer;
//   4. anything else: one exit-2 message naming what was looked at and the supported layouts.
// The model comes back in eval mode on the CPU with the codec of its own tokenizer (Note
// [Sequence codec]), so that a sequence is tokenized, framed and scored as the model's
// reference implementation does.
#pragma once

#include <memory>
#include <string>

#include "worker/data/sequence_codec.hpp"
#include "worker/models/language_model.hpp"
#include "worker/models/registry.hpp"

namespace dnallm::models {

enum class DirLayout { kOurs, kHub, kPeftAdapter };

struct ModelDirectory {
  std::string dir;
  DirLayout layout = DirLayout::kOurs;
  const ModelFamily* family = nullptr;  // hub and PEFT (its base's); ours: by model_type
  std::string base_dir;                 // PEFT: the base directory
  std::string describe() const;         // "a Hugging Face hyenadna directory", ...
};

// What `dir` is (the rules above); Error(kUsage) when it is none of them. `base_dir`: a PEFT
// adapter's base when its adapter_config.json does not name one that exists ("" : none).
ModelDirectory identify_model_dir(const std::string& dir, const std::string& base_dir = "");

struct LoadedModel {
  LanguageModel model{nullptr};
  std::shared_ptr<data::SequenceCodec> codec;
  ModelDirectory source;
};

// The model of `dir` and its tokenizer (eval mode, CPU). Error(kUsage) for a directory that is
// not a model, Error(kBadData)/Error(kCheckpointCorrupt) for damaged files. A Hugging Face
// model's tokenizer files are read from `tokenizer_dir` when given, else from a PEFT adapter's
// directory when it holds them, else from the model's.
LoadedModel load_model_dir(const std::string& dir, const std::string& base_dir = "",
                           const std::string& tokenizer_dir = "");

}  // namespace dnallm::models
