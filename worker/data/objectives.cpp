#include "worker/data/objectives.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace dnallm::data {

Objective objective_from(cfg::Arch arch, cfg::Task task) {
  switch (task) {
    case cfg::Task::kClassification:
      return Objective::kClassification;
    case cfg::Task::kRegression:
      return Objective::kRegression;
    case cfg::Task::kPretrain:
      break;
  }
  // The model families' objectives (worker/models/registry.hpp): encoders pre-train as masked
  // LMs, decoders as causal LMs.
  switch (arch) {
    case cfg::Arch::kBert:
    case cfg::Arch::kCaduceus:
    case cfg::Arch::kCaduceusPs:
      return Objective::kMaskedLm;
    case cfg::Arch::kGpt:
    case cfg::Arch::kHyena:
      return Objective::kCausalLm;
  }
  fail(ExitCode::kFailure, "objective_from: model.arch {} has no objective",
       static_cast<int>(arch));
}

int64_t token_budget(const ObjectiveOptions& options) {
  return options.max_seq_length - (options.objective == Objective::kCausalLm ? 1 : 2);
}

namespace {
// Tokens that are never masked nor scored: specials, [UNK] and the N token.
bool unscorable(int64_t id, int64_t n_id) { return id < kFirstRegularId || id == n_id; }
}  // namespace

EncodedSample encode_sample(const Sample& sample, uint64_t sample_id, const Tokenizer& tokenizer,
                            const ObjectiveOptions& options, SampleRng& rng) {
  EncodedSample out;
  out.sample_id = sample_id;
  const int64_t budget = token_budget(options);
  DNALLM_CHECK(budget > 0, ExitCode::kUsage, "model.max_seq_length = {} leaves no room for tokens",
               options.max_seq_length);
  std::vector<int64_t> tokens = tokenizer.encode(sample.bases);
  if (static_cast<int64_t>(tokens.size()) > budget) tokens.resize(budget);
  out.num_bases =
      std::min<int64_t>(static_cast<int64_t>(sample.bases.size()),
                        tokenizer.bases_for_tokens(static_cast<int64_t>(tokens.size())));
  out.input_ids.reserve(tokens.size() + 2);
  out.input_ids.push_back(kClsId);
  out.input_ids.insert(out.input_ids.end(), tokens.begin(), tokens.end());
  if (options.objective != Objective::kCausalLm) out.input_ids.push_back(kSepId);

  const int64_t n_id = tokenizer.n_id();
  const int64_t vocab = tokenizer.vocab_size();
  switch (options.objective) {
    case Objective::kMaskedLm: {
      out.labels.assign(out.input_ids.size(), kIgnoreIndex);
      for (size_t i = 0; i < out.input_ids.size(); ++i) {
        const int64_t id = out.input_ids[i];
        if (unscorable(id, n_id)) continue;
        if (rng.uniform01() >= options.mlm_probability) continue;
        out.labels[i] = id;
        const double r = rng.uniform01();  // drawn in both modes: same positions, same stream
        if (options.mask_all_selected || r < 0.8) {
          out.input_ids[i] = kMaskId;
        } else if (r < 0.9) {
          out.input_ids[i] =
              kFirstRegularId + static_cast<int64_t>(rng.uniform(vocab - kFirstRegularId));
        }
      }
      break;
    }
    case Objective::kCausalLm: {
      out.labels = out.input_ids;
      out.labels[0] = kIgnoreIndex;
      for (auto& l : out.labels) {
        if (l != kIgnoreIndex && unscorable(l, n_id)) l = kIgnoreIndex;
      }
      break;
    }
    case Objective::kClassification:
      out.label = sample.label;
      break;
    case Objective::kRegression:
      out.target = sample.target;
      break;
  }
  return out;
}

Batch collate(std::vector<EncodedSample> samples, const ObjectiveOptions& options) {
  Batch b;
  const bool lm =
      options.objective == Objective::kMaskedLm || options.objective == Objective::kCausalLm;
  // Row assignment: each sample alone, or next-fit packing in order.
  std::vector<std::vector<size_t>> rows;
  if (options.packing) {
    DNALLM_CHECK(lm, ExitCode::kUsage,
                 "data.packing needs a language-modelling task (one label per row otherwise)");
    int64_t used = 0;
    for (size_t i = 0; i < samples.size(); ++i) {
      auto len = static_cast<int64_t>(samples[i].input_ids.size());
      if (rows.empty() || used + len > options.max_seq_length) {
        rows.emplace_back();
        used = 0;
      }
      rows.back().push_back(i);
      used += len;
    }
  } else {
    for (size_t i = 0; i < samples.size(); ++i) rows.push_back({i});
  }
  int64_t seq_len = 0;
  for (const auto& row : rows) {
    int64_t len = 0;
    for (size_t i : row) len += static_cast<int64_t>(samples[i].input_ids.size());
    seq_len = std::max(seq_len, len);
  }
  if (options.packing) seq_len = options.max_seq_length;
  b.rows = static_cast<int64_t>(rows.size());
  b.seq_len = seq_len;
  const auto n = static_cast<size_t>(b.rows * seq_len);
  b.input_ids.assign(n, kPadId);
  b.attention_mask.assign(n, 0);
  if (options.packing) b.segment_ids.assign(n, 0);
  if (lm) b.labels.assign(n, kIgnoreIndex);
  for (size_t r = 0; r < rows.size(); ++r) {
    size_t pos = r * static_cast<size_t>(seq_len);
    int64_t segment = 0;
    for (size_t i : rows[r]) {
      const auto& s = samples[i];
      ++segment;
      std::copy(s.input_ids.begin(), s.input_ids.end(), b.input_ids.begin() + pos);
      std::fill_n(b.attention_mask.begin() + pos, s.input_ids.size(), 1);
      if (options.packing) std::fill_n(b.segment_ids.begin() + pos, s.input_ids.size(), segment);
      if (lm) std::copy(s.labels.begin(), s.labels.end(), b.labels.begin() + pos);
      pos += s.input_ids.size();
      b.num_bases += s.num_bases;
      b.sample_ids.push_back(s.sample_id);
    }
  }
  b.padded =
      std::find(b.attention_mask.begin(), b.attention_mask.end(), 0) != b.attention_mask.end();
  if (options.objective == Objective::kClassification) {
    for (const auto& s : samples) b.labels.push_back(s.label);
  } else if (options.objective == Objective::kRegression) {
    for (const auto& s : samples) b.targets.push_back(s.target);
  }
  if (lm) {
    b.num_label_tokens = std::count_if(b.labels.begin(), b.labels.end(),
                                       [](int64_t l) { return l != kIgnoreIndex; });
  } else {
    b.num_label_tokens = b.rows;  // one class or target per row
  }
  return b;
}

}  // namespace dnallm::data
