#include "worker/infer/variants.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>

#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "worker/infer/inference.hpp"

namespace dnallm::infer {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

char complement(char b) {
  switch (b) {
    case 'A':
      return 'T';
    case 'C':
      return 'G';
    case 'G':
      return 'C';
    case 'T':
      return 'A';
    default:
      return 'N';
  }
}

// Row batches of `rows` (indices sorted by length): at most `batch` rows, one length only when
// the model's padding changes its result.
std::vector<std::vector<size_t>> batches(const std::vector<std::vector<int64_t>>& rows,
                                         size_t batch, bool equal_lengths) {
  std::vector<size_t> order(rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return rows[a].size() < rows[b].size(); });
  std::vector<std::vector<size_t>> out;
  for (size_t i = 0; i < order.size(); ++i) {
    if (out.empty() || out.back().size() >= batch ||
        (equal_lengths && rows[out.back().front()].size() != rows[order[i]].size())) {
      out.emplace_back();
    }
    out.back().push_back(order[i]);
  }
  return out;
}

}  // namespace

// Note [Variant windows]: the largest default window, in bases.
constexpr int64_t kMaxDefaultWindow = 1024;

int64_t default_variant_window(const models::ModelSpec& spec, const data::SequenceCodec& codec) {
  return std::min(kMaxDefaultWindow, bases_positions_hold(spec, codec));
}

VariantScorer::VariantScorer(models::LanguageModel model, const data::SequenceCodec& codec,
                             const VariantOptions& options, const torch::Device& device, Done done)
    : model_(std::move(model)),
      codec_(codec),
      options_(options),
      device_(device),
      done_(std::move(done)) {
  const auto& spec = model_->spec();
  DNALLM_CHECK(spec.task == models::Task::kPretrain, ExitCode::kUsage,
               "variant effects need a language model (its likelihoods); this one is a {} model",
               models::task_name(spec.task));
  causal_ = spec.causal();
  DNALLM_CHECK(causal_ || codec_.mask_id() >= 0, ExitCode::kUsage,
               "the masked language model's tokenizer ({}) has no mask token: no masked marginal",
               codec_.describe());
  DNALLM_CHECK(codec_.tiles_bases(), ExitCode::kUsage,
               "{} tokenizes DNA into overlapping k-mers (DNABERT-1): a variant sits in k tokens, "
               "so neither score of Note [Zero-shot variant effects] is defined for it; use a "
               "model with non-overlapping tokens (DNABERT-2, Nucleotide Transformer, a "
               "character-level model)",
               codec_.describe());
  const int64_t piece = most_bases_a_token(codec_);
  budget_ = std::max<int64_t>(1, spec.usable_positions() - codec_.framing_tokens());
  window_ = options_.window > 0 ? options_.window : default_variant_window(spec, codec_);
  // Note [Variant windows]: in bases, at most what the positions hold at `piece` bases a token.
  const int64_t fits = bases_positions_hold(spec, codec_);
  DNALLM_CHECK(spec.extends_past_max_length || window_ <= fits, ExitCode::kUsage,
               "--window {} bases do not fit the model's {} positions ({} framing tokens, at "
               "most {} bases a token): give --window <= {}",
               window_, spec.usable_positions(), codec_.framing_tokens(), piece, fits);
  const int64_t largest = kWindowExtendFactor * spec.usable_positions() * piece;
  DNALLM_CHECK(!spec.extends_past_max_length || window_ <= largest, ExitCode::kUsage,
               "--window {} bases: the largest window is {} bases ({}x the bases of the model's "
               "{} positions); give --window <= {}",
               window_, largest, kWindowExtendFactor, spec.usable_positions(), largest);
  check_fit_ = !spec.extends_past_max_length && piece > 1;
  spdlog::info(
      "variant window: {} bases centred on each variant ({}; the model's {} positions "
      "hold up to {} bases)",
      window_,
      options_.window > 0 ? "--window"
                          : "default: the bases its positions hold, at most "
                            "1,024",
      spec.usable_positions(), spec.extends_past_max_length ? largest : fits);
}

