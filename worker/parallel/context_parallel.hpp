// Context parallelism for Hyena at the operator level (issue 26, item 4): one sequence of
// length L split over the C ranks of a context group, rank r holding the contiguous positions
// [r L / C, (r + 1) L / C) of every channel ("sequence shard", [B, L / C, D]).
//
// Note [Hyena context parallelism]
// The two parts of the Hyena operator (Note [Hyena] in worker/models/hyena/hyena.hpp) need
// different neighbours:
//  - the short depthwise causal conv (kernel K = 3) reads the K - 1 positions before each
//    one: a shard needs only the previous rank's last K - 1 positions (causal_halo), sent
//    point to point; the conv then runs on [halo + L / C] positions without padding.
//  - the FFT long convolution reads the whole sequence of a channel, and no distributed FFT
//    is worth having (sharding.md: Savanna and NeMo do the same). So an all-to-all turns the
//    sequence shard into a channel shard [B, L, D / C] (every position of channels
//    [r D / C, (r + 1) D / C)), each rank runs the model's own fft_long_conv on its channels
//    with their rows of the filter and bias, and a second all-to-all turns the result back
//    (models::hyena::context_parallel_long_conv, worker/models/hyena/hyena_context.cpp: the
//    family's operator lives in its folder, this file names no family).
// Every function here is an autograd Function whose backward is the transposed
// communication: the backward of sequence_to_channels is channels_to_sequence of the
// gradient and vice versa; the halo's gradient goes back to the rank it came from.
//
// Contracts (every function):
//  - Collective over `group` (all_to_all or send/recv with the neighbours): called by every
//    rank of the group, in the same order, with the same B, D and positions per rank (not
//    checked across ranks: a mismatch fails in the communicator). The backward of the graph
//    must run on every rank too (it communicates the same way).
//  - Blocks the calling thread until its communication is done (Work::wait()), in forward
//    and in backward; fails after the communicator's timeout like any collective.
//  - `group` must outlive the backward of every tensor these functions return (the autograd
//    node keeps a pointer to it).
//  - Any dtype the communicator carries; tensors on the device the communicator reads (CUDA
//    tensors over gloo go through the staging communicator of device_group.hpp, which stages
//    all_to_all and send/recv too, completing them in issue order). Shapes are checked before
//    any communication, so a bad shape fails on every rank alike with Error(kUsage) instead
//    of hanging.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>

#include "comm/communicator.hpp"

