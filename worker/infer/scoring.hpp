// Note [Likelihood of a genome]: dnallm-eval --fasta on any model with its own tokenizer (Note
// [Sequence codec]). Each record is cut into windows of `window` bases (the last one shorter),
// each framed as the model frames a sequence, and scored:
//   - causal models: the sum of the next-token log-probabilities of every regular token that
//     has a token before it (the first token of a window without a BOS/CLS has none and is not
//     counted, nor are its bases); `batch_size` windows a forward pass, right-padded;
//   - masked models: the pseudo-log-likelihood (Salazar et al. 2020; what the Nucleotide
//     Transformer and Caduceus papers report): every regular token masked in turn, its
//     log-probability read at its own position with the rest of the window as context. One
//     forward pass a token: a window of T tokens costs T passes of T tokens (batched
//     `batch_size` rows at a time), so the cost grows with window^2; --window bounds it.
//     Overlapping k-mers (DNABERT-1) leak a masked token from its neighbours, so the k-1 tokens on
//     each side are masked with it (DNABERT's own span masking) and each token counts one base.
// bits per base = -(sum of log-probabilities) / ln 2 / (bases of the scored tokens).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "worker/data/sequence_codec.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::infer {

struct LikelihoodOptions {
  int64_t window = 0;      // bases a window (0: the default_window())
  int64_t max_bases = 0;   // score about this many bases of the file (0: all)
  int64_t batch_size = 8;  // rows a forward pass
};

struct LikelihoodScore {
  bool pseudo = false;  // masked model: pseudo-log-likelihood
  double log_prob = 0;  // natural log, summed over the scored tokens
  int64_t tokens = 0;   // scored tokens
  int64_t bases = 0;    // bases they stand for
  int64_t windows = 0;
  int64_t window = 0;          // bases a window (the option, the default, or the cut of either)
  int64_t forward_passes = 0;  // rows run through the model
  double bits_per_base() const;
};

// The window a model is scored in by default: its longest input less the framing, at most
// 4,096 bases for a causal model and 512 for a masked one (pseudo-likelihood costs window^2).
int64_t default_window(const models::ModelSpec& spec, const data::SequenceCodec& codec);

LikelihoodScore score_likelihood(models::LanguageModel model, const data::SequenceCodec& codec,
                                 const std::string& fasta, const LikelihoodOptions& options,
                                 const torch::Device& device);

}  // namespace dnallm::infer
