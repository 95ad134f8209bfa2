// [training]: the keys of TrainingConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

// [training], part 1: how long, how big a batch, and the optimizer.
void training_optimizer_keys(std::vector<KeyDesc>& out) {
  SectionKeys<TrainingConfig>(out, "training", &Config::training)
      .range("max_steps", &TrainingConfig::max_steps, 0, kInf,
             "optimizer steps; 0 = use `num_train_epochs`")
      .range("num_train_epochs", &TrainingConfig::num_train_epochs, 0, kInf,
             "with `max_steps` = 0: passes over the training set (may be fractional); the run "
             "takes ceil(epochs × samples per epoch / global batch) steps")
      .choice("batch_size", &TrainingConfig::batch_size,
              "`\"\"` = `micro_batch_size`; `\"auto\"` = the largest that fits (see "
              "[batch_size = \"auto\"](#batch_size--auto))")
      .range("micro_batch_size", &TrainingConfig::micro_batch_size, 1, 1 << 20,
             "sequences per rank per micro-step")
      .range("grad_accum_steps", &TrainingConfig::grad_accum_steps, 1, 1 << 20,
             "micro-steps whose gradients add up to one optimizer step")
      .range("auto_batch_memory_mb", &TrainingConfig::auto_batch_memory_mb, 0, kInf,
             "`batch_size = \"auto\"` on CPU: resident-memory budget per rank in MiB; 0 = 80% of "
             "available memory / ranks on the node + what the process holds")
      .range("memory_limit_gb", &TrainingConfig::memory_limit_gb, 0, kInf,
             "memory a rank may use in GB (1e9 bytes); the model's parameters, gradients, AdamW "
             "moments and activations are predicted from its shape before it is built, and a "
             "run predicted to need more is exit 2 naming the figures; 0 = available memory "
             "(MemAvailable, or the cgroup's memory.max) / ranks on the node, checked on CPU "
             "only")
      .range("lr", &TrainingConfig::lr, 0, 10, "peak learning rate of AdamW")
      .range("weight_decay", &TrainingConfig::weight_decay, 0, 10,
             "AdamW's decoupled weight decay; biases and layer norms are not decayed")
      .range("adam_beta1", &TrainingConfig::adam_beta1, 0, 0.999999,
             "AdamW's decay of the first moment")
      .range("adam_beta2", &TrainingConfig::adam_beta2, 0, 0.999999,
             "AdamW's decay of the second moment")
      .range("adam_epsilon", &TrainingConfig::adam_epsilon, 1e-12, 1,
             "AdamW's epsilon (0 would divide 0 by 0 for parameters without gradient: loss nan)")
      .choice("lr_scheduler", &TrainingConfig::lr_scheduler,
              "learning rate after the warm-up: constant, or decaying to 0 at the last step "
              "linearly or along a cosine")
      .range("warmup_steps", &TrainingConfig::warmup_steps, 0, kInf,
             "steps of linear warm-up from 0 to `lr`")
      .range("warmup_ratio", &TrainingConfig::warmup_ratio, 0, 1,
             "warm-up as a fraction of all steps, used when `warmup_steps` = 0")
      .range("max_grad_norm", &TrainingConfig::max_grad_norm, 0, kInf,
             "clip the global gradient norm (over all ranks) to this; 0 disables clipping");
}

// [training], part 2: numerics, evaluation, logging and where it runs.
void training_run_keys(std::vector<KeyDesc>& out) {
  SectionKeys<TrainingConfig>(out, "training", &Config::training)
      .choice("precision", &TrainingConfig::precision,
              "compute precision of forward and backward (parameters stay fp32); `fp16` needs a "
              "GPU and uses a loss scaler")
      .key("tf32", &TrainingConfig::tf32,
           "CUDA: allow TF32 tensor-core math in fp32 matmuls and convolutions")
      .choice("sync_free", &TrainingConfig::sync_free,
              "steps that never wait for the host (loss and grad norm read on logging steps "
              "only; a NaN loss is reported at the next logging step); `auto` = on for GPUs, "
              "off on CPU")
      .key("optimizer_offload", &TrainingConfig::optimizer_offload,
           "keep this rank's AdamW moments and an fp32 master copy of its parameter range (the "
           "ZeRO shard, or all of it) in host memory (pinned on CUDA): the update runs on the "
           "host and the parameters are copied back without a host wait. Frees 8 bytes (+4 of "
           "scratch) per owned parameter on the device; costs a host wait and two PCIe copies "
           "of the range per step (see [Optimizer offload](#optimizer-offload))")
      .key("keep_global_batch", &TrainingConfig::keep_global_batch,
           "resuming at another world size: adjust `grad_accum_steps` so micro × accum × world "
           "equals the checkpoint's global batch")
      .range("seed", &TrainingConfig::seed, 0, kInf,
             "seeds the model's initialisation, the sampler's order and masking: with the step "
             "it decides which samples a global batch holds")
      .range("eval_steps", &TrainingConfig::eval_steps, 0, kInf,
             "evaluate every this many steps; 0 disables evaluation")
      .range("eval_batches", &TrainingConfig::eval_batches, 1, kInf,
             "micro-batches per rank per evaluation: an evaluation scores the first min(eval "
             "set, eval_batches × micro_batch_size × world size) samples, each exactly once (a "
             "smaller set is not wrapped around)")
      .range("logging_steps", &TrainingConfig::logging_steps, 1, kInf,
             "write a step line (log and metrics file) every this many steps, and at the first "
             "and last step")
      .choice("device", &TrainingConfig::device,
              "`auto` = CUDA when a GPU is visible; a CUDA rank trains on cuda:LOCAL_RANK, "
              "counted within CUDA_VISIBLE_DEVICES ([gpu.md](gpu.md))")
      .key("output_dir", &TrainingConfig::output_dir,
           "where the exported model goes; empty: `<checkpoint.dir>/final`");
}

}  // namespace dnallm::config_detail
