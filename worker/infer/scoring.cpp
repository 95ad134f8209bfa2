#include "worker/infer/scoring.hpp"

#include <algorithm>
#include <cmath>

#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "worker/data/sequence_reader.hpp"
#include "worker/infer/inference.hpp"

namespace dnallm::infer {
namespace {

using torch::Tensor;

// A window's framed ids, and which tokens are scored with how many bases each.
struct Window {
  std::vector<int64_t> ids;
  std::vector<int64_t> scored;  // positions in ids
  std::vector<int64_t> bases;   // bases of each scored token
};

Window frame_window(const data::SequenceCodec& codec, const std::string& bases, bool causal) {
  Window w;
  w.ids = codec.frame(bases, 0);
  const bool overlapping = !codec.tiles_bases();
  for (int64_t t = causal ? 1 : 0; t < static_cast<int64_t>(w.ids.size()); ++t) {
    const auto piece = codec.bases_of(w.ids[static_cast<size_t>(t)]);
    if (piece.empty()) continue;
    w.scored.push_back(t);
    w.bases.push_back(overlapping ? 1 : static_cast<int64_t>(piece.size()));
  }
  return w;
}

// Causal: the windows of a batch in one pass, the next-token log-probabilities of their scored
// tokens. Right-padded: a causal model's real positions never see the padding after them.
void score_causal(models::LanguageModel& model, std::vector<Window>& windows, int64_t pad_id,
                  const torch::Device& device, LikelihoodScore& s) {
  if (windows.empty()) return;
  std::vector<std::vector<int64_t>> rows;
  for (const auto& w : windows) rows.push_back(w.ids);
  auto in = pad_batch(rows, pad_id, device);
  auto logp = torch::log_softmax(model->forward(in).logits.to(torch::kFloat32), -1)
                  .to(torch::kCPU)
                  .contiguous();
  auto a = logp.accessor<float, 3>();
  for (size_t r = 0; r < windows.size(); ++r) {
    const auto& w = windows[r];
    for (size_t i = 0; i < w.scored.size(); ++i) {
      const auto t = w.scored[i];
      s.log_prob += a[static_cast<int64_t>(r)][t - 1][w.ids[static_cast<size_t>(t)]];
      s.tokens += 1;
      s.bases += w.bases[i];
    }
  }
  s.forward_passes += static_cast<int64_t>(windows.size());
  windows.clear();
}

// Masked: a pass a scored token (Note [Likelihood of a genome]), `batch` rows at a time.
void score_masked(models::LanguageModel& model, const data::SequenceCodec& codec, const Window& w,
                  int64_t batch, const torch::Device& device, LikelihoodScore& s) {
  const int64_t span =
      codec.tiles_bases()
          ? 0
          : static_cast<int64_t>(
                codec.bases_of(w.ids[static_cast<size_t>(w.scored.empty() ? 0 : w.scored[0])])
                    .size()) -
                1;
  const auto n = static_cast<int64_t>(w.scored.size());
  for (int64_t start = 0; start < n; start += batch) {
    const int64_t stop = std::min(n, start + batch);
    std::vector<std::vector<int64_t>> rows;
    for (int64_t i = start; i < stop; ++i) {
      auto row = w.ids;
      const auto t = w.scored[static_cast<size_t>(i)];
      for (int64_t j = std::max<int64_t>(0, t - span);
           j <= std::min<int64_t>(static_cast<int64_t>(row.size()) - 1, t + span); ++j) {
        if (j == t || !codec.bases_of(row[static_cast<size_t>(j)]).empty()) {
          row[static_cast<size_t>(j)] = codec.mask_id();
        }
      }
      rows.push_back(std::move(row));
    }
    auto in = pad_batch(rows, codec.pad_id(), device);
    auto logp = torch::log_softmax(model->forward(in).logits.to(torch::kFloat32), -1)
                    .to(torch::kCPU)
                    .contiguous();
    auto a = logp.accessor<float, 3>();
    for (int64_t i = start; i < stop; ++i) {
      const auto t = w.scored[static_cast<size_t>(i)];
      s.log_prob += a[i - start][t][w.ids[static_cast<size_t>(t)]];
      s.tokens += 1;
      s.bases += w.bases[static_cast<size_t>(i)];
    }
    s.forward_passes += stop - start;
  }
}

}  // namespace

double LikelihoodScore::bits_per_base() const {
  return bases > 0 ? -log_prob / std::log(2.0) / double(bases) : 0.0;
}

int64_t default_window(const models::ModelSpec& spec, const data::SequenceCodec& codec) {
  const bool causal = spec.causal();
  const int64_t most = causal ? 4096 : 512;
  return std::max<int64_t>(1, std::min(most, spec.usable_positions() - codec.framing_tokens()));
}

LikelihoodScore score_likelihood(models::LanguageModel model, const data::SequenceCodec& codec,
                                 const std::string& fasta, const LikelihoodOptions& options,
                                 const torch::Device& device) {
  const auto& spec = model->spec();
  DNALLM_CHECK(spec.task == models::Task::kPretrain, ExitCode::kUsage,
               "--fasta scores a language model; this one is a {} model: score it on a labelled "
               "table with --table",
               models::task_name(spec.task));
  const bool causal = spec.causal();
  DNALLM_CHECK(causal || codec.mask_id() >= 0, ExitCode::kUsage,
               "the masked language model's tokenizer ({}) has no mask token: its "
               "pseudo-log-likelihood cannot be computed",
               codec.describe());
  int64_t window = options.window > 0 ? options.window : default_window(spec, codec);
  // Issue 57 item 5: a window past what the model takes is cut to it, with a warning: the bases
  // its positions hold at its longest token (8 times that where its positions extend past its
  // length; a window of 10^9 bases held GBs).
  const int64_t fits = bases_positions_hold(spec, codec);
  const int64_t largest = spec.extends_past_max_length ? kWindowExtendFactor * fits : fits;
  if (window > largest) {
    spdlog::warn(
        "--window {} bases is more than the model takes (its {} positions hold at most "
        "{} bases{}): windows of {} bases",
        window, spec.usable_positions(), fits,
        spec.extends_past_max_length ? "; 8 times that past its length" : "", largest);
    window = largest;
  }
  LikelihoodScore s;
  s.pseudo = !causal;
  s.window = window;
  torch::InferenceMode inference;
  data::SequenceReader reader(fasta);
  reader.set_keep_case(codec.keeps_case());
  // Bases past --max-bases are never scored: not kept (Note [Long records]).
  if (options.max_bases > 0) reader.set_max_bases(options.max_bases);
  data::LowerCaseReport lower_case;
  std::vector<Window> pending;  // causal windows waiting for a full batch
  data::SequenceRecord rec;
  Progress progress("score (windows)", 0, 10.0);
  int64_t seen = 0;
  while ((options.max_bases <= 0 || seen < options.max_bases) && reader.next(rec)) {
    for (size_t at = 0; at < rec.bases.size(); at += static_cast<size_t>(window)) {
      if (options.max_bases > 0 && seen >= options.max_bases) break;
      const auto piece = rec.bases.substr(at, static_cast<size_t>(window));
      seen += static_cast<int64_t>(piece.size());
      const auto w = frame_window(codec, piece, causal);
      lower_case.add(piece, w.ids, codec.unk_id());
      if (w.scored.empty()) continue;
      DNALLM_CHECK(spec.extends_past_max_length ||
                       static_cast<int64_t>(w.ids.size()) <= spec.usable_positions(),
                   ExitCode::kUsage,
                   "--window {} bases make {} tokens, more than the model's {} positions: give "
                   "a smaller --window",
                   window, w.ids.size(), spec.usable_positions());
      if (causal) {
        pending.push_back(w);
        if (static_cast<int64_t>(pending.size()) >= options.batch_size) {
          score_causal(model, pending, codec.pad_id(), device, s);
        }
      } else {
        score_masked(model, codec, w, options.batch_size, device, s);
      }
      s.windows += 1;
      progress.advance(1);
    }
  }
  score_causal(model, pending, codec.pad_id(), device, s);
  progress.finish();
  lower_case.warn();
  DNALLM_CHECK(s.tokens > 0, ExitCode::kBadData, "{} holds no sequence to score", fasta);
  return s;
}

}  // namespace dnallm::infer
