// Attention under context parallelism (issue 26, item 3): every rank of a context group holds
// some positions of each sequence (ContextParallel::positions: contiguous, or zig-zag chunks r
// and 2C-1-r of 2C for causal models) and computes its queries' attention against the keys of
// the whole sequence.
//
// Note [Attention context parallelism]
//  - Keys and values are all-gathered over the group (after rotary, by their global positions),
//    in rank order; the backward reduce-scatters their gradients back to the rank that holds the
//    positions (gather_context).
//  - No [T, T] mask or score matrix exists: the queries and the gathered keys are cut into runs
//    of consecutive global positions (one or two a rank), and attention runs per (query run, key
//    run) block: a block whose keys all follow its queries is skipped under causality, one whose
//    keys all precede them needs no causal mask, and only a block that straddles the diagonal
//    gets one, [run, run], built from the global positions. ALiBi's -slope |i - j|, the key
//    padding mask and packed segments are built per block the same way, from the global
//    positions and the gathered mask and segment ids.
//  - The blocks' results are merged exactly by their log-sum-exp: with s_j a block's scores,
//    lse_j = logsumexp(s_j) and o_j = softmax(s_j) v_j, the whole row's softmax is
//    sum_j exp(lse_j - lse) o_j with lse = logsumexp_j(lse_j); all tensor ops, so autograd
//    differentiates the merge.
//  - A query row that no key may attend (a padding query whose keys are all padding) is
//    uniform over the blocks computed, not over every key as the one-rank kernel makes it: such
//    rows are outputs nobody reads (their keys are masked out of every attention, their labels
//    are -100).
// Contracts as in worker/parallel/context_parallel.hpp: collective over the group in the same
// order on every rank, forward and backward; blocks; the group outlives the backward.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"

namespace dnallm::models {

// A run of consecutive global positions: `length` positions from `first`, at index `offset` of
// the tensor that holds them.
struct PositionRun {
  int64_t first = 0, length = 0, offset = 0;
};
std::vector<PositionRun> position_runs(const std::vector<int64_t>& positions);

struct AttentionContext {
  comm::Communicator* group = nullptr;
  std::vector<int64_t> query_positions;  // this rank's, [T / C]
  std::vector<int64_t> key_positions;    // every rank's in rank order (gather_context's), [T]
  bool causal = false;
  std::vector<double> alibi_slopes;  // empty: no ALiBi
  // Per forward (set by the model before its blocks run; undefined: none):
  torch::Tensor key_ok;          // [B, T] bool, the gathered attention mask
  torch::Tensor query_segments;  // [B, T / C] int64
  torch::Tensor key_segments;    // [B, T] int64, gathered
};

// x [B, H, T / C, D] -> [B, H, T, D]: every rank's positions in rank order (all_gather along
// dim 2). Backward: the gradient reduce-scattered (summed over the ranks that read the keys).
torch::Tensor gather_context(const torch::Tensor& x, comm::Communicator& group);

// The same for a tensor that needs no gradient, gathered along dim 1: [B, T / C] -> [B, T].
torch::Tensor gather_context_rows(const torch::Tensor& x, comm::Communicator& group);

// Attention of this rank's queries q [B, H, T / C, D] against the gathered k, v [B, H, T, D]
// (Note [Attention context parallelism]); `dropout_p` applies to the attention probabilities.
torch::Tensor context_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const AttentionContext& context,
                                double dropout_p);

}  // namespace dnallm::models
