// training.batch_size = "auto": the real probe (one trial forward/backward on the device) and
// the resolution that rewrites training.micro_batch_size and grad_accum_steps before the
// loaders are built. The search policy itself is torch-free: worker/train/batch_search.hpp.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "core/config.hpp"
#include "worker/models/transformer/transformer.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {

struct MicroBatchTrial {
  bool fits = false;
  double peak_bytes = 0;  // CPU: the largest resident set seen, AdamW state added; CUDA: 0
  std::string why;        // when it does not fit: the out-of-memory message or the budget
};

// One trial micro-step: forward and backward of `micro_batch` synthetic sequences of
// model.max_seq_length tokens (every position scored: the worst case of a masked LM), under
// the configured precision's autocast, on `device`. Gradients are dropped afterwards.
//   CUDA: fits unless LibTorch reports out of memory (the error is caught).
//   CPU: there is no out-of-memory error to catch, so it fits when the resident set sampled
//        before the step, after forward and after backward, plus the AdamW moments the trainer
//        will allocate (8 bytes per trainable parameter), stays within `memory_budget_bytes`.
//        Freed heap memory is returned to the system (malloc_trim) before and after each
//        trial. Sampling can miss a short transient peak: keep the budget below the hard limit.
// Blocks; training thread only.
MicroBatchTrial probe_micro_batch(models::LanguageModel model, const Config& config,
                                  int64_t micro_batch, const torch::Device& device,
                                  double memory_budget_bytes);

// The CPU budget of training.batch_size = "auto": training.auto_batch_memory_mb when set, else
// 80% of MemAvailable divided by `local_world_size`, plus the current resident set.
double auto_batch_budget_bytes(const Config& config, int local_world_size);

// No-op unless training.batch_size = "auto". Otherwise searches the largest micro-batch that
// fits (Note [Micro-batch search]; every trial is agreed over `sync`, so it is a collective
// that every rank must call), then sets micro_batch_size and grad_accum_steps so that
// micro × accum × world stays the configured global batch, and logs the choice. Throws
// Error(kUsage) when not even one sequence fits.
void resolve_auto_batch(Config& config, models::LanguageModel model, GradientSync& sync,
                        int local_world_size);

}  // namespace dnallm::train
