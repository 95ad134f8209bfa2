// The device seam (Note [Device seam]): the few CUDA-only calls the trainer makes for its
// metrics. device_stats_cuda.cpp implements them in a CUDA LibTorch build (the caching
// allocator's statistics, the device's name); device_stats_cpu.cpp is the fallback for
// CPU-only builds, where they report "not available". Only light c10 headers here.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace dnallm::train {

struct DeviceMemoryStats {
  bool available = false;        // false on CPU and in CPU-only builds
  double peak_allocated_mb = 0;  // the caching allocator's peak of allocated bytes, MiB
  double peak_reserved_mb = 0;   // ... of reserved (cached) bytes, MiB
};

// Whether this binary was built against a CUDA LibTorch.
bool cuda_build();
// Peak memory on `device` since the start or the last reset. Any thread.
DeviceMemoryStats device_memory_stats(const c10::Device& device);
void reset_device_memory_peaks(const c10::Device& device);
// "cpu", or the CUDA device's name ("NVIDIA H100 80GB HBM3").
std::string device_name(const c10::Device& device);

}  // namespace dnallm::train
