#include "comm/make_communicator.hpp"

#include <cstdlib>
#include <map>
#include <mutex>

#include "comm/checked_communicator.hpp"
#include "core/cuda_plugin.hpp"
#include "core/error.hpp"

#ifdef DNALLM_HAVE_GLOO
#include "comm/gloo/gloo_communicator.hpp"
#endif
#ifdef DNALLM_HAVE_MPI
#include "comm/mpi/mpi_communicator.hpp"
#endif

namespace dnallm::comm {
namespace {

// Note [Lazy CUDA]: filled by plugins when they load.
std::mutex registry_mutex;
std::map<std::string, BackendFactory>& registry() {
  static std::map<std::string, BackendFactory> r;
  return r;
}

BackendFactory registered(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[name] = factory;
}

bool backend_available(const std::string& name) {
#ifdef DNALLM_HAVE_GLOO
  if (name == "gloo") return true;
#endif
#ifdef DNALLM_HAVE_MPI
  if (name == "mpi") return true;
#endif
  if (registered(name) != nullptr) return true;
  // The CUDA plugin provides nccl: asking loads it.
  return name == "nccl" && cuda_plugin::load().empty() && registered(name) != nullptr;
}

std::string resolve_backend(const CommOptions& options) {
  if (options.backend != "auto") return options.backend;
  if (options.device.is_cuda() && !options.device_shared && backend_available("nccl"))
    return "nccl";
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr && backend_available("mpi")) return "mpi";
  return "gloo";
}

std::unique_ptr<Communicator> make_communicator(const CommOptions& options) {
  const std::string backend = resolve_backend(options);
  DNALLM_CHECK(backend == "gloo" || backend == "mpi" || backend == "nccl", ExitCode::kUsage,
               "unknown communication backend '{}' ([parallel] backend): use auto, gloo, mpi or "
               "nccl",
               backend);
  DNALLM_CHECK(backend != "nccl" || options.device.is_cuda(), ExitCode::kUsage,
               "parallel.backend = \"nccl\" needs a CUDA device, but this rank trains on the "
               "CPU (training.device, or no GPU visible): set parallel.backend = \"auto\", "
               "\"gloo\" or \"mpi\"");
  DNALLM_CHECK(backend != "nccl" || !options.device_shared, ExitCode::kUsage,
               "parallel.backend = \"nccl\" cannot run two ranks on one GPU "
               "(parallel.share_gpus = true put them there): set parallel.backend = \"auto\" or "
               "\"gloo\" to reduce through host memory, or start one rank per GPU");
  // Note [Lazy CUDA]: nccl is the CUDA plugin's; loading it registers the backend.
  if (backend == "nccl" && registered(backend) == nullptr)
    cuda_plugin::require("parallel.backend = \"nccl\"");
  DNALLM_CHECK(backend_available(backend), ExitCode::kUsage,
               "the '{}' backend was not built into this binary ([parallel] backend); rebuild "
               "with its library installed or choose another",
               backend);
  std::unique_ptr<Communicator> made;
#ifdef DNALLM_HAVE_GLOO
  if (backend == "gloo") made = make_gloo_communicator(options);
#endif
#ifdef DNALLM_HAVE_MPI
  if (backend == "mpi") made = make_mpi_communicator(options);
#endif
  if (!made) {
    const BackendFactory factory = registered(backend);
    DNALLM_CHECK(factory != nullptr, ExitCode::kUsage, "backend '{}' unavailable", backend);
    made = factory(options);
  }
  if (!options.check_collectives) return made;
  return std::make_unique<CheckedCommunicator>(std::move(made), options.store, options.name,
                                               options.timeout);
}

}  // namespace dnallm::comm
