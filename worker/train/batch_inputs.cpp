// See batch_inputs.hpp.
#include "worker/train/batch_inputs.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace dnallm::train {

int64_t label_count(const data::Batch& b, models::Task task) {
  if (task == models::Task::kRegression) return b.rows;
  if (b.num_label_tokens > 0) return b.num_label_tokens;
  int64_t n = 0;
  for (auto l : b.labels) n += l != data::kIgnoreIndex;
  return n;
}

int64_t real_tokens(const data::Batch& b) {
  if (b.attention_mask.empty()) return b.rows * b.seq_len;
  int64_t n = 0;
  for (auto m : b.attention_mask) n += m != 0;
  return n;
}

namespace {

// Note [Host-known batch facts] (worker/models/transformer/transformer.hpp): the facts the model
// would otherwise read back from the device, computed here from the host batch. Every int64 array
// of the micro-batch goes into ONE host buffer (pinned on CUDA) and one non-blocking copy.
class HostPack {
 public:
  int64_t add(const int64_t* data, size_t n) {
    const auto offset = static_cast<int64_t>(values_.size());
    values_.insert(values_.end(), data, data + n);
    return offset;
  }
  int64_t add(const std::vector<int64_t>& v) { return add(v.data(), v.size()); }
  // The buffer on `device`: one copy (non-blocking from pinned memory on CUDA).
  torch::Tensor to(const torch::Device& device) const {
    const auto n = static_cast<int64_t>(values_.size());
    auto options = torch::TensorOptions().dtype(torch::kInt64);
    if (!device.is_cpu()) options = options.pinned_memory(true);
    auto host = torch::empty({n}, options);
    std::copy(values_.begin(), values_.end(), host.data_ptr<int64_t>());
    // The caching host allocator keeps the pinned block until the copy has run.
    return device.is_cpu() ? host : host.to(device, /*non_blocking=*/true);
  }

 private:
  std::vector<int64_t> values_;
};

// Masked LM, scored positions only: per row the scored positions ascending, then the others
// ascending (the first M), and the row-major flat indices into [rows*M] of the scored ones.
// M = the largest scored count of a row (>= 1), rounded up to `multiple` (at most seq_len).
void mlm_selection(const data::Batch& b, int64_t multiple, std::vector<int64_t>& positions,
                   std::vector<int64_t>& selected, int64_t& m) {
  const int64_t t = b.seq_len;
  std::vector<int64_t> counts(static_cast<size_t>(b.rows), 0);
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t i = 0; i < t; ++i) counts[r] += b.labels[r * t + i] != data::kIgnoreIndex;
  }
  m = std::max<int64_t>(1, *std::max_element(counts.begin(), counts.end()));
  if (multiple > 1) m = std::min(t, (m + multiple - 1) / multiple * multiple);
  positions.assign(static_cast<size_t>(b.rows * m), 0);
  for (int64_t r = 0; r < b.rows; ++r) {
    int64_t k = 0;
    for (int pass = 0; pass < 2 && k < m; ++pass) {
      for (int64_t i = 0; i < t && k < m; ++i) {
        const bool scored = b.labels[r * t + i] != data::kIgnoreIndex;
        if (scored == (pass == 0)) positions[r * m + k++] = i;
      }
    }
    for (int64_t j = 0; j < counts[r]; ++j) selected.push_back(r * m + j);
  }
}

}  // namespace

models::ForwardInputs to_inputs(const data::Batch& b, const models::LanguageModel& model,
                                const torch::Device& device) {
  DNALLM_CHECK(int64_t(b.input_ids.size()) == b.rows * b.seq_len, ExitCode::kFailure,
               "batch has {} input ids for {} x {}", b.input_ids.size(), b.rows, b.seq_len);
  const auto& o = model->spec();
  const int64_t rows = b.rows, t = b.seq_len;
  HostPack pack;
  const int64_t ids_at = pack.add(b.input_ids);
  const int64_t mask_at = b.attention_mask.empty() ? -1 : pack.add(b.attention_mask);
  const int64_t seg_at = b.segment_ids.empty() ? -1 : pack.add(b.segment_ids);
  const int64_t labels_at = b.labels.empty() ? -1 : pack.add(b.labels);

  models::ForwardInputs in;
  in.padded = b.padded.has_value() ? *b.padded
                                   : std::find(b.attention_mask.begin(), b.attention_mask.end(),
                                               0) != b.attention_mask.end();
  // Host-known label facts for the loss (no nonzero()/item() on the device).
  int64_t positions_at = -1, selected_at = -1, index_at = -1, m = 0;
  std::vector<int64_t> index;
  const bool lm = o.task == models::Task::kPretrain && !b.labels.empty();
  if (lm && !o.causal() && b.segment_ids.empty()) {
    std::vector<int64_t> positions, selected;
    // Static-ish shapes on accelerators (the allocator reuses blocks); exact M on CPU.
    mlm_selection(b, device.is_cpu() ? 1 : 8, positions, selected, m);
    positions_at = pack.add(positions);
    selected_at = pack.add(selected);
    in.label_count = static_cast<int64_t>(selected.size());
    index = std::move(selected);
  } else if (lm) {
    const bool shift = o.shifts_labels();
    const int64_t width = shift ? t - 1 : t;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < width; ++i) {
        if (b.labels[r * t + i + (shift ? 1 : 0)] != data::kIgnoreIndex) {
          index.push_back(r * width + i);
        }
      }
    }
    index_at = pack.add(index);
    in.label_count = static_cast<int64_t>(index.size());
  } else if (o.task == models::Task::kClassification && !b.labels.empty()) {
    in.label_count = std::count_if(b.labels.begin(), b.labels.end(),
                                   [](int64_t l) { return l != data::kIgnoreIndex; });
  }

  auto all = pack.to(device);
  auto slice = [&](int64_t at, int64_t n) { return all.narrow(0, at, n); };
  in.input_ids = slice(ids_at, rows * t).view({rows, t});
  if (mask_at >= 0) in.attention_mask = slice(mask_at, rows * t).view({rows, t});
  if (seg_at >= 0) in.segment_ids = slice(seg_at, rows * t).view({rows, t});
  if (labels_at >= 0) {
    in.labels = o.task == models::Task::kPretrain ? slice(labels_at, rows * t).view({rows, t})
                                                  : slice(labels_at, rows);
  }
  if (positions_at >= 0) {
    in.mlm_positions = slice(positions_at, rows * m).view({rows, m});
    in.mlm_selected = slice(selected_at, static_cast<int64_t>(index.size()));
  }
  if (index_at >= 0) in.label_index = slice(index_at, static_cast<int64_t>(index.size()));
  if (!b.targets.empty()) {
    in.targets = torch::from_blob(const_cast<float*>(b.targets.data()), {b.rows}, torch::kFloat32)
                     .to(device, false, true);
  }
  return in;
}

}  // namespace dnallm::train
