// Attention under context parallelism (issue 26, item 3): every rank of a context group holds
// some positions of each sequence (ContextParallel::positions: contiguous, or zig-zag chunks r
// and 2C-1-r of 2C for causal models) and computes its queries' attention against the keys of
// the whole sequence.
//
// Note [Attention context parallelism]
//  - Keys and values (after rotary, by their global positions; grouped-query attention's shared
//    heads, repeated only after the exchange) are all-gathered over the group in rank order, by
//    one collective for both: this rank's k and v stacked, [2, B, Hkv, T / C, D].
//  - The exchange overlaps the attention of the local chunk: context_attention launches the
//    all-gather (Work handle), computes every block whose keys are this rank's own positions
//    (the diagonal blocks: one run, or zig-zag's two) from the local k and v, then waits, and
//    computes the blocks of the other ranks' keys from the received buffer. The backward mirrors
//    it: the node that returned the received buffer (it is run once every remote block's
//    backward has run) launches the reduce-scatter of its gradient to the ranks that own the
//    keys, the local blocks' backward runs while it is in flight, and the node that handed the
//    local k and v to the blocks waits for it and adds it to their gradient. This rank's own
//    slice of the received buffer is never read (the local blocks read k and v themselves), so
//    its gradient there is zero and nothing is counted twice. A rank whose remote blocks are all
//    skipped still takes part in the reduce-scatter (with zeros), so every rank issues the same
//    collectives, forward and backward. AttentionContext::overlap_exchange = false waits before
//    any block and right after launching the reduce-scatter, as a baseline for the bench
//    (bench/context_parallel/bench_context_attention.cpp): the same blocks in the same order,
//    so the same numbers bit for bit.
//  - No [T, T] mask or score matrix exists: the queries and each rank's keys are cut into runs
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
// order on every rank, forward and backward (context_attention: one all-gather in forward, one
// reduce-scatter in backward); blocks until its exchange is done, in forward and in backward;
// the group outlives the backward.
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

// What context_attention did around its K/V exchange, summed over calls (tests and benches:
// Note [Attention context parallelism]). Blocks count (query run, key run) pairs computed.
struct ContextAttentionCounts {
  int64_t exchanges = 0;                   // all-gathers launched (forward)
  int64_t blocks_before_wait = 0;          // blocks computed after the launch, before the wait
  int64_t blocks_after_wait = 0;           // blocks computed after it
  int64_t gradient_exchanges = 0;          // reduce-scatters launched (backward)
  int64_t local_backward_before_wait = 0;  // local blocks' backward run while one was in flight
  double seconds_waiting = 0;  // blocked in the waits on the exchanges, forward and backward
};

struct AttentionContext {
  comm::Communicator* group = nullptr;
  std::vector<int64_t> query_positions;  // this rank's, [T / C]
  std::vector<int64_t> key_positions;    // every rank's in rank order (the all-gather's), [T]
  bool causal = false;
  std::vector<double> alibi_slopes;  // empty: no ALiBi
  // false: wait for the K/V exchange before any block, and for the gradients' right after
  // launching them (the bench's baseline; the same results).
  bool overlap_exchange = true;
  ContextAttentionCounts* counts = nullptr;  // tests and benches; null: not counted
  // Per forward (set by the model before its blocks run; undefined: none):
  torch::Tensor key_ok;          // [B, T] bool, the gathered attention mask
  torch::Tensor query_segments;  // [B, T / C] int64
  torch::Tensor key_segments;    // [B, T] int64, gathered
};

// Every rank's x [B, T / C] in rank order, along dim 1: [B, T] (no gradient).
torch::Tensor gather_context_rows(const torch::Tensor& x, comm::Communicator& group);

// Attention of this rank's queries q [B, H, T / C, D] against the keys and values of every rank
// of the group, given this rank's k, v [B, Hkv, T / C, D] (H divisible by Hkv: query head i
// reads key head i / (H / Hkv), Note [Grouped-query attention]); exchanges them over the group
// (Note [Attention context parallelism]). `dropout_p` applies to the attention probabilities.
torch::Tensor context_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const AttentionContext& context,
                                double dropout_p);

}  // namespace dnallm::models