int64_t VariantScorer::site_tokens(const VariantSite& s) const {
  int64_t most = 0;
  const auto count = [&](const std::string& w) {
    most = std::max(most, static_cast<int64_t>(codec_.encode(w).size()));
    if (options_.rc_average) {
      most = std::max(most, static_cast<int64_t>(codec_.encode(reverse_complement(w)).size()));
    }
  };
  count(s.window);
  if (!causal_) return most;  // the masked row is the reference window's
  for (const char alt : s.alts) {
    auto w = s.window;
    w[static_cast<size_t>(s.offset)] = alt;
    count(w);
  }
  return most;
}

void VariantScorer::fit(VariantSite& s) {
  if (!check_fit_) return;
  bool narrowed = false;
  for (int64_t tokens = site_tokens(s); tokens > budget_; tokens = site_tokens(s)) {
    const auto length = static_cast<int64_t>(s.window.size());
    if (length <= 1) break;
    const int64_t shorter = std::max<int64_t>(1, std::min(length - 1, length * budget_ / tokens));
    const int64_t begin = std::clamp<int64_t>(s.offset - shorter / 2, 0, length - shorter);
    s.window = s.window.substr(static_cast<size_t>(begin), static_cast<size_t>(shorter));
    s.offset -= begin;
    narrowed = true;
  }
  narrowed_sites_ += narrowed ? 1 : 0;
}

void VariantScorer::add(VariantSite site) {
  fit(site);
  pending_.push_back(std::move(site));
  if (static_cast<int64_t>(pending_.size()) >= options_.batch_size) flush();
}

void VariantScorer::flush() {
  if (pending_.empty()) return;
  if (causal_) {
    flush_causal();
  } else {
    flush_masked();
  }
  next_site_ += pending_.size();
  pending_.clear();
}

void VariantScorer::for_each_log_probs(
    const std::vector<std::vector<int64_t>>& rows,
    const std::function<void(size_t, const torch::TensorAccessor<float, 2>&)>& read) {
  torch::InferenceMode inference;
  for (const auto& group :
       batches(rows, static_cast<size_t>(options_.batch_size), !model_->spec().masks_padding)) {
    std::vector<std::vector<int64_t>> batch;
    for (const auto i : group) batch.push_back(rows[i]);
    auto in = pad_batch(batch, codec_.pad_id(), device_);
    auto logp = torch::log_softmax(model_->forward(in).logits.to(torch::kFloat32), -1)
                    .to(torch::kCPU)
                    .contiguous();
    auto a = logp.accessor<float, 3>();
    for (size_t r = 0; r < group.size(); ++r) read(group[r], a[static_cast<int64_t>(r)]);
    forward_rows_ += static_cast<int64_t>(group.size());
  }
}

// log P of each window: the sum of its regular tokens' next-token log-probabilities.
std::vector<double> VariantScorer::causal_log_probs(const std::vector<std::string>& windows) {
  std::vector<std::vector<int64_t>> rows;
  rows.reserve(windows.size());
  for (const auto& w : windows) rows.push_back(codec_.frame(w, 0));
  std::vector<double> out(windows.size(), 0.0);
  for_each_log_probs(rows, [&](size_t i, const torch::TensorAccessor<float, 2>& logp) {
    const auto& ids = rows[i];
    double sum = 0;
    for (size_t t = 1; t < ids.size(); ++t) {
      if (codec_.bases_of(ids[t]).empty()) continue;
      sum += logp[static_cast<int64_t>(t - 1)][ids[t]];
    }
    out[i] = sum;
  });
  return out;
}

