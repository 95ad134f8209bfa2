// training.batch_size = "auto": the policy that finds the largest micro-batch that fits and
// keeps the configured global batch by adjusting gradient accumulation. Torch-free (pure
// functions over a probe callback), so it is unit-tested with a fake probe; the real probe
// (a trial forward/backward) is train::probe_micro_batch in trainer.hpp.
//
// Note [Micro-batch search]:
//   1. Try `start`, then double (start, 2 start, 4 start, ...) until a trial does not fit or
//      `max` is reached (the last doubling is clamped to `max`).
//   2. If a trial failed, bisect between the last size that fitted and the first that did not
//      (the answer lies in [fit, fail)).
//   3. The result is the largest size seen to fit (0 when even `start` does not fit).
// The probe must be monotone (if m fits, every smaller size fits); sizes above `max` are never
// tried, so with max = the per-rank batch no trial wastes memory on a size that cannot be used.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dnallm::train {

// Returns true when a micro-step with `micro_batch` sequences fits. Called from the training
// thread; with several ranks it is a collective (all ranks must agree, see auto_micro_batch).
using MicroBatchProbe = std::function<bool(int64_t micro_batch)>;

struct MicroBatchSearchOptions {
  int64_t start = 1;  // first size tried (>= 1)
  int64_t max = 1;    // largest size worth trying (>= start): the per-rank batch
};

struct MicroBatchSearchResult {
  int64_t largest_fit = 0;                       // 0: not even `start` fits
  std::vector<std::pair<int64_t, bool>> trials;  // (size, fits) in the order tried
};

// See Note [Micro-batch search]. Throws Error(kUsage) on start < 1 or max < start.
MicroBatchSearchResult search_micro_batch(const MicroBatchProbe& probe,
                                          const MicroBatchSearchOptions& options);

struct BatchPlan {
  int64_t micro_batch_size = 0;
  int64_t grad_accum_steps = 0;
  // True when the largest size that fits does not divide the per-rank batch and a smaller
  // divisor was taken (the global batch stays exact; some memory is left unused).
  bool reduced_to_divide = false;
};

// The per-rank batch (configured micro_batch_size × grad_accum_steps = global / world) split
// into the largest micro-batch m <= largest_fit that divides it, and per_rank / m
// accumulation steps, so micro × accum × world stays the configured global batch.
// Throws Error(kUsage) on per_rank_batch < 1 or largest_fit < 1.
BatchPlan plan_accumulation(int64_t per_rank_batch, int64_t largest_fit);

// One line for the log: chosen micro-batch, accumulation, global batch, and (when reduced)
// why the largest fitting size was not used and how to use it.
std::string describe_batch_plan(const BatchPlan& plan, int64_t largest_fit, int64_t per_rank_batch,
                                int world_size);

}  // namespace dnallm::train
