// Note [Zero-shot variant effects]: dnallm-infer variants and mutagenesis. A single-nucleotide
// variant at 0-based `pos` of a contig is scored in a window of `window` bases centred on it
// (start = pos - window/2, moved inside the contig when it would cross an end), with the model's
// own tokenizer and framing (Note [Sequence codec]):
//   - causal models: log P(window with alt) - log P(window with ref), each the sum of the
//     next-token log-probabilities of the window's regular tokens (special tokens are framing,
//     not sequence: HyenaDNA's trailing [SEP] is not counted, nor a first token without a
//     token before it);
//   - masked models: the masked marginal (Meier et al. 2021; the Nucleotide Transformer and
//     Caduceus papers): the token covering the variant masked in the reference window, then
//     log p(alt piece) - log p(ref piece) at that position, the alt piece being the ref token
//     with the variant's base substituted (a 6-mer of NT, a BPE piece of DNABERT-2, a base).
//     An alt piece that is not in the vocabulary (BPE) is skipped and counted, as is a variant
//     after a soft-masked run read as unknown tokens (NT makes a run one token: the variant's
//     token is not known; --uppercase reads them as bases). Overlapping
//     k-mers (DNABERT-1) are refused: the variant sits in k tokens.
// `rc_average` averages the score with the same on the reverse-complement strand.
// Note [Variant windows]: the window is in bases. An even window puts window/2 bases before the
// variant and window/2 - 1 after it; near a contig's end it is moved inside the contig, and a
// window longer than the contig is the whole contig. By default it is the bases the model's
// positions hold: (usable positions - framing tokens) x the bases of its longest token (1 for a
// model of one token a base, 6 for NT's 6-mers, the longest piece for BPE), at most 1,024; the
// window used is logged. --window is at most that many bases (for a model whose positions
// extend past its length, kWindowExtendFactor times its positions' bases), else exit 2 naming the
// largest. A site whose window makes more tokens than the positions hold (runs of N in 6-mers,
// short BPE pieces) has its window narrowed, still centred on the variant, until every row of
// it fits; such sites are counted (narrowed_sites) and warned about. Without a BOS token a
// causal model predicts nothing for the window's first token: a variant there contributes no
// log-probability of its own.
// Speed (issue 40 item 5): the windows of a batch go through the model together; a site's
// reference window is computed once for all its alternatives (causal: one log P(ref) per site;
// masked: one masked forward per site, every alternative read from it).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "worker/data/sequence_codec.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::infer {

struct VariantOptions {
  int64_t window = 0;  // bases (0: default_variant_window())
  bool rc_average = false;
  int64_t batch_size = 16;  // windows a forward pass
};

// The window a variant is scored in by default (Note [Variant windows]): the bases the model's
// positions hold, at most 1,024.
int64_t default_variant_window(const models::ModelSpec& spec, const data::SequenceCodec& codec);

// One site: the window of reference bases around it and where the variant lies in it.
struct VariantSite {
  std::string window;  // upper-case reference bases
  int64_t offset = 0;  // the variant's index in `window`
  std::vector<char> alts;
};

// Scores sites in batches: add() them, then flush() (or let add() flush a full batch); each
// site's scores (one per alt, NaN for a skipped alt) go to `done` in the order added.
class VariantScorer {
 public:
  using Done = std::function<void(size_t site, const std::vector<double>& scores)>;
  VariantScorer(models::LanguageModel model, const data::SequenceCodec& codec,
                const VariantOptions& options, const torch::Device& device, Done done);
  void add(VariantSite site);
  void flush();
  int64_t window() const { return window_; }
  int64_t narrowed_sites() const { return narrowed_sites_; }  // Note [Variant windows]
  int64_t skipped_alts() const { return skipped_alts_; }      // alt pieces not in the vocabulary
  int64_t forward_rows() const { return forward_rows_; }

 private:
  // Runs `rows` (framed ids) through the model, batched, and calls `read(i, log-probabilities
  // [T, V] of row i)` for each (right-padded: a row's own positions come first).
  void for_each_log_probs(
      const std::vector<std::vector<int64_t>>& rows,
      const std::function<void(size_t, const torch::TensorAccessor<float, 2>&)>& read);
  std::vector<double> causal_log_probs(const std::vector<std::string>& windows);
  void flush_causal();
  void flush_masked();
  // The most tokens a row of `site` makes (Note [Variant windows]).
  int64_t site_tokens(const VariantSite& site) const;
  // Narrows `site`'s window until its rows fit the model's positions.
  void fit(VariantSite& site);

  models::LanguageModel model_;
  const data::SequenceCodec& codec_;
  VariantOptions options_;
  torch::Device device_;
  Done done_;
  bool causal_ = true;
  int64_t window_ = 0;
  int64_t budget_ = 0;      // regular tokens a row can hold
  bool check_fit_ = false;  // a window of window_ bases may make more than budget_ tokens
  int64_t narrowed_sites_ = 0;
  std::vector<VariantSite> pending_;
  size_t next_site_ = 0;  // index of pending_[0]
  int64_t skipped_alts_ = 0, forward_rows_ = 0;
};

}  // namespace dnallm::infer
