// libdnallm_cuda.so, the CUDA plugin (Note [Lazy CUDA] in core/cuda_plugin.hpp): every call
// into CUDA, the CUDA half of LibTorch and NCCL. Loading it registers what it provides with
// the program that loaded it; nothing else refers to it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#ifdef DNALLM_PLUGIN_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "core/cuda_plugin.hpp"
#include "core/error.hpp"
#ifdef DNALLM_PLUGIN_NCCL
#include "comm/make_communicator.hpp"
#include "comm/nccl/nccl_communicator.hpp"
#endif

namespace dnallm::cuda_plugin {
namespace {

void check(cudaError_t rc, const char* what) {
  DNALLM_CHECK(rc == cudaSuccess, ExitCode::kFailure, "{}: {}", what, cudaGetErrorString(rc));
}

int index_of(int device) {
  if (device >= 0) return device;
  int current = 0;
  check(cudaGetDevice(&current), "cudaGetDevice");
  return current;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index_of(device)) != cudaSuccess) return "";
  return prop.name;
}

void* device_alloc(int device, size_t bytes) {
  check(cudaSetDevice(device), "cudaSetDevice");
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc");
  return p;
}

void device_free(void* p) { cudaFree(p); }

void copy(void* dst, const void* src, size_t bytes, bool to_device) {
  check(cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost),
        to_device ? "cudaMemcpy to the device" : "cudaMemcpy to the host");
}

#ifdef DNALLM_PLUGIN_TORCH_CUDA
// StatType::AGGREGATE (all pools together) is index 0 in every LibTorch version; the enum
// itself moved namespaces between 1.13 and 2.x.
constexpr size_t kAggregate = 0;
constexpr double kMiB = 1024.0 * 1024.0;

c10::DeviceIndex torch_index(int device) {
  return device >= 0 ? static_cast<c10::DeviceIndex>(device) : c10::cuda::current_device();
}

void memory_peaks(int device, double* allocated_mb, double* reserved_mb) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(torch_index(device));
  *allocated_mb = double(stats.allocated_bytes[kAggregate].peak) / kMiB;
  *reserved_mb = double(stats.reserved_bytes[kAggregate].peak) / kMiB;
}

void reset_memory_peaks(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(torch_index(device));
}

void set_sync_debug_error(bool on) {
  c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_ERROR
                                                    : c10::cuda::SyncDebugMode::L_DISABLED);
}
#endif

// Runs when the plugin is loaded (dlopen runs static initialisers).
struct Registrar {
  Registrar() {
    Hooks h;
    h.device_name = &device_name;
    h.device_alloc = &device_alloc;
    h.device_free = &device_free;
    h.copy = &copy;
#ifdef DNALLM_PLUGIN_TORCH_CUDA
    h.memory_peaks = &memory_peaks;
    h.reset_memory_peaks = &reset_memory_peaks;
    h.set_sync_debug_error = &set_sync_debug_error;
#endif
    register_hooks(h);
#ifdef DNALLM_PLUGIN_NCCL
    comm::register_backend("nccl", &comm::make_nccl_communicator);
#endif
  }
};
const Registrar registrar;

}  // namespace
}  // namespace dnallm::cuda_plugin
