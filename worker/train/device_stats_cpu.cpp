// CPU-only LibTorch: see Note [Device seam] in device_stats.hpp.
#include "worker/train/device_stats.hpp"

namespace dnallm::train {

bool cuda_build() { return false; }
DeviceMemoryStats device_memory_stats(const c10::Device&) { return {}; }
void reset_device_memory_peaks(const c10::Device&) {}
std::string device_name(const c10::Device& device) { return device.str(); }

}  // namespace dnallm::train
