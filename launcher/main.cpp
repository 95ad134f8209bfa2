// dnallm-launch: the per-node agent. This first version runs one node: it spawns
// --nproc-per-node workers with the torchrun-compatible environment, prefixes their output
// with the rank, forwards SIGINT/SIGTERM, stops the group when a worker fails and restarts
// it up to --max-restarts times. See docs/launch.md.
#include <unistd.h>

#include <thread>

#include <CLI/CLI.hpp>

#include "cluster/topology.hpp"
#include "core/cli.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "launcher/launch_plan.hpp"
#include "launcher/spawner.hpp"
#include "launcher/stop_signals.hpp"
#include "launcher/worker_group.hpp"

namespace {

using namespace dnallm;
using namespace dnallm::launcher;

struct Args {
  std::string nproc = "1";
  ConfigOptions config;  // --config, --set, --metrics-file, --log-level, --print-config
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 0;
  int max_restarts = 0;
  double grace_s = 10.0;
  std::string run_id;
  bool dry_run = false;
  std::vector<std::string> command;
};

int run(const Args& args, const CLI::App& app) {
  const ConfigOptions& co = args.config;
  init_logging("launch", co.log_level.empty() ? "info" : co.log_level);
  cluster::EnvMap env = cluster::current_env();

  // The configuration is read here to fail early on a bad file (exit 2 before anything
  // starts), to report the backend, and for the launcher's own log level; the workers read
  // it themselves.
  std::string backend = "auto";
  std::string backend_source = "default";
  if (!co.config_path.empty() || !co.overrides.empty() || co.print_config) {
    Config config = resolve_config(co);
    if (co.print_config) {
      fmt::print("{}", to_toml(config));
      return 0;
    }
    backend = config.parallel.backend;
    backend_source = co.config_path.empty() ? "--set" : "config " + co.config_path;
    spdlog::set_level(parse_log_level(config.logging.level));
  }

  LaunchRequest request;
  request.nproc_per_node = args.nproc;
  if (app.count("--nnodes") > 0) request.nnodes = args.nnodes;
  if (app.count("--node-rank") > 0) request.node_rank = args.node_rank;
  if (app.count("--master-addr") > 0) request.master_addr = args.master_addr;
  if (app.count("--master-port") > 0) request.master_port = args.master_port;
  request.max_restarts = args.max_restarts;
  request.run_id = args.run_id;
  request.command = args.command;
  request.config = co.config_path;
  request.sets = co.overrides;
  request.metrics_file = co.metrics_file;
  if (!co.log_level.empty()) request.log_level = co.log_level;
  if (args.grace_s < 0) fail(ExitCode::kUsage, "--grace-period must be >= 0");

  HostFacts host;
  host.gpu_devices = count_nvidia_devices();
  host.cores = static_cast<int>(std::thread::hardware_concurrency());
  host.exe_dir = self_exe_dir();
  const LaunchPlan plan = resolve_launch_plan(request, env, host);

  if (args.dry_run) {
    fmt::print("{}", describe_plan(plan, backend, backend_source));
    return 0;
  }

  if (args.command.empty() && ::access(plan.command[0].c_str(), X_OK) != 0) {
    fail(ExitCode::kUsage,
         "dnallm-train was not found beside dnallm-launch ({}); build it, or give the worker "
         "command after '--'",
         plan.command[0]);
  }
  auto path_it = env.find("PATH");
  resolve_executable(plan.command[0], path_it == env.end() ? "" : path_it->second);
  spdlog::info("starting {} worker(s), coordinator {}:{}, max restarts {}", plan.nproc_per_node,
               plan.master_addr, plan.master_port, plan.max_restarts);

  // Before any thread exists: every thread inherits the blocked SIGINT/SIGTERM.
  SignalFdStopSignals signals;
  PrefixedConsole console;
  ProcessSpawner spawner(console);
  RestartOptions options;
  options.max_restarts = plan.max_restarts;
  options.group.grace = std::chrono::milliseconds(static_cast<long long>(args.grace_s * 1000));
  RestartLoop loop(spawner, signals, options, [&](int restart, const std::string& reason) {
    return make_worker_specs(plan, env, restart, reason);
  });
  int code = loop.run();
  if (code == 0) spdlog::info("all {} worker(s) finished", plan.nproc_per_node);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{
      "dnallm-launch: start and watch the dnallm-train workers of this node.\n"
      "Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT, TORCHELASTIC_*, DNALLM_GENERATION and DNALLM_JOB_TOKEN. Exit codes:\n"
      "0 ok, 2 usage, 3/5 a worker's bad data / corrupt checkpoint, 4 a worker failed,\n"
      "128+N stopped by signal N.",
      "dnallm-launch"};
  app.add_option("--nproc-per-node", args.nproc,
                 "workers on this node: a number, or 'auto' (one per GPU, else 1)")
      ->capture_default_str();
  // --config/-c, --set, --metrics-file, --log-level (passed through to dnallm-train) and
  // --print-config, as every configuration-reading binary has them.
  add_config_options(app, args.config);
  app.add_option("--nnodes", args.nnodes,
                 "nodes in the job, one dnallm-launch each (default: from a Slurm step, else 1)");
  app.add_option("--node-rank", args.node_rank,
                 "this node's index in [0, nnodes) (default: SLURM_NODEID, else 0)");
  app.add_option("--master-addr", args.master_addr,
                 "coordinator host exported as MASTER_ADDR (default: 127.0.0.1 on one node, "
                 "the first host of a Slurm step)");
  app.add_option("--master-port", args.master_port,
                 "coordinator port exported as MASTER_PORT (default: a free port)");
  app.add_option("--max-restarts", args.max_restarts,
                 "restart the worker group up to R times after a failure")
      ->capture_default_str();
  app.add_option("--grace-period", args.grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  app.add_option("--run-id", args.run_id,
                 "TORCHELASTIC_RUN_ID (default: SLURM_JOB_ID, else 'none')");
  app.add_flag("--dry-run", args.dry_run, "print the resolved plan and exit");
  app.add_option("command", args.command,
                 "worker command after '--' (default: dnallm-train beside this program)");

  return run_main("dnallm-launch", app, argc, argv, [&] { return run(args, app); });
}
