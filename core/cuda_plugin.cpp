// Note [Lazy CUDA] in cuda_plugin.hpp.
#include "core/cuda_plugin.hpp"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "core/error.hpp"

namespace dnallm::cuda_plugin {
namespace {

constexpr const char* kFileName = "libdnallm_cuda.so";

std::vector<std::string> candidates() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("DNALLM_CUDA_PLUGIN"); env != nullptr && *env != '\0') {
    out.emplace_back(env);  // an override is the only place looked at
    return out;
  }
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) out.push_back((exe.parent_path() / kFileName).string());
#ifdef DNALLM_CUDA_PLUGIN_BUILD_PATH
  if (out.empty() || out.front() != DNALLM_CUDA_PLUGIN_BUILD_PATH)
    out.emplace_back(DNALLM_CUDA_PLUGIN_BUILD_PATH);
#endif
  return out;
}

std::mutex load_mutex;
std::atomic<bool> is_loaded{false};
// Its own lock: the plugin registers while load() holds load_mutex (dlopen runs its
// static initialisers).
std::mutex hooks_mutex;
Hooks registered;
std::atomic<bool> has_hooks{false};

}  // namespace

bool built() {
#ifdef DNALLM_CUDA_PLUGIN_BUILD_PATH
  return true;
#else
  return false;
#endif
}

std::string search_paths() {
  std::string out;
  for (const auto& p : candidates()) out += (out.empty() ? "" : ", ") + p;
  return out;
}

bool nvidia_gpu_visible() {
  std::error_code ec;
  if (std::filesystem::exists("/dev/nvidiactl", ec)) return true;
  if (std::filesystem::exists("/dev/dxg", ec)) return true;  // WSL2's GPU (any vendor)
  std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec);
  return !ec && it != std::filesystem::directory_iterator();
}

const std::string& load() {
  static std::string error;
  std::lock_guard<std::mutex> lock(load_mutex);
  if (is_loaded) return error;
  if (!built()) {
    error = "this build has no CUDA plugin (configured without a CUDA LibTorch and NCCL)";
    return error;
  }
  std::string why;
  for (const auto& path : candidates()) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) {
      why += (why.empty() ? "" : "; ") + path + ": no such file";
      continue;
    }
    // RTLD_GLOBAL: LibTorch's CUDA half must serve later lookups (kernels, hooks) of the
    // whole process. Never unloaded.
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) {
      is_loaded = true;
      error.clear();
      return error;
    }
    const char* e = dlerror();
    why += (why.empty() ? "" : "; ") + std::string(e != nullptr ? e : path + ": dlopen failed");
    break;  // the file is there but cannot load: what dlerror says is the answer
  }
  error = why;
  return error;
}

bool loaded() { return is_loaded; }

void require(std::string_view what) {
  const std::string& why = load();
  if (why.empty()) return;
  if (!built()) {
    fail(ExitCode::kUsage,
         "{} needs CUDA, but this build has none ({}): rebuild against a CUDA LibTorch "
         "(scripts/build.sh --cuda, docs/gpu.md) or use the CPU",
         what, why);
  }
  fail(ExitCode::kUsage,
       "{} needs the CUDA plugin libdnallm_cuda.so, which did not load: {}. Build it "
       "(scripts/build.sh builds it beside the programs), set DNALLM_CUDA_PLUGIN to its path, "
       "fix the library it names (LD_LIBRARY_PATH, docs/gpu.md), or use the CPU",
       what, why);
}

void register_hooks(const Hooks& hooks) {
  std::lock_guard<std::mutex> lock(hooks_mutex);
  registered = hooks;
  has_hooks = true;
}

const Hooks* hooks() { return has_hooks ? &registered : nullptr; }

}  // namespace dnallm::cuda_plugin