void VariantScorer::flush_causal() {
  // Every window once: a site's reference window is shared by its alternatives.
  std::vector<std::string> windows;
  std::map<std::string, size_t> index;
  const auto need = [&](const std::string& w) {
    auto [it, fresh] = index.emplace(w, windows.size());
    if (fresh) windows.push_back(w);
    return it->second;
  };
  struct Plan {
    size_t ref, ref_rc;
    std::vector<size_t> alt, alt_rc;
  };
  std::vector<Plan> plans;
  for (const auto& s : pending_) {
    Plan p{need(s.window), 0, {}, {}};
    if (options_.rc_average) p.ref_rc = need(reverse_complement(s.window));
    for (const char alt : s.alts) {
      auto w = s.window;
      w[static_cast<size_t>(s.offset)] = alt;
      p.alt.push_back(need(w));
      if (options_.rc_average) p.alt_rc.push_back(need(reverse_complement(w)));
    }
    plans.push_back(std::move(p));
  }
  const auto lp = causal_log_probs(windows);
  for (size_t i = 0; i < pending_.size(); ++i) {
    const auto& p = plans[i];
    std::vector<double> scores;
    for (size_t k = 0; k < p.alt.size(); ++k) {
      double s = lp[p.alt[k]] - lp[p.ref];
      if (options_.rc_average) s = (s + lp[p.alt_rc[k]] - lp[p.ref_rc]) / 2;
      scores.push_back(s);
    }
    done_(next_site_ + i, scores);
  }
}

void VariantScorer::flush_masked() {
  // One masked row a site and strand; `alt_ids[k]` the alt pieces' ids (-1: not in the vocab).
  struct Row {
    std::vector<int64_t> ids;
    int64_t at = -1;  // the masked position (-1: the variant is in an unknown token)
    int64_t ref_id = -1;
    std::vector<int64_t> alt_ids;
  };
  const auto masked_row = [&](const std::string& window, int64_t offset,
                              const std::vector<char>& alts) {
    Row row;
    row.ids = codec_.frame(window, 0);
    // An unknown token stands for one base, except a run of soft-masked ones read as they are
    // (NT's split makes a run one token): past one, the variant's token is not known.
    const bool soft_masked = std::any_of(window.begin(), window.end(), [](char c) {
      return std::islower(static_cast<unsigned char>(c)) != 0;
    });
    int64_t start = 0;  // bases before token t
    for (int64_t t = codec_.prefix_tokens(); t < static_cast<int64_t>(row.ids.size()); ++t) {
      const auto piece = codec_.bases_of(row.ids[static_cast<size_t>(t)]);
      if (piece.empty() && soft_masked) break;
      const int64_t len = piece.empty() ? 1 : static_cast<int64_t>(piece.size());
      if (offset < start + len) {
        if (!piece.empty()) {
          row.at = t;
          row.ref_id = row.ids[static_cast<size_t>(t)];
          for (const char alt : alts) {
            auto p = piece;
            p[static_cast<size_t>(offset - start)] = alt;
            row.alt_ids.push_back(codec_.id_of(p));
          }
          row.ids[static_cast<size_t>(t)] = codec_.mask_id();
        }
        break;
      }
      start += len;
    }
    if (row.at < 0) row.alt_ids.assign(alts.size(), -1);
    return row;
  };
  std::vector<Row> rows;
  for (const auto& s : pending_) {
    rows.push_back(masked_row(s.window, s.offset, s.alts));
    if (options_.rc_average) {
      std::vector<char> alts;
      for (const char a : s.alts) alts.push_back(complement(a));
      rows.push_back(masked_row(reverse_complement(s.window),
                                static_cast<int64_t>(s.window.size()) - 1 - s.offset, alts));
    }
  }
  std::vector<std::vector<int64_t>> ids;
  for (const auto& r : rows) ids.push_back(r.ids);
  std::vector<std::vector<double>> row_scores(rows.size());
  for_each_log_probs(ids, [&](size_t i, const torch::TensorAccessor<float, 2>& logp) {
    const auto& row = rows[i];
    for (const auto alt_id : row.alt_ids) {
      row_scores[i].push_back(
          alt_id < 0 ? kNaN : double(logp[row.at][alt_id]) - double(logp[row.at][row.ref_id]));
    }
  });
  const size_t per_site = options_.rc_average ? 2 : 1;
  for (size_t i = 0; i < pending_.size(); ++i) {
    auto scores = row_scores[i * per_site];
    for (size_t k = 0; k < scores.size(); ++k) {
      if (options_.rc_average) scores[k] = (scores[k] + row_scores[i * per_site + 1][k]) / 2;
      if (std::isnan(scores[k])) ++skipped_alts_;
    }
    done_(next_site_ + i, scores);
  }
}

}  // namespace dnallm::infer
