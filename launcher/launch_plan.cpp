#include "launcher/launch_plan.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <iterator>

#include "cluster/gpu_placement.hpp"
#include "cluster/hostlist.hpp"
#include "core/error.hpp"
#include "core/parse_int.hpp"
#include "launcher/sbatch_script.hpp"

namespace dnallm::launcher {

int resolve_nproc(const std::string& spec, const cluster::EnvMap& env, int gpu_device_count) {
  if (spec == "auto") return std::max(1, cluster::visible_gpu_count(env, gpu_device_count));
  const auto v = parse_whole_int(spec);
  if (!v || *v < 1 || *v > 4096) {
    fail(ExitCode::kUsage, "--nproc-per-node '{}' must be a positive integer or 'auto'", spec);
  }
  return static_cast<int>(*v);
}

int count_nvidia_devices(const std::string& dev_dir) {
  return cluster::count_host_gpus(dev_dir, dev_dir == "/dev" ? "/proc/driver/nvidia/gpus" : "");
}

// Note [OMP_NUM_THREADS]: each worker's intra-op pool (OpenMP in LibTorch and BLAS) sizes
// itself to every core by default, so N workers on one node would run N x cores threads
// and thrash. Splitting the cores evenly keeps CPU training fast while avoiding
// oversubscription; torchrun's choice of 1 is safe for GPU runs but wastes cores on CPU
// runs. A user's own OMP_NUM_THREADS always wins.
int default_omp_threads(int cores, int nproc_per_node) {
  return std::max(1, cores / std::max(1, nproc_per_node));
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  DNALLM_SYSCHECK(fd, "socket for a free port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int e = errno;
    ::close(fd);
    fail(ExitCode::kFailure, "cannot bind a free TCP port: {}", errno_string(e));
  }
  socklen_t len = sizeof(addr);
  int rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int e = errno;
  ::close(fd);
  if (rc != 0) fail(ExitCode::kFailure, "getsockname failed: {}", errno_string(e));
  return ntohs(addr.sin_port);
}

std::string self_exe_dir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  DNALLM_SYSCHECK(n, "/proc/self/exe");
  std::string path(buf, static_cast<std::size_t>(n));
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

WorkerEnv worker_env(const LaunchPlan& plan, int local_rank, int restart_count,
                     const std::string& restart_reason) {
  WorkerEnv w;
  w.rank = plan.node_rank * plan.nproc_per_node + local_rank;
  w.local_rank = local_rank;
  w.world_size = plan.world_size();
  w.local_world_size = plan.nproc_per_node;
  w.group_rank = plan.node_rank;
  w.group_world_size = plan.nnodes;
  w.master_addr = plan.master_addr;
  w.master_port = plan.master_port;
  w.restart_count = restart_count;
  w.max_restarts = plan.max_restarts;
  w.run_id = plan.run_id;
  w.generation = restart_count;
  w.job_token = plan.job_token;
  // For rank 0's {"event":"restart","generation":N,"reason":...} metrics line.
  if (restart_count > 0) w.restart_reason = restart_reason;
  if (plan.omp_num_threads > 0) w.omp_num_threads = std::to_string(plan.omp_num_threads);
  return w;
}

std::vector<WorkerSpec> make_worker_specs(const LaunchPlan& plan, const cluster::EnvMap& base_env,
                                          int restart_count, const std::string& restart_reason,
                                          const std::function<void(WorkerEnv&)>& adjust) {
  // Note [mpirun placement] (cluster/topology.hpp): a launcher started by mpirun must not
  // hand its own MPI identity to the workers: they would take OMPI_COMM_WORLD_* for their
  // rank (or pick the MPI backend) and MPI_Init against the launcher's mpirun.
  cluster::EnvMap clean_env = base_env;
  if (clean_env.count("OMPI_COMM_WORLD_RANK") > 0) {
    for (auto it = clean_env.begin(); it != clean_env.end();) {
      const std::string& k = it->first;
      const bool mpi = k.rfind("OMPI_", 0) == 0 || k.rfind("PMIX_", 0) == 0 ||
                       k.rfind("OPAL_", 0) == 0 || k.rfind("ORTE_", 0) == 0;
      it = mpi ? clean_env.erase(it) : std::next(it);
    }
  }
  std::vector<WorkerSpec> specs;
  for (int local = 0; local < plan.nproc_per_node; ++local) {
    WorkerEnv w = worker_env(plan, local, restart_count, restart_reason);
    if (adjust) adjust(w);
    cluster::EnvMap env = clean_env;
    w.to_environment(env);
    WorkerSpec spec;
    spec.rank = w.rank.value_or(0);
    spec.local_rank = local;
    spec.spare_id = w.spare_id.value_or(-1);
    spec.argv = plan.command;
    // dnallm-train unblocks them once its handlers are installed (Note [Early stop signals]).
    spec.hold_stop_signals = !plan.command.empty() &&
                             std::filesystem::path(plan.command[0]).filename() == "dnallm-train";
    for (const auto& kv : env) spec.env.push_back(kv.first + "=" + kv.second);
    specs.push_back(std::move(spec));
  }
  return specs;
}

LaunchPlan resolve_launch_plan(const LaunchRequest& req, const cluster::EnvMap& env,
                               const HostFacts& host) {
  LaunchPlan plan;
  plan.nproc_per_node = resolve_nproc(req.nproc_per_node, env, host.gpu_devices);
  if (req.master_port && (*req.master_port < 0 || *req.master_port > 65535)) {
    fail(ExitCode::kUsage, "--master-port {} is not in [0, 65535]", *req.master_port);
  }
  if (req.max_restarts < 0) {
    fail(ExitCode::kUsage, "--max-restarts {} must be >= 0", req.max_restarts);
  }

  cluster::NodeOverrides node;
  node.nnodes = req.nnodes;
  node.node_rank = req.node_rank;
  node.master_addr = req.master_addr;
  node.master_port = req.master_port;
  cluster::NodePlacement placement = cluster::detect_node_placement(env, node);
  plan.nnodes = placement.nnodes;
  plan.node_rank = placement.node_rank;
  plan.placement_source = cluster::to_string(placement.source);
  plan.hosts = placement.hosts;
  plan.master_addr = placement.master_addr;
  plan.master_port = placement.master_port;
  if (req.master_port && *req.master_port != 0) {
    plan.master_port_source = "from --master-port";
  } else if (plan.master_port != 0) {
    plan.master_port_source = env.count("MASTER_PORT") ? "from MASTER_PORT"
                              : placement.source == cluster::TopologySource::kOpenMpi
                                  ? "from the mpirun job id"
                                  : "from the Slurm job id";
  } else {
    // detect_node_placement refuses port 0 with several nodes: this is one node.
    plan.master_port = host.pick_port();
    plan.master_port_source = "picked free";
  }
  if (plan.nnodes > 1 && req.max_restarts > 0) {
    fail(ExitCode::kUsage,
         "--max-restarts (elastic.max_restarts) {} with {} static nodes needs the elastic "
         "coordinator: run an elastic job (--nnodes MIN:MAX or --rdzv-endpoint, "
         "docs/elastic.md), or use 0",
         req.max_restarts, plan.nnodes);
  }
  plan.max_restarts = req.max_restarts;

  if (!req.run_id.empty()) {
    plan.run_id = req.run_id;
  } else if (auto it = env.find("SLURM_JOB_ID"); it != env.end() && !it->second.empty()) {
    plan.run_id = it->second;
  }
  if (const std::string token = job_token_of(env); !token.empty()) {
    plan.job_token = token;
    plan.job_token_source = "from DNALLM_JOB_TOKEN";
  } else {
    plan.job_token = host.make_token();
    plan.job_token_source = "generated";
  }
  if (env.find("OMP_NUM_THREADS") == env.end()) {
    plan.omp_num_threads = default_omp_threads(host.cores, plan.nproc_per_node);
  }

  if (!req.command.empty()) {
    plan.command = req.command;
  } else {
    std::vector<std::string>& c = plan.command;
    c.push_back(host.exe_dir + "/dnallm-train");
    if (!req.config.empty()) c.insert(c.end(), {"--config", req.config});
    for (const auto& s : req.sets) c.insert(c.end(), {"--set", s});
    if (!req.metrics_file.empty()) c.insert(c.end(), {"--metrics-file", req.metrics_file});
    if (req.log_level) c.insert(c.end(), {"--log-level", *req.log_level});
  }
  return plan;
}

std::string describe_plan(const LaunchPlan& plan, const std::string& backend,
                          const std::string& backend_source) {
  std::string cmd;
  for (const auto& a : plan.command) cmd += (cmd.empty() ? "" : " ") + shell_quote(a);
  std::string out;
  out += "dnallm-launch dry run (nothing started)\n";
  out += fmt::format("  nodes          : {} (this node: rank {}; from {})\n", plan.nnodes,
                     plan.node_rank, plan.placement_source);
  if (!plan.hosts.empty()) {
    out += fmt::format("  hosts          : {}\n", cluster::compress_hostlist(plan.hosts));
  }
  out += fmt::format("  ranks per node : {}\n", plan.nproc_per_node);
  out += fmt::format("  world size     : {}\n", plan.world_size());
  out += fmt::format("  ranks here     : {}..{}\n", plan.node_rank * plan.nproc_per_node,
                     (plan.node_rank + 1) * plan.nproc_per_node - 1);
  out += fmt::format("  coordinator    : {}:{} (port {})\n", plan.master_addr, plan.master_port,
                     plan.master_port_source);
  out += fmt::format("  backend        : {} ({})\n", backend, backend_source);
  out += fmt::format("  job token      : {}\n", plan.job_token_source);
  out += fmt::format("  run id         : {}\n", plan.run_id);
  out += fmt::format("  max restarts   : {}\n", plan.max_restarts);
  out += fmt::format("  omp threads    : {}\n", plan.omp_num_threads > 0
                                                    ? std::to_string(plan.omp_num_threads)
                                                    : std::string("OMP_NUM_THREADS kept"));
  out += fmt::format("  command        : {}\n", cmd);
  return out;
}

}  // namespace dnallm::launcher
