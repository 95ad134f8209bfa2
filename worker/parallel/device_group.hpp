// The rank's device and a communicator that can reduce buffers on it.
//
// Note [Staged collectives]
// gloo and mpi reduce host memory; a CUDA model's flat buckets and ZeRO shards live on the
// GPU (Note [One GPU per rank] in cluster/gpu_placement.hpp). Two ranks sharing one GPU
// (parallel.share_gpus), or GPUs without NCCL, therefore reduce through pinned host memory:
// the staging communicator wraps the CPU backend and, for every collective whose buffers
// are on the GPU,
//  1. on the issuing thread (an autograd hook during backward: it must not block) records
//     an event on the current CUDA stream, makes a copy stream wait for it, and enqueues the
//     device->host copy into a pinned buffer there (non-blocking);
//  2. on its own staging thread, in issue order: waits for that copy, runs the CPU
//     collective on the pinned buffer (waiting for it), enqueues the host->device copy of
//     the result on the copy stream and waits for it; then the Work completes.
// Backward keeps running while a bucket is copied and reduced, so DDP's overlap is kept
// (minus PCIe time). Every collective, staged or not, goes through the one FIFO queue: the
// inner communicator then sees the issue order of the caller, which must be the same on
// every rank (Communicator contract).
// With NCCL the reverse happens for the few host buffers (scalar sums of the trainer): they
// are copied to the GPU, reduced and copied back synchronously (they block the caller
// anyway); device buffers go to NCCL directly and the caller gets NCCL's own Work, so its
// stream-ordered wait applies (Note [Stream-ordered wait] in comm/communicator.hpp). A staged
// collective's Work waits on the host for wait_stream() too: the copy back is the staging
// thread's.
// comm/ never sees a CUDA type: the staging needs LibTorch's copies and streams, so it
// lives here in worker/.
#pragma once

#include <memory>

#include <torch/torch.h>

#include "comm/communicator.hpp"
#include "core/config.hpp"

namespace dnallm::parallel {

struct RankDevice {
  torch::Device device{torch::kCPU};
  bool shared = false;  // another rank of this node drives the same GPU
};

// training.device resolved for this rank: CUDA -> cuda:<local GPU index> (Note [One GPU per
// rank]), made the current CUDA device of this process (call once at start, before any CUDA
// allocation). Throws Error(kUsage) when the node has more ranks than visible GPUs and
// parallel.share_gpus is false, or when "cuda" is asked for without a GPU.
// `scheduler_binds_gpus`: the ranks came from Slurm or OpenMPI, which may bind one GPU per
// task (see cluster::place_on_gpu).
RankDevice select_rank_device(const Config& config, int local_rank, int local_world_size,
                              bool scheduler_binds_gpus = false);

// comm/'s description of a LibTorch device.
Device comm_device(const torch::Device& device);

struct StagingOptions {
  // Tests only (no GPU here): stage host buffers through a second host buffer too, so the
  // staging thread, its ordering and its error handling run with CPU tensors.
  bool stage_host_buffers = false;
};

// Wraps `inner` when buffers on `device` need staging for its backend (Note [Staged
// collectives]); returns `inner` itself when none do.
std::unique_ptr<comm::Communicator> stage_for_device(std::unique_ptr<comm::Communicator> inner,
                                                     const torch::Device& device,
                                                     StagingOptions options = {});

}  // namespace dnallm::parallel