namespace dnallm::parallel {

// A tensor's shape as "[a, b, c]", for messages.
std::string shape_text(const torch::Tensor& t);
// Error(kUsage) naming `what` unless `x` is a sequence shard [B, positions, channels].
void check_shard(const torch::Tensor& x, const char* what);

// Point-to-point tags of causal_halo (Communicator::send/recv): the forward's positions and
// the backward's gradients. Other users of send/recv on a context group should use others.
constexpr int kHaloTag = 0x4859;  // 'H' 'Y'
constexpr int kHaloGradTag = 0x4860;

// The channels [first, last) that `rank` of a group of `world_size` holds after
// sequence_to_channels. `channels` must be divisible by `world_size` (Error(kUsage)).
struct ChannelBlock {
  int64_t first = 0;
  int64_t last = 0;
  int64_t count() const { return last - first; }
};
ChannelBlock channel_block(int64_t channels, int world_size, int rank);

// x [B, L / C, D] (this rank's positions, every channel) -> [B, L, D / C] (every position,
// channel_block(D, C, rank)), by one all_to_all. D must be divisible by C.
torch::Tensor sequence_to_channels(const torch::Tensor& x, comm::Communicator& group);

// The inverse: y [B, L, D / C] -> [B, L / C, D]. L must be divisible by C.
torch::Tensor channels_to_sequence(const torch::Tensor& y, comm::Communicator& group);

// x [B, L / C, D] -> [B, halo + L / C, D]: the previous rank's last `halo` positions, then x
// (rank 0: zeros, the causal conv's left padding). 0 <= halo <= L / C. Each rank posts its
// recv (from rank - 1) before its send (to rank + 1), in forward and backward (the reverse
// direction), which cannot deadlock on any backend (a chain, not a ring). Backward: the
// gradient of the halo rows is sent back to rank - 1 and added to its last `halo` positions.
// With halo = K - 1, a depthwise causal conv of kernel K on the result without padding
// equals the whole-sequence conv (padding K - 1, first L outputs) restricted to this shard.
torch::Tensor causal_halo(const torch::Tensor& x, int64_t halo, comm::Communicator& group);

// Error(kUsage) when `regression`: a regressor's float target has no "ignored" value to give
// the other ranks of a context group of `degree` ranks (Note [Context-parallel pooling]). The
// mesh checks the task before training and each batch; the transformer when it is set.
void refuse_context_parallel_regression(bool regression, int64_t degree);

// x (any shape, the same on every rank) -> [C, x's shape]: every rank's x in rank order, by one
// allgather. Backward: the gradient of row p is summed over the ranks and returned to rank p
// (one reduce_scatter), so x's gradient counts every rank's use of it. A collective: every rank
// of the group calls it, forward and backward (its result must reach every rank's loss).
torch::Tensor gather_ranks(const torch::Tensor& x, comm::Communicator& group);

// Its forward without autograd, not waited for: x (contiguous) -> [C, x's shape] and the running
// allgather's Work; x and the result must stay alive and untouched until it completes (the
// attention's K/V exchange computes meanwhile: Note [Attention context parallelism]).
std::pair<torch::Tensor, comm::WorkPtr> launch_gather_ranks(const torch::Tensor& x,
                                                            comm::Communicator& group);

// Note [Context-parallel pooling]
// A sequence classifier pools each sequence into one vector before its head; under context
// parallelism the ranks of a group each hold some of its positions (issue 26, item 2). The pool
// is then a sum over the group, whatever the layout (contiguous or zig-zag):
//  - mean pooling: each rank sums its positions (masked) and counts them; both are summed over
//    the group, then divided (context_mean_pool);
//  - token pooling ([CLS], HyenaDNA's last real token): the rank that holds the position gives
//    its hidden state, the others zeros (context_token_pool).
// The sum is context_all_reduce_sum, whose backward all-reduces the gradients: with
// pooled = sum_r p_r on every rank and a loss L = sum_s l_s(pooled) made of each rank's own term,
// dL/dp_r = sum_s dl_s/dpooled, which is what every rank receives. After the pool every rank
// holds the same vector and runs the same head on it, so a sequence's loss must be counted by
// one rank: the data path gives its label to context rank 0 only (context_shard: the others
// get kIgnoreIndex and count no label), and the other ranks' loss terms are sums of nothing
// that still carry the graph (every rank runs the backward: it communicates). The head's
// gradient then comes from rank 0 alone and the backbone's from every rank through the
// all-reduce's backward; summed over the world by the data-parallel engine, each counts once,
// as Note [Loss normalisation] needs. Every function here is collective over `group` (called by
// every rank, in the same order, with the same shapes, in forward and backward).

// x summed over the group, on every rank; backward: the gradient summed over the group. Any
// dtype the communicator carries; x [any shape], the same on every rank.
torch::Tensor context_all_reduce_sum(const torch::Tensor& x, comm::Communicator& group);

// The mean over the whole sequence of hidden [B, T / C, H] (this rank's positions), weighting
// each position by mask [B, T / C] (1 real, 0 padding; undefined: every position counts, the
// padding the mesh adds included): [B, H], the same on every rank. A row without any position
// counted gives zeros.
torch::Tensor context_mean_pool(const torch::Tensor& hidden, const torch::Tensor& mask,
                                comm::Communicator& group);

// The hidden state at global position index[b] of each row: hidden [B, T / C, H], positions
// [T / C] (int64, the global position of each local one: ContextParallel::positions), index
// [B] (int64, global, held by exactly one rank) -> [B, H], the same on every rank.
torch::Tensor context_token_pool(const torch::Tensor& hidden, const torch::Tensor& positions,
                                 const torch::Tensor& index, comm::Communicator& group);

// Per row the smallest global position where `where` [B, T / C] (bool) holds, over the whole
// sequence; `none` where it holds nowhere: [B] int64, the same on every rank. No gradient.
torch::Tensor context_first_position(const torch::Tensor& where, const torch::Tensor& positions,
                                     int64_t none, comm::Communicator& group);

}  // namespace dnallm::parallel
