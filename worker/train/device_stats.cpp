// Note [Device seam] in device_stats.hpp; Note [Lazy CUDA] in core/cuda_plugin.hpp.
#include "worker/train/device_stats.hpp"

#include <cstdlib>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>

#include <atomic>
#include <typeinfo>

#include <spdlog/spdlog.h>

#include "core/cuda_plugin.hpp"
#include "core/error.hpp"

namespace dnallm::train {
namespace {

int index_of(const c10::Device& device) { return device.has_index() ? device.index() : -1; }

// LibTorch's CUDA hooks are its own once the plugin (libtorch_cuda.so) is loaded, unless
// something asked for them before: ATen keeps the first answer, the CPU-only stub.
void check_cuda_hooks() {
  if (!cuda_plugin::loaded() || cuda_plugin::hooks() == nullptr ||
      cuda_plugin::hooks()->memory_peaks == nullptr) {
    return;  // no LibTorch CUDA half in this plugin (an NCCL-only build)
  }
  DNALLM_CHECK(typeid(at::detail::getCUDAHooks()) != typeid(at::CUDAHooksInterface),
               ExitCode::kFailure,
               "internal error: LibTorch's CUDA hooks were looked up before the CUDA plugin "
               "was loaded (Note [Lazy CUDA]), so CUDA is unavailable in this process; please "
               "report it with the command line");
}

}  // namespace

bool cuda_build() { return cuda_plugin::built(); }

bool cuda_usable(const std::string& spec, std::string_view what) {
  if (spec == "cpu") return false;
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0) {
    // Note [Lazy CUDA]: no GPU in sight is refused before ~270 MB of CUDA libraries are mapped
    // (every refusal stays small). DNALLM_TEST_LOAD_CUDA_PLUGIN=1 (tests) loads the plugin
    // anyway, so that a machine without a GPU still exercises the loading path.
    const char* force = std::getenv("DNALLM_TEST_LOAD_CUDA_PLUGIN");
    DNALLM_CHECK(
        cuda_plugin::nvidia_gpu_visible() || (force != nullptr && std::string(force) == "1"),
        ExitCode::kUsage,
        "{} but this machine shows no NVIDIA GPU (no /dev/nvidiactl, /dev/dxg or "
        "/proc/driver/nvidia/gpus/*): use \"cpu\" or \"auto\", or run on a GPU node",
        what);
    cuda_plugin::require(what);
  } else if (spec == "auto") {
    if (!cuda_plugin::built() || !cuda_plugin::nvidia_gpu_visible()) return false;
    if (const std::string& why = cuda_plugin::load(); !why.empty()) {
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        spdlog::warn(
            "{} = \"auto\": this machine shows an NVIDIA GPU but the CUDA plugin did "
            "not load ({}): running on the CPU",
            what, why);
      }
      return false;
    }
  } else {
    return false;  // the caller rejects the name
  }
  check_cuda_hooks();
  return torch::cuda::is_available();
}

DeviceMemoryStats device_memory_stats(const c10::Device& device) {
  DeviceMemoryStats out;
  const auto* h = cuda_plugin::hooks();
  if (!device.is_cuda() || h == nullptr || h->memory_peaks == nullptr) return out;
  h->memory_peaks(index_of(device), &out.peak_allocated_mb, &out.peak_reserved_mb);
  out.available = true;
  return out;
}

void reset_device_memory_peaks(const c10::Device& device) {
  const auto* h = cuda_plugin::hooks();
  if (device.is_cuda() && h != nullptr && h->reset_memory_peaks != nullptr)
    h->reset_memory_peaks(index_of(device));
}

std::string device_name(const c10::Device& device) {
  const auto* h = cuda_plugin::hooks();
  if (!device.is_cuda() || h == nullptr || h->device_name == nullptr) return device.str();
  std::string name = h->device_name(index_of(device));
  return name.empty() ? device.str() : name;
}

bool set_cuda_sync_debug_error(bool on) {
  const auto* h = cuda_plugin::hooks();
  if (h == nullptr || h->set_sync_debug_error == nullptr) return false;
  h->set_sync_debug_error(on);
  return true;
}

}  // namespace dnallm::train
