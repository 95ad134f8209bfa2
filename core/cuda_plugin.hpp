// Note [Lazy CUDA]: the worker programs (dnallm-train, dnallm-infer, dnallm-eval, the benches
// and tests that link the worker) link only LibTorch's CPU half (libtorch_cpu, libc10). Every
// CUDA-touching piece (the NCCL backend, the caching allocator's statistics, the CUDA runtime
// calls of dnallm-bench-comm) lives in one plugin, libdnallm_cuda.so (cuda/), that needs
// libtorch_cuda, libc10_cuda, libnccl and libcudart; a program dlopen()s it (RTLD_NOW |
// RTLD_GLOBAL) only when a GPU run is asked for, after its command line and configuration
// were checked. Why:
// - a refusal (exit 2 or 5 on bad input) is cheap: PyPI's CUDA LibTorch maps about 270 MB of
//   CUDA libraries (cuBLAS, cuDNN, cuSPARSE, NVRTC, ...) at start, and a worker that refused
//   a bad flag peaked at ~516 MB; it now peaks at the CPU half's ~130 MB
//   (bench/refusal_memory.sh measures every kind of refusal against older binaries);
// - a CPU run never maps the CUDA libraries.
// Loading libtorch_cuda.so registers ATen's CUDA hooks and kernels. ATen looks its hooks up
// once (at::detail::getCUDAHooks(): torch::cuda::is_available(), at::hasCUDA(),
// torch::manual_seed, a "cuda" device, ...) and keeps the answer: anything that asks before
// the plugin is loaded leaves CUDA unavailable for the whole process. So the device is
// resolved first (train::cuda_usable in worker/train/device_stats.hpp, called where
// training.device, --device and parallel.backend = "nccl" are resolved), and it checks that
// the hooks it finds are LibTorch's CUDA ones.
// The plugin registers what it provides when it is loaded (a static object in
// cuda/plugin.cpp): the "nccl" communicator backend (comm::register_backend) and the CUDA
// device hooks below. Programs that may load it export their dnallm:: symbols
// (cmake/dnallm-plugin-exports.list), so the plugin's calls reach the program's registries.
// Torch-free: the communicator and dnallm-bench-comm use it too.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dnallm::cuda_plugin {

// Whether this build made the plugin (a CUDA LibTorch or NCCL was found at configure time).
bool built();

// Where the plugin is looked for, in order: $DNALLM_CUDA_PLUGIN (a file), next to the
// program (<dir of /proc/self/exe>/libdnallm_cuda.so), the build tree's bin/ (tests).
std::string search_paths();

// Whether this machine shows an NVIDIA GPU, found without touching CUDA: /dev/nvidiactl
// exists (WSL2: /dev/dxg) or /proc/driver/nvidia/gpus/ lists a GPU.
bool nvidia_gpu_visible();

// Loads the plugin, once per process (thread-safe). Returns "" once it is loaded, else why
// not (not built, or each path's dlerror() text).
const std::string& load();
bool loaded();

// load(), or throws Error(kUsage): "<what> needs the CUDA plugin ...: <why>; <what to do>".
void require(std::string_view what);

// What the plugin registers (Note [Device seam] in worker/train/device_stats.hpp). Device
// -1 is the current CUDA device. Any member may be null.
struct Hooks {
  // The caching allocator's peaks of allocated / reserved bytes, in MiB.
  void (*memory_peaks)(int device, double* allocated_mb, double* reserved_mb) = nullptr;
  void (*reset_memory_peaks)(int device) = nullptr;
  // The device's name ("NVIDIA H100 80GB HBM3"); "" when the driver cannot say.
  std::string (*device_name)(int device) = nullptr;
  // CUDA's sync-debug mode: error on a host synchronisation (true) or off.
  void (*set_sync_debug_error)(bool on) = nullptr;
  // Raw device memory (dnallm-bench-comm's NCCL buffers). Throw Error on failure.
  void* (*device_alloc)(int device, size_t bytes) = nullptr;
  void (*device_free)(void* ptr) = nullptr;
  void (*copy)(void* dst, const void* src, size_t bytes, bool to_device) = nullptr;
};
void register_hooks(const Hooks& hooks);
// Null until the plugin registered its hooks.
const Hooks* hooks();

}  // namespace dnallm::cuda_plugin
