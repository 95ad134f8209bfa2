// Time helpers shared by every module (monotonic clock only: wall-clock jumps never show up
// in a duration).
#pragma once

#include <chrono>

namespace dnallm {

// Seconds elapsed on the steady clock since `t0`.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dnallm
