// What the forward + backward step benchmarks share (dnallm-bench-hyena, dnallm-bench-caduceus):
// warm-up steps, timed steps, and the one JSON line each prints beside its reference peer's.
#pragma once

#include <sys/resource.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>

#include <nlohmann/json.hpp>

namespace dnallm::bench {

// Runs `step` `warmup` times, then `steps` times under the clock, and prints `fields` with
// step_s, tokens_per_s (`tokens_per_step` / step_s) and peak_rss_mb added, as one JSON line.
inline void time_steps_and_print(const std::function<void()>& step, int64_t warmup, int64_t steps,
                                 double tokens_per_step, nlohmann::ordered_json fields) {
  for (int64_t i = 0; i < warmup; ++i) step();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) step();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                   double(steps > 0 ? steps : 1);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  fields["step_s"] = s;
  fields["tokens_per_s"] = tokens_per_step / s;
  fields["peak_rss_mb"] = double(ru.ru_maxrss) / 1024.0;
  std::cout << fields.dump() << std::endl;
}

}  // namespace dnallm::bench
