// Mamba and BiMamba under context parallelism (issue 26): one sequence of length T split over
// the C ranks of a context group, rank r holding the contiguous positions [r T / C, (r + 1) T / C)
// ("sequence shard", [B, T / C, channels]).
//
// Note [Mamba context parallelism]
// Every part of the Mamba mixer (Note [Caduceus]) but two is position-wise (in_proj, x_proj,
// dt_proj, the gating, out_proj) and runs on the shard as it is. The two that read other
// positions:
//  - the causal depthwise conv1d (kernel d_conv) reads the d_conv - 1 positions before each one:
//    parallel::causal_halo brings the previous rank's last d_conv - 1 positions, and the conv
//    runs without padding (as the Hyena short filter, Note [Hyena context parallelism]).
//  - the selective scan h_t = a_t h_{t-1} + b_t (a_t = exp(delta_t A), b_t = delta_t B_t u_t) is
//    sequential in t. Two exact ways exist: an all-to-all to channel shards [B, T, D / C] (every
//    position of some channels) with B and C all-gathered along the sequence, the usual scan, and
//    an all-to-all back (Megatron's Mamba CP); or the state carried from rank to rank. We carry
//    the state, because the recurrence is linear in it: the scan of a shard from a start state s
//    is the scan from zero plus the zero-input scan of s, whose value at the shard's end is
//    P s with P = prod_t a_t [B, D, N]. So
//      1. each rank scans its shard from zero keeping only its end state e_r and P_r (no
//         per-position storage),
//      2. one all-gather of (e_r, P_r) [B, D, 2N] over the group,
//      3. each rank folds its start state s_r = P_{r-1} s_{r-1} + e_{r-1} (s_0 = 0),
//      4. the ordinary scan of the shard from s_r, storing its states for the backward.
//    The backward is the same in reverse: the reverse recurrence dh_t = C_t g_t + a_{t+1} dh_{t+1}
//    is linear in the gradient that enters at the shard's end, so each rank runs it from zero for
//    the gradient at its start, l_r, one all-gather of l_r [B, D, N], a fold from the right
//    G_r = l_{r+1} + P_{r+1} G_{r+1} (G_{C-1} = 0), and the ordinary backward entered with G_r.
//    Against the all-to-all this keeps no full-length tensor on any rank (B and C gathered would
//    be [B, T, N] each, besides the all-to-all's send and receive copies of u, delta, z and y),
//    needs no channel count divisible by C, and communicates [B, D, 2N] and [B, D, N] per scan
//    instead of the activations (about 4 B T D / C a rank): it costs a second, lighter pass over
//    the shard in forward and backward. The result is the whole-sequence scan up to rounding
//    (the start state enters as P s instead of step by step).
//    Two implementations of these steps (ContextScanKernel): on the CPU the fused kernels of
//    Note [Fused selective scan], one autograd Function running the steps above by hand; on any
//    other device (and on the CPU when asked, as the tests do) torch ops under autograd, from the
//    same linearity. The generic scan from zero (selective_scan_from_zero) gives the shard's
//    y^0_t = sum_n C_t h^0_t and e_r; P_r = exp(A sum_t delta_t) in closed form;
//    parallel::gather_ranks all-gathers (e_r, P_r), its backward a reduce-scatter (each rank
//    receives the sum of the gradients for its slice); the fold is torch ops; and the
//    start state's zero-input response, sum_n C_t[n] exp(A[n] (delta_1 + ... + delta_t)) s_r[n],
//    is added to y^0_t before the D u skip and the gate. Autograd derives the backward, in which
//    the gather's backward is a collective: each rank folds every rank's start state and picks
//    its own from their stack, so the gather is in rank 0's graph too (whose own start state is
//    zero) and its backward runs on every rank, in the same order. Memory: exp(A cumsum(delta))
//    and its product with s_r are [B, D, L / C, N] each (autograd keeps both for the backward),
//    as the generic scan's own exp(delta A) and delta B u; no rank holds a full-length tensor
//    here either.
//    A, D and delta_bias are replicated: each rank's gradient is its positions' part, summed by
//    the gradient reduction over the context group like any parameter's.
// BiMamba's reverse direction runs Mamba on flip(x): under CP the flip of the whole sequence is
// each shard flipped, held by the ranks in reverse order. So the reverse direction flips its shard
// locally and runs the same operators over the context group with its ranks reversed (a split of
// the group with key C - 1 - rank, made once by make_mamba_context in set_context_parallel): its
// "previous rank" is the next one, for the conv's halo and the carried state alike. RCPS's
// reverse-complement half is the same flip (over channels too, which is position-wise).
//
// Contracts (as parallel::causal_halo and Note [Hyena context parallelism]): collective over the
// group, called by every rank in the same order with the same B and channels; the backward
// communicates too and must run on every rank; blocks in forward and backward; the group must
// outlive the backward. The scan runs in fp32 (its inputs cast up), on any device.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "comm/communicator.hpp"

namespace dnallm::models::caduceus {

class MambaImpl;

// Which implementation of the context-parallel selective scan runs (Note [Mamba context
// parallelism]).
enum class ContextScanKernel {
  kByDevice,  // the fused kernels on the CPU, the device-generic scan on any other device
  kGeneric,   // the device-generic scan (torch ops) on every device, the CPU included
};

// The groups a context-parallel Caduceus model runs its mixers over: `group` in sequence order
// and `reversed`, the same ranks in reverse order (for the flipped directions).
struct MambaContext {
  comm::Communicator* group = nullptr;
  std::unique_ptr<comm::Communicator> reversed;  // null for a group of one rank
  ContextScanKernel kernel = ContextScanKernel::kByDevice;

  comm::Communicator& reversed_group() const { return reversed ? *reversed : *group; }
};

// Collective over `group` (a split): its reversed twin. A group of 1 rank gets none (null).
std::shared_ptr<MambaContext> make_mamba_context(comm::Communicator& group);

// The selective scan of this rank's positions, context-parallel over `group` (Note [Mamba
// context parallelism]): arguments as selective_scan() with L = this rank's positions, equal to
// selective_scan_fused over the whole sequence restricted to them. Forward and backward
// (`kernel`: the fused autograd Function on the CPU, or torch ops under autograd).
torch::Tensor context_parallel_selective_scan(
    const torch::Tensor& u, const torch::Tensor& delta, const torch::Tensor& A,
    const torch::Tensor& Bm, const torch::Tensor& C, const torch::Tensor& D, const torch::Tensor& z,
    const torch::Tensor& delta_bias, comm::Communicator& group,
    ContextScanKernel kernel = ContextScanKernel::kByDevice);

// MambaImpl::forward of a sequence shard x [B, T / C, d_model], context-parallel over `group`
// (whose rank order is the order of the shards in x's sequence).
torch::Tensor mamba_context_parallel(MambaImpl& mamba, const torch::Tensor& x,
                                     comm::Communicator& group,
                                     ContextScanKernel kernel = ContextScanKernel::kByDevice);

}  // namespace dnallm::models::caduceus
