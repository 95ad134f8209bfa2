// [parallel]: the keys of ParallelConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

void parallel_keys(std::vector<KeyDesc>& out) {
  SectionKeys<ParallelConfig>(out, "parallel", &Config::parallel)
      .choice("backend", &ParallelConfig::backend,
              "`auto` = nccl for a CUDA model (one GPU per rank, NCCL built), else mpi under "
              "mpirun, else gloo; gloo/mpi reduce a CUDA model's buckets through pinned host "
              "memory")
      .range("zero_stage", &ParallelConfig::zero_stage, 0, 3,
             "0: every rank keeps the whole optimizer state; 1: optimizer state sharded across "
             "ranks; 2: gradients sharded too (reduce-scatter); 3: parameters sharded too, "
             "each block all-gathered just before it computes and freed after; with "
             "training.precision = bf16 gathered in bf16 and computed with in bf16, the shard "
             "staying fp32 (docs/parallelism.md)")
      .range("bucket_cap_mb", &ParallelConfig::bucket_cap_mb, 0.001, 65536,
             "size of a gradient bucket (MiB): a bucket is reduced as soon as its last gradient "
             "is written, while the backward pass goes on")
      .range("first_bucket_mb", &ParallelConfig::first_bucket_mb, 0.001, 65536,
             "size of the first bucket (MiB), small so communication starts early")
      .choice("accumulate_sync", &ParallelConfig::accumulate_sync,
              "with `grad_accum_steps` > 1: reduce gradients on the `last` micro-step only, or "
              "on `every` one")
      .choice("grad_reduce_dtype", &ParallelConfig::grad_reduce_dtype,
              "dtype gradients are reduced in; bf16/fp16 halve the bytes sent. ZeRO-3: the "
              "dtype of each block's reduce-scatter; the fp32 gradient is cast to it and the "
              "result added into the fp32 gradient shard (docs/parallelism.md)")
      .key("find_unused_parameters", &ParallelConfig::find_unused_parameters,
           "allow parameters that get no gradient in a step (they contribute a zero gradient "
           "to the reduction); without it such a step exits 2 naming them")
      .range("timeout_s", &ParallelConfig::timeout_s, 0.1, 86400, "collective timeout (seconds)")
      .key("check_collectives", &ParallelConfig::check_collectives,
           "before each collective, check that every rank issues the same one (op, dtype, "
           "count) and fail naming the ranks and what each issued, instead of hanging or "
           "reducing mismatched buffers; slow (each collective waits for every rank to issue "
           "it): for debugging a hang (docs/parallelism.md)")
      .key("zero3_accumulate_unsharded", &ParallelConfig::zero3_accumulate_unsharded,
           "ZeRO-3 with grad_accum_steps > 1: keep each block's whole gradient between "
           "micro-steps and reduce-scatter it once, at the last (one collective a block a step "
           "instead of one a micro-step, for 4 more bytes a parameter); off: every micro-step "
           "reduce-scatters (docs/parallelism.md)")
      .range("context_parallel", &ParallelConfig::context_parallel, 1, 65536,
             "context-parallel degree C: consecutive groups of C ranks split every sequence "
             "between them (each holds 1/C of its positions: longer sequences at the same memory "
             "per rank), the world size / C groups train data-parallel; must divide the world "
             "size. Language-model pre-training and sequence classification (not regression "
             "yet) of HyenaDNA, Caduceus and the transformer (docs/parallelism.md)")
      .key("share_gpus", &ParallelConfig::share_gpus,
           "allow more ranks on a node (LOCAL_WORLD_SIZE) than visible GPUs: rank r uses GPU r "
           "mod n and the ranks reduce over gloo/mpi through host memory (NCCL cannot put two "
           "ranks on one GPU). Without it that case exits 2 naming both numbers");
}

}  // namespace dnallm::config_detail
