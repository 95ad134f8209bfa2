// Training objectives and collation: turns samples into a Batch (batch.hpp).
//
// Framing (token layout of one sample, max_seq_length = L):
//   masked LM, classification, regression:  [CLS] t1 .. tn [SEP]      n <= L - 2
//   causal LM:                              [CLS] t1 .. tn            n <= L - 1
// ([CLS] serves as the causal model's beginning-of-sequence token.)
//
// Labels:
//   masked LM: each non-special token is selected with probability mlm_probability; of the
//     selected, 80% become [MASK], 10% a uniformly random regular token, 10% stay. labels =
//     the original id at selected positions, kIgnoreIndex elsewhere. Special tokens, [UNK]
//     and the tokenizer's N token are never selected.
//   causal LM: labels == input_ids at the same positions (NOT shifted): the model shifts,
//     as Hugging Face does (logits[i] predicts labels[i + 1]). labels is kIgnoreIndex at
//     position 0 ([CLS], never a target), at padding, and at [UNK]/N tokens, so
//     num_label_tokens counts exactly the scored targets.
//   classification: labels = one class per row; regression: targets = one value per row
//     (num_label_tokens = rows for both: the scored values).
// Every random choice comes from the sample's own rng (Note [Sample seeding]).
//
// Collation: rows are padded with [PAD] to the longest row in the micro-batch
// (attention_mask 0 there). With packing, samples are placed in order into rows of
// max_seq_length (next fit); segment_ids number the documents of a row 1, 2, ...; the
// micro-batch keeps all its samples, so it may have fewer rows than samples.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "worker/data/batch.hpp"
#include "worker/data/dataset.hpp"
#include "worker/data/tokenizer.hpp"

namespace dnallm::data {

enum class Objective { kMaskedLm, kCausalLm, kClassification, kRegression };

// From model.arch and model.task: bert, caduceus, caduceus-ps -> masked LM; gpt, hyena -> causal
// LM; task classification/regression override.
Objective objective_from(cfg::Arch arch, cfg::Task task);

struct ObjectiveOptions {
  Objective objective = Objective::kMaskedLm;
  int64_t max_seq_length = 512;  // tokens per row, specials included
  double mlm_probability = 0.15;
  // Evaluation: every selected position becomes [MASK] (no 10% random / 10% unchanged), so a
  // scored position never shows its own base and bits_per_base is an honest code length.
  bool mask_all_selected = false;
  bool packing = false;
  int64_t num_labels = 2;  // classification: labels must be in [0, num_labels)
};

// Regular tokens a sample may hold after framing.
int64_t token_budget(const ObjectiveOptions& options);

// One sample after tokenization, framing and labelling (before padding).
struct EncodedSample {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;  // LM: per token; empty for classification/regression
  int64_t label = -1;           // classification
  float target = 0.0F;          // regression
  int64_t num_bases = 0;
  uint64_t sample_id = 0;
};

// Tokenizes, frames and labels one sample. `rng` drives masking.
EncodedSample encode_sample(const Sample& sample, uint64_t sample_id, const Tokenizer& tokenizer,
                            const ObjectiveOptions& options, SampleRng& rng);

// Pads (or packs) encoded samples, in order, into one micro-batch.
Batch collate(std::vector<EncodedSample> samples, const ObjectiveOptions& options);

}  // namespace dnallm::data
