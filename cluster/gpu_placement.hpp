// Which GPU a rank drives, and how many GPUs a node offers. Pure policy, torch-free: the
// launcher (no LibTorch) counts GPUs for --nproc-per-node auto, the worker places itself.
//
// Note [One GPU per rank]
// A worker trains on cuda:LOCAL_RANK. The index counts within CUDA_VISIBLE_DEVICES (CUDA
// renumbers the visible GPUs 0..n-1 by itself), so a launcher or scheduler that restricts
// CUDA_VISIBLE_DEVICES needs no help from us. More ranks on a node (LOCAL_WORLD_SIZE) than
// visible GPUs is a configuration error (exit 2 naming both numbers), since silently
// stacking ranks on one GPU is slow and runs out of memory, unless the user asks for it
// with parallel.share_gpus = true: then rank r uses GPU r mod n, and the ranks reduce over a
// CPU backend staged through host memory (NCCL refuses two ranks on one GPU). See
// worker/parallel/device_group.hpp for the staging.
// A scheduler may bind one GPU per task instead (Slurm's --gpus-per-task=1, mpirun with a
// binding wrapper): every rank then sees exactly one GPU, its own, as device 0. When the
// ranks were started by such a scheduler (topology from Slurm or OpenMPI, not from a
// launcher whose workers all inherit one CUDA_VISIBLE_DEVICES) one visible GPU is taken to
// be that binding, not sharing.
#pragma once

#include <string>

#include "cluster/topology.hpp"

namespace dnallm::cluster {

// GPUs CUDA will show this process: the entries of CUDA_VISIBLE_DEVICES when it is set
// (indices or GPU-/MIG- UUIDs; CUDA stops at the first invalid entry, "" or "-1" hides
// every GPU), else `host_gpus`.
int visible_gpu_count(const EnvMap& env, int host_gpus);

// NVIDIA GPUs on this host without asking CUDA: /dev/nvidia0, /dev/nvidia1, ... in
// `dev_dir`, else the entries of `proc_dir` (the driver's /proc/driver/nvidia/gpus, one
// folder per GPU); 0 when neither exists.
int count_host_gpus(const std::string& dev_dir = "/dev",
                    const std::string& proc_dir = "/proc/driver/nvidia/gpus");

struct GpuPlacement {
  int device_index = 0;  // CUDA device index (within CUDA_VISIBLE_DEVICES)
  bool shared = false;   // another rank of this node drives the same GPU
};

// See Note [One GPU per rank]. Throws Error(kUsage) when no GPU is visible, or when
// local_world_size > visible_gpus and share_gpus is false (naming both numbers), except for
// one visible GPU when `scheduler_binds_gpus` (the ranks came from Slurm or OpenMPI).
GpuPlacement place_on_gpu(int local_rank, int local_world_size, int visible_gpus, bool share_gpus,
                          bool scheduler_binds_gpus = false);

}  // namespace dnallm::cluster
