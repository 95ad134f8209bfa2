// What dnallm-launch will start on this node, as data: resolved from the command line and
// environment by pure functions so it can be printed (--dry-run) and unit-tested.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cluster/topology.hpp"
#include "coordinator/net.hpp"
#include "core/worker_env.hpp"
#include "launcher/spawner.hpp"

namespace dnallm::launcher {

struct LaunchPlan {
  int nproc_per_node = 1;
  int nnodes = 1;     // static placement (cluster::detect_node_placement); the elastic
  int node_rank = 0;  // coordinator will assign these per generation
  std::string placement_source = "single process";  // cluster::to_string(TopologySource)
  std::vector<std::string> hosts;                   // node host names when known
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string master_port_source;    // "from --master-port" | "picked free" | ...
  std::vector<std::string> command;  // the worker argv
  std::string run_id = "none";
  std::string job_token;
  std::string job_token_source;  // "DNALLM_JOB_TOKEN" | "generated"
  int max_restarts = 0;
  int omp_num_threads = 0;  // exported when the environment lacks OMP_NUM_THREADS

  int world_size() const { return nnodes * nproc_per_node; }
};

// 32 hex characters from /dev/urandom (coordinator/net.hpp).
using coordinator::generate_job_token;

// Binds port 0 on all interfaces, reads the port the kernel chose, and releases it. Another
// process may take it before rank 0 binds it (small window); the coordinator will own its
// port once it exists.
int pick_free_port();

// What the command line and the configuration's [elastic] section asked for (dnallm-launch's
// flags override the keys), before resolution.
struct LaunchRequest {
  std::string nproc_per_node = "1";  // a number or "auto"
  std::optional<int> nnodes;
  std::optional<int> node_rank;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;    // 0: pick a free one (single node only)
  int max_restarts = 0;              // elastic.max_restarts, or --max-restarts
  std::string run_id;                // "": SLURM_JOB_ID, else "none"
  std::vector<std::string> command;  // "": dnallm-train beside dnallm-launch
  // Passed through to the default command only.
  std::string config;
  std::vector<std::string> sets;
  std::string metrics_file;
  std::optional<std::string> log_level;
};

// Facts about this machine and process that the plan depends on (injected for tests).
struct HostFacts {
  int gpu_devices = 0;  // count_nvidia_devices()
  int cores = 1;        // std::thread::hardware_concurrency()
  std::string exe_dir;  // self_exe_dir()
  std::function<int()> pick_port = pick_free_port;
  std::function<std::string()> make_token = generate_job_token;
};

// Resolves a request against the environment: nproc, placement
// (cluster::detect_node_placement), the coordinator port (given, Slurm-derived, or picked
// free on a single node), run id, job token (DNALLM_JOB_TOKEN or a new one),
// OMP_NUM_THREADS (Note [OMP_NUM_THREADS]) and the worker command. Throws Error(kUsage).
LaunchPlan resolve_launch_plan(const LaunchRequest& request, const cluster::EnvMap& env,
                               const HostFacts& host);

// "--nproc-per-node" value: a positive integer, or "auto" = one per GPU (the entries of
// CUDA_VISIBLE_DEVICES when it is set, else `gpu_device_count`), and 1 (one CPU worker)
// when no GPU is visible.
// Throws Error(kUsage) on anything else.
int resolve_nproc(const std::string& spec, const cluster::EnvMap& env, int gpu_device_count);

// Counts /dev/nvidia0, /dev/nvidia1, ... (not nvidiactl, nvidia-uvm); for "/dev" with none
// there, the driver's /proc/driver/nvidia/gpus entries (cluster::count_host_gpus).
int count_nvidia_devices(const std::string& dev_dir = "/dev");

// Note [OMP_NUM_THREADS]: max(1, cores / nproc).
int default_omp_threads(int cores, int nproc_per_node);

// The directory of this executable (/proc/self/exe), e.g. to find dnallm-train beside it.
std::string self_exe_dir();

// Local rank `local_rank`'s environment for one generation (Note [Worker environment] in
// core/worker_env.hpp): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
// TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, DNALLM_GENERATION, DNALLM_JOB_TOKEN,
// OMP_NUM_THREADS (plan.omp_num_threads > 0) and, after a restart, DNALLM_RESTART_REASON.
// DNALLM_GENERATION equals the restart count while the group is local; the elastic
// coordinator numbers generations job-wide (make_elastic_worker_specs).
WorkerEnv worker_env(const LaunchPlan& plan, int local_rank, int restart_count,
                     const std::string& restart_reason);

// Every worker's spec for one generation: the base environment with worker_env() written over
// it (WorkerEnv::to_environment: the variables above replaced when present, OMP_NUM_THREADS
// only when absent, DNALLM_RESTART_REASON removed when there is no reason). `adjust`, when
// set, changes each worker's WorkerEnv first (the elastic agent's job-wide ranks). Under
// mpirun (OMPI_COMM_WORLD_RANK in `base_env`) the MPI launcher's variables (OMPI_*, PMIX_*,
// OPAL_*, ORTE_*) are removed: they describe the launcher, not the workers.
std::vector<WorkerSpec> make_worker_specs(const LaunchPlan& plan, const cluster::EnvMap& base_env,
                                          int restart_count, const std::string& restart_reason = "",
                                          const std::function<void(WorkerEnv&)>& adjust = {});

// The --dry-run report: nodes, ranks per node, coordinator endpoint, backend, token source,
// command, and rank 0's exported variables.
std::string describe_plan(const LaunchPlan& plan, const std::string& backend,
                          const std::string& backend_source);

}  // namespace dnallm::launcher
