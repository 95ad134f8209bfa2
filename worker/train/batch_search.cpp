#include "worker/train/batch_search.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dnallm::train {

MicroBatchSearchResult search_micro_batch(const MicroBatchProbe& probe,
                                          const MicroBatchSearchOptions& options) {
  DNALLM_CHECK(options.start >= 1 && options.max >= options.start, ExitCode::kUsage,
               "micro-batch search needs 1 <= start <= max (got start {}, max {})", options.start,
               options.max);
  MicroBatchSearchResult result;
  auto trial = [&](int64_t m) {
    const bool fits = probe(m);
    result.trials.emplace_back(m, fits);
    return fits;
  };
  // 1. Doubling.
  int64_t fit = 0, fail = 0;
  for (int64_t m = options.start;; m = std::min(m * 2, options.max)) {
    if (!trial(m)) {
      fail = m;
      break;
    }
    fit = m;
    if (m == options.max) break;
  }
  // 2. Bisection in (fit, fail): fit fits (or is 0), fail does not.
  if (fail > 0 && fit > 0) {
    while (fail - fit > 1) {
      const int64_t mid = fit + (fail - fit) / 2;
      if (trial(mid)) {
        fit = mid;
      } else {
        fail = mid;
      }
    }
  }
  result.largest_fit = fit;
  return result;
}

BatchPlan plan_accumulation(int64_t per_rank_batch, int64_t largest_fit) {
  DNALLM_CHECK(per_rank_batch >= 1 && largest_fit >= 1, ExitCode::kUsage,
               "batch plan needs a per-rank batch and a fitting micro-batch >= 1 (got {} and {})",
               per_rank_batch, largest_fit);
  BatchPlan plan;
  int64_t m = std::min(largest_fit, per_rank_batch);
  while (per_rank_batch % m != 0) --m;  // m = 1 always divides
  plan.micro_batch_size = m;
  plan.grad_accum_steps = per_rank_batch / m;
  plan.reduced_to_divide = m < std::min(largest_fit, per_rank_batch);
  return plan;
}

std::string describe_batch_plan(const BatchPlan& plan, int64_t largest_fit, int64_t per_rank_batch,
                                int world_size) {
  std::string line = fmt::format(
      "training.batch_size = \"auto\": micro_batch_size {} x grad_accum_steps {} x {} rank(s) = "
      "global batch {} (largest micro-batch that fits: {}{})",
      plan.micro_batch_size, plan.grad_accum_steps, world_size,
      plan.micro_batch_size * plan.grad_accum_steps * world_size, largest_fit,
      largest_fit >= per_rank_batch ? ", capped at the per-rank batch" : "");
  if (plan.reduced_to_divide) {
    line += fmt::format(
        "; {} does not divide the per-rank batch {} (global {} / {} ranks), so {} is used and "
        "some memory stays unused: make micro_batch_size x grad_accum_steps a multiple of {} to "
        "use it all",
        std::min(largest_fit, per_rank_batch), per_rank_batch, per_rank_batch * world_size,
        world_size, plan.micro_batch_size, std::min(largest_fit, per_rank_batch));
  }
  return line;
}

}  // namespace dnallm::train
