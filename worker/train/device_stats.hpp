// The device seam (Note [Device seam]): the few CUDA-only calls the worker makes. They are
// the CUDA plugin's (cuda/plugin.cpp, Note [Lazy CUDA] in core/cuda_plugin.hpp), reached
// through the hooks it registers when loaded; without it (a CPU run, a CPU-only build) they
// report "not available". Only light c10 headers here.
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <string_view>

namespace dnallm::train {

struct DeviceMemoryStats {
  bool available = false;        // false on CPU and without the CUDA plugin
  double peak_allocated_mb = 0;  // the caching allocator's peak of allocated bytes, MiB
  double peak_reserved_mb = 0;   // ... of reserved (cached) bytes, MiB
};

// Whether this build made the CUDA plugin (a CUDA LibTorch was found).
bool cuda_build();

// Note [Lazy CUDA]: makes CUDA usable as the device setting `spec` asks, and says whether
// LibTorch sees a CUDA device. Call it before anything asks LibTorch about CUDA:
// - "cpu": nothing is loaded; false.
// - "cuda" / "cuda:N": loads the plugin, or throws Error(kUsage) naming `what` (e.g.
//   "training.device = \"cuda\"") with the loader's reason and what to do.
// - "auto": loads the plugin when the machine shows an NVIDIA GPU (without touching CUDA);
//   when it cannot, warns once and answers false (the CPU).
// Throws Error(kFailure) when LibTorch looked its CUDA hooks up before the plugin was loaded
// (a bug: CUDA would stay unavailable). Other specs load nothing.
bool cuda_usable(const std::string& spec, std::string_view what);

// Peak memory on `device` since the start or the last reset. Any thread.
DeviceMemoryStats device_memory_stats(const c10::Device& device);
void reset_device_memory_peaks(const c10::Device& device);
// "cpu", or the CUDA device's name ("NVIDIA H100 80GB HBM3").
std::string device_name(const c10::Device& device);
// CUDA's sync-debug mode (an error on every host synchronisation) on or off; false when
// there is no CUDA plugin to set it.
bool set_cuda_sync_debug_error(bool on);

}  // namespace dnallm::train
