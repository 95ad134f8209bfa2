#include "cluster/gpu_placement.hpp"

#include <dirent.h>

#include <cctype>
#include <cstring>

#include "core/error.hpp"

namespace dnallm::cluster {
namespace {

// Entries of `dir` accepted by `keep` (0 when `dir` cannot be opened).
template <typename Keep>
int count_entries(const std::string& dir, Keep keep) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0 && keep(e->d_name))
      ++n;
  }
  ::closedir(d);
  return n;
}

}  // namespace

int visible_gpu_count(const EnvMap& env, int host_gpus) {
  auto it = env.find("CUDA_VISIBLE_DEVICES");
  if (it == env.end()) return host_gpus;
  int n = 0;
  std::size_t pos = 0;
  const std::string& v = it->second;
  while (pos <= v.size()) {
    std::size_t end = v.find(',', pos);
    if (end == std::string::npos) end = v.size();
    std::string item = v.substr(pos, end - pos);
    if (item.empty() || item[0] == '-') break;  // CUDA stops at the first invalid id
    ++n;
    pos = end + 1;
  }
  return n;
}

int count_host_gpus(const std::string& dev_dir, const std::string& proc_dir) {
  const int devices = count_entries(dev_dir, [](const char* name) {
    if (std::strncmp(name, "nvidia", 6) != 0 || name[6] == '\0') return false;
    for (const char* p = name + 6; *p != '\0'; ++p) {
      if (!std::isdigit(static_cast<unsigned char>(*p))) return false;
    }
    return true;  // nvidia0, nvidia1, ... (not nvidiactl, nvidia-uvm)
  });
  if (devices > 0) return devices;
  return count_entries(proc_dir, [](const char*) { return true; });
}

GpuPlacement place_on_gpu(int local_rank, int local_world_size, int visible_gpus, bool share_gpus,
                          bool scheduler_binds_gpus) {
  DNALLM_CHECK(visible_gpus > 0, ExitCode::kUsage,
               "training.device asks for CUDA but no GPU is visible to this process (check "
               "CUDA_VISIBLE_DEVICES and nvidia-smi), or set training.device = \"cpu\"");
  DNALLM_CHECK(local_rank >= 0 && local_rank < local_world_size, ExitCode::kUsage,
               "LOCAL_RANK {} is outside [0, LOCAL_WORLD_SIZE {})", local_rank, local_world_size);
  // One GPU per task bound by the scheduler: this rank's own GPU (Note [One GPU per rank]).
  if (scheduler_binds_gpus && visible_gpus == 1) return GpuPlacement{0, false};
  const bool shared = local_world_size > visible_gpus;
  DNALLM_CHECK(!shared || share_gpus, ExitCode::kUsage,
               "{} ranks on this node (LOCAL_WORLD_SIZE) but only {} visible GPU(s): start at "
               "most {} per node (dnallm-launch --nproc-per-node auto), or set "
               "parallel.share_gpus = true to let several ranks share a GPU (they then reduce "
               "over gloo or mpi through host memory)",
               local_world_size, visible_gpus, visible_gpus);
  return GpuPlacement{local_rank % visible_gpus, shared};
}

}  // namespace dnallm::cluster
