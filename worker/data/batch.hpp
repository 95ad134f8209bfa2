// The contract between the data pipeline (worker/data) and the trainer (worker/train).
// Plain host memory, no LibTorch: the trainer wraps these vectors into tensors.
//
// Exactness (DESIGN.md): which samples a global batch holds, and every random choice made
// for a sample (window position, reverse complement, masking), depend only on
// (seed, epoch, global sample index), never on the rank or world size. A rank's
// micro-batch is a contiguous slice of the global batch.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace dnallm::data {

inline constexpr int64_t kIgnoreIndex = -100;  // label of a position that is not scored

struct Batch {
  int64_t rows = 0;     // sequences in this micro-batch
  int64_t seq_len = 0;  // tokens per row (padded)

  std::vector<int64_t> input_ids;       // [rows * seq_len]
  std::vector<int64_t> attention_mask;  // [rows * seq_len]: 1 real token, 0 padding
  // Packing: document id of each token within its row (1, 2, ...; 0 padding). Tokens attend
  // only within their document. Empty when the batch is not packed.
  std::vector<int64_t> segment_ids;  // [rows * seq_len] or empty
  // Language modelling: per-token targets, kIgnoreIndex where not scored  [rows * seq_len].
  // Classification: one class per row [rows]. Empty for regression.
  std::vector<int64_t> labels;
  std::vector<float> targets;  // regression: one value per row [rows]

  std::vector<uint64_t> sample_ids;  // global sample index of each row
  int64_t num_label_tokens = 0;      // entries of `labels` != kIgnoreIndex
  int64_t num_bases = 0;             // real (non-special, non-pad) bases in the batch
  // Whether any attention_mask entry is 0 (set by the collator; unset: the trainer scans the
  // mask). Known on the host so the model needs no device read to choose a mask-free SDPA.
  std::optional<bool> padded;
};

}  // namespace dnallm::data
