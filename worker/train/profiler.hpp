// `dnallm-train --profile START:END`: a Chrome/Perfetto trace (LibTorch's Kineto profiler)
// of optimizer steps START..END (1-based, inclusive), CPU ops and, on CUDA, kernels.
//
// Kineto is compiled into pip's LibTorch 2.x but not into every LibTorch (Debian's 1.13 has
// none): kineto_available() probes the library at run time, and StepProfiler's constructor
// refuses (Error kUsage, exit 2) when it is absent, before any training.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>

namespace dnallm::train {

struct ProfileRange {
  int64_t first = 0, last = 0;  // 1-based optimizer steps, inclusive
};

// Parses "START:END" (1 <= START <= END). Throws Error(kUsage) naming `option`.
ProfileRange parse_profile_range(const std::string& text, const std::string& option);

// Whether this LibTorch can record and save a Kineto trace (tries an empty one).
bool kineto_available();

// Training thread only: before_step(s) starts the profiler at s == first, after_step(s)
// stops it at s == last, writes `path` and logs where. The destructor stops a running
// profiler without writing (never throws).
class StepProfiler {
 public:
  // Throws Error(kUsage) when Kineto is absent (call it before training starts).
  StepProfiler(ProfileRange range, std::string path);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // `device`: the trainer's (CUDA adds kernel activity to the trace).
  void before_step(int64_t step, const c10::Device& device);
  void after_step(int64_t step);
  const std::string& path() const { return path_; }
  bool written() const { return written_; }

 private:
  ProfileRange range_;
  std::string path_;
  bool running_ = false, written_ = false;
};

}  // namespace dnallm::train
