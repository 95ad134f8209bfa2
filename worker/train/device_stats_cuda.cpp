// CUDA LibTorch: see Note [Device seam] in device_stats.hpp. Compiled only in CUDA builds.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include "worker/train/device_stats.hpp"

namespace dnallm::train {
namespace {

c10::DeviceIndex index_of(const c10::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

constexpr double kMiB = 1024.0 * 1024.0;
// StatType::AGGREGATE (all pools together) is index 0 in every LibTorch version; the enum
// itself moved namespaces between 1.13 and 2.x.
constexpr size_t kAggregate = 0;

}  // namespace

bool cuda_build() { return true; }

DeviceMemoryStats device_memory_stats(const c10::Device& device) {
  DeviceMemoryStats out;
  if (!device.is_cuda()) return out;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device));
  out.available = true;
  out.peak_allocated_mb = double(stats.allocated_bytes[kAggregate].peak) / kMiB;
  out.peak_reserved_mb = double(stats.reserved_bytes[kAggregate].peak) / kMiB;
  return out;
}

void reset_device_memory_peaks(const c10::Device& device) {
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(device));
}

std::string device_name(const c10::Device& device) {
  if (!device.is_cuda()) return device.str();
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index_of(device)) != cudaSuccess) return device.str();
  return prop.name;
}

}  // namespace dnallm::train
