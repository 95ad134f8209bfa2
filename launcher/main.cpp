// dnallm-launch: the per-node agent. Without a rendezvous it runs one node (or a static
// placement): it spawns --nproc-per-node workers with the torchrun-compatible environment,
// prefixes their output with the rank, forwards SIGINT/SIGTERM/SIGUSR1, stops the group when a
// worker fails and restarts it up to --max-restarts times (docs/launch.md). With
// --standalone, --rdzv-endpoint, --rdzv-id or --nnodes MIN:MAX it is an elastic agent of a
// coordinator-driven job (launcher/elastic_agent.hpp, docs/elastic.md); the node-rank-0
// agent (and the --standalone one) hosts the coordinator.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>

#include "cluster/topology.hpp"
#include "coordinator/elastic_client.hpp"
#include "coordinator/elastic_service.hpp"
#include "coordinator/store_server.hpp"
#include "core/cli.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "launcher/elastic_agent.hpp"
#include "launcher/launch_plan.hpp"
#include "launcher/sbatch_script.hpp"
#include "launcher/spawner.hpp"
#include "launcher/stop_signals.hpp"
#include "launcher/worker_group.hpp"

namespace {

using namespace dnallm;
using namespace dnallm::launcher;

struct Args {
  std::string nproc = "1";
  ConfigOptions config;  // --config, --set, --metrics-file, --log-level, --print-config
  std::string nnodes = "1";
  int node_rank = 0;
  // Elastic (docs/elastic.md).
  bool standalone = false;
  std::string rdzv_endpoint;
  std::string rdzv_id;
  std::string rdzv_host;
  std::string node_id;
  std::string token_file;
  double monitor_interval_s = 1.0;
  double settle_s = 2.0;
  double heartbeat_timeout_s = 10.0;
  double hang_timeout_s = 300.0;
  double join_timeout_s = 600.0;
  int max_membership_changes = 10;
  std::string master_addr;
  int master_port = 0;
  int max_restarts = 0;
  double grace_s = 10.0;
  std::string run_id;
  bool dry_run = false;
  std::vector<std::string> command;
  // --sbatch-script (docs/slurm.md).
  bool sbatch_script = false;
  bool sbatch_gpus = false;
  int cpus_per_task = 0;
  int signal_lead_s = 120;
  std::string job_name = "dnallm";
  std::string sbatch_output = "dnallm-%j.out";
  std::string job_dir;
  std::vector<std::string> sbatch_args;
};

std::string read_token_file(const std::string& path) {
  std::ifstream f(path);
  std::string token;
  DNALLM_CHECK(f && std::getline(f, token) && !token.empty(), ExitCode::kUsage,
               "--token-file {}: cannot read a token from its first line", path);
  return token;
}

std::string this_host() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

// The elastic path (docs/elastic.md): optionally host the coordinator, then run the agent.
int run_elastic(const Args& args, const CLI::App& app, LaunchPlan plan,
                const cluster::EnvMap& env) {
  const auto [min_nodes, max_nodes] = parse_nnodes(args.nnodes);
  const bool explicit_node_rank = app.count("--node-rank") > 0;
  auto slurm_node = env.find("SLURM_NODEID");
  const int node_rank = explicit_node_rank        ? args.node_rank
                        : slurm_node != env.end() ? std::atoi(slurm_node->second.c_str())
                                                  : -1;
  const bool host_coordinator = args.standalone || node_rank == 0;

  // Endpoint and token.
  std::string endpoint_host = "127.0.0.1";
  int endpoint_port = 0;
  if (!args.rdzv_endpoint.empty()) {
    std::tie(endpoint_host, endpoint_port) = parse_endpoint(args.rdzv_endpoint, "--rdzv-endpoint");
  } else if (!args.standalone) {
    DNALLM_CHECK(app.count("--master-addr") > 0 && app.count("--master-port") > 0, ExitCode::kUsage,
                 "an elastic job needs the coordinator's address: give --rdzv-endpoint HOST:PORT "
                 "(or --master-addr and --master-port), or --standalone for one node");
    endpoint_host = args.master_addr;
    endpoint_port = args.master_port;
  }
  std::string token;
  if (!args.token_file.empty()) {
    token = read_token_file(args.token_file);
  } else if (env.count("DNALLM_JOB_TOKEN") > 0 && !env.at("DNALLM_JOB_TOKEN").empty()) {
    token = env.at("DNALLM_JOB_TOKEN");
  } else {
    DNALLM_CHECK(args.standalone, ExitCode::kUsage,
                 "the nodes of a job must share a job token: set DNALLM_JOB_TOKEN (the same on "
                 "every node) or pass --token-file FILE");
    token = plan.job_token;  // generated: only this node's workers need it
  }
  plan.job_token = token;
  DNALLM_CHECK(args.monitor_interval_s > 0, ExitCode::kUsage, "--monitor-interval must be > 0");

  // Before any thread exists: every thread inherits the blocked SIGINT/SIGTERM.
  SignalFdStopSignals signals;
  auto ms = [](double s) { return std::chrono::milliseconds(static_cast<long long>(s * 1000)); };

  // Declared in this order so that on an exception the server (whose io thread runs the
  // service's handlers) is stopped and joined before the service is destroyed.
  std::unique_ptr<coordinator::ElasticService> service;
  std::unique_ptr<coordinator::StoreServer> server;
  coordinator::ElasticServiceOptions service_options;
  if (host_coordinator) {
    coordinator::StoreServerOptions so;
    so.host = !args.rdzv_host.empty() ? args.rdzv_host : endpoint_host;
    so.port = static_cast<uint16_t>(endpoint_port);
    so.token = token;
    auto& eo = service_options.state;
    eo.min_nodes = args.standalone ? 1 : min_nodes;
    eo.max_nodes = args.standalone ? 1 : max_nodes;
    eo.settle = ms(args.settle_s);
    eo.heartbeat_timeout = ms(args.heartbeat_timeout_s);
    eo.step_timeout = ms(args.hang_timeout_s);
    eo.join_timeout = ms(args.join_timeout_s);
    eo.max_restarts = args.max_restarts;
    eo.max_membership_changes = args.max_membership_changes;
    server = std::make_unique<coordinator::StoreServer>(so);
    service = std::make_unique<coordinator::ElasticService>(*server, service_options);
    server->start();
    service->start();
    endpoint_port = server->port();
    spdlog::info("hosting the coordinator on {}:{} (nodes {}..{}, max restarts {})", so.host,
                 endpoint_port, eo.min_nodes, eo.max_nodes, eo.max_restarts);
  }
  plan.master_addr = endpoint_host;
  plan.master_port = endpoint_port;

  char tmpl[] = "/tmp/dnallm-progress-XXXXXX";
  DNALLM_CHECK(::mkdtemp(tmpl) != nullptr, ExitCode::kFailure,
               "cannot create a progress directory under /tmp");
  const std::string progress_dir = tmpl;

  coordinator::TcpStoreClientOptions co;
  co.host = endpoint_host;
  co.port = static_cast<uint16_t>(endpoint_port);
  co.token = token;
  co.connect_timeout = std::chrono::seconds(60);
  // A coordinator silent for a heartbeat timeout would declare this node dead: the agent
  // gives up on it after as long (the first connect, above, may wait for node 0 to start).
  co.op_timeout = std::max(ms(args.heartbeat_timeout_s), std::chrono::milliseconds(1000));

  ElasticAgentOptions ao;
  ao.node.host = this_host();
  ao.node.node_id =
      !args.node_id.empty() ? args.node_id : fmt::format("{}:{}", ao.node.host, ::getpid());
  ao.node.nproc = plan.nproc_per_node;
  ao.monitor_interval = ms(args.monitor_interval_s);
  ao.poll_interval = std::min(ao.monitor_interval, std::chrono::milliseconds(100));
  ao.progress_dir = progress_dir;
  ao.group.grace = ms(args.grace_s);

  int code = 0;
  {
    PrefixedConsole console;
    ProcessSpawner spawner(console);
    coordinator::ElasticClient client(co);
    ElasticAgent agent(client, spawner, signals, ao,
                       [&](const coordinator::NodeAssignment& a, const std::string& reason) {
                         return make_elastic_worker_specs(plan, env, a, reason, progress_dir);
                       });
    try {
      code = agent.run();
    } catch (...) {
      for (int i = 0; i < ao.node.nproc; ++i) std::remove(progress_file(progress_dir, i).c_str());
      ::rmdir(progress_dir.c_str());
      throw;
    }
  }
  for (int i = 0; i < ao.node.nproc; ++i) std::remove(progress_file(progress_dir, i).c_str());
  ::rmdir(progress_dir.c_str());
  if (service) {
    // Let the other agents learn the outcome before the coordinator goes away.
    if (code == static_cast<int>(ExitCode::kRequeue)) {
      // Preempted: this node's workers committed and exited 75. The coordinator cannot
      // know that (it would wait a heartbeat timeout, declare this node dead and open a new
      // generation that nobody will run): stop it now. Other nodes got the same notice.
      spdlog::warn(
          "preempted: the workers committed a checkpoint and exited {}; stopping the "
          "coordinator hosted here (the requeued job resumes from the checkpoint)",
          code);
    } else if (code < 128) {  // the job ended (not this agent interrupted by a signal)
      service->wait_outcome_delivered(service_options.state.heartbeat_timeout);
    }
    service->stop();
    server->stop();
    service->join();
    server->join();
  }
  return code;
}

std::string absolute(const std::string& path) {
  return path.empty() ? path : std::filesystem::absolute(path).lexically_normal().string();
}

// --sbatch-script: print an sbatch file that runs this launch on every node of a Slurm job
// (launcher/sbatch_script.hpp). Paths become absolute so the job finds them from any node.
int print_sbatch_script(const Args& args, const CLI::App& app, const Config* config) {
  const bool elastic = args.standalone || app.count("--rdzv-endpoint") > 0 ||
                       app.count("--rdzv-id") > 0 || args.nnodes.find(':') != std::string::npos;
  if (elastic) {
    fail(ExitCode::kUsage,
         "--sbatch-script writes a static Slurm job (one dnallm-launch per node, placed by "
         "srun); drop --standalone/--rdzv-*/--nnodes MIN:MAX");
  }
  if (app.count("--node-rank") > 0 || app.count("--master-addr") > 0) {
    fail(ExitCode::kUsage,
         "--sbatch-script: --node-rank and --master-addr come from the Slurm step on each node; "
         "drop them");
  }
  SbatchOptions o;
  o.nodes = parse_nnodes(args.nnodes).first;
  if (args.nproc == "auto") {
    fail(ExitCode::kUsage,
         "--sbatch-script needs --nproc-per-node as a number (it sets --cpus-per-task and, for "
         "GPU workers, --gpus-per-node), not 'auto'");
  }
  o.nproc_per_node = resolve_nproc(args.nproc, {}, 0);
  const bool cuda_config = config != nullptr && (config->training.device == "cuda" ||
                                                 config->parallel.backend == "nccl");
  o.gpus = args.sbatch_gpus || cuda_config;
  o.cpus_per_task = args.cpus_per_task;
  o.signal_lead_s = args.signal_lead_s;
  o.job_name = args.job_name;
  o.output = args.sbatch_output;
  o.job_dir = absolute(args.job_dir);
  o.chdir = std::filesystem::current_path().string();
  o.extra_sbatch = args.sbatch_args;

  auto& a = o.launch_argv;
  a = {self_exe_dir() + "/dnallm-launch", "--nproc-per-node", std::to_string(o.nproc_per_node)};
  const ConfigOptions& co = args.config;
  if (!co.config_path.empty()) a.insert(a.end(), {"--config", absolute(co.config_path)});
  for (const auto& set : co.overrides) a.insert(a.end(), {"--set", set});
  if (!co.metrics_file.empty()) a.insert(a.end(), {"--metrics-file", absolute(co.metrics_file)});
  if (!co.log_level.empty()) a.insert(a.end(), {"--log-level", co.log_level});
  if (app.count("--master-port") > 0) {
    a.insert(a.end(), {"--master-port", std::to_string(args.master_port)});
  }
  if (app.count("--grace-period") > 0) {
    a.insert(a.end(), {"--grace-period", fmt::format("{}", args.grace_s)});
  }
  if (app.count("--run-id") > 0) a.insert(a.end(), {"--run-id", args.run_id});
  if (args.max_restarts != 0) {
    fail(ExitCode::kUsage,
         "--sbatch-script: --max-restarts {} needs the elastic coordinator across nodes; a "
         "preempted or failed job is requeued by Slurm instead (use 0)",
         args.max_restarts);
  }
  if (!args.command.empty()) {
    a.push_back("--");
    a.insert(a.end(), args.command.begin(), args.command.end());
  }
  fmt::print("{}", make_sbatch_script(o));
  return 0;
}

int run(const Args& args, const CLI::App& app) {
  const ConfigOptions& co = args.config;
  init_logging("launch", co.log_level.empty() ? "info" : co.log_level);
  cluster::EnvMap env = cluster::current_env();

  // The configuration is read here to fail early on a bad file (exit 2 before anything
  // starts), to report the backend, and for the launcher's own log level; the workers read
  // it themselves.
  std::string backend = "auto";
  std::string backend_source = "default";
  std::optional<Config> config;
  if (!co.config_path.empty() || !co.overrides.empty() || co.print_config) {
    config = resolve_config(co);
    if (co.print_config) {
      fmt::print("{}", to_toml(*config));
      return 0;
    }
    backend = config->parallel.backend;
    backend_source = co.config_path.empty() ? "--set" : "config " + co.config_path;
    spdlog::set_level(parse_log_level(config->logging.level));
  }
  if (args.sbatch_script) return print_sbatch_script(args, app, config ? &*config : nullptr);

  LaunchRequest request;
  request.nproc_per_node = args.nproc;
  const bool elastic = args.standalone || app.count("--rdzv-endpoint") > 0 ||
                       app.count("--rdzv-id") > 0 || args.nnodes.find(':') != std::string::npos;
  if (app.count("--nnodes") > 0 && !elastic) request.nnodes = parse_nnodes(args.nnodes).first;
  if (app.count("--node-rank") > 0) request.node_rank = args.node_rank;
  if (app.count("--master-addr") > 0) request.master_addr = args.master_addr;
  if (app.count("--master-port") > 0) request.master_port = args.master_port;
  request.max_restarts = args.max_restarts;
  request.run_id = !args.rdzv_id.empty() ? args.rdzv_id : args.run_id;
  if (elastic) {
    // The coordinator places this node; resolve the rest as for one node.
    request.nnodes.reset();
    request.node_rank.reset();
    if (!request.master_addr) request.master_addr = "127.0.0.1";
    if (!request.master_port) request.master_port = 0;
  }
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

  if (elastic && !args.dry_run) {
    if (args.command.empty() && ::access(plan.command[0].c_str(), X_OK) != 0) {
      fail(ExitCode::kUsage,
           "dnallm-train was not found beside dnallm-launch ({}); build it, or give the worker "
           "command after '--'",
           plan.command[0]);
    }
    return run_elastic(args, app, plan, env);
  }
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
  if (plan.nnodes > 1 && plan.job_token_source == "generated") {
    spdlog::warn(
        "{} nodes with a job token generated on this node: the other nodes' workers "
        "will be refused by the store unless every node has the same token; set "
        "DNALLM_JOB_TOKEN (the --sbatch-script job does; mpirun: -x DNALLM_JOB_TOKEN)",
        plan.nnodes);
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
      "Elastic multi-node jobs (--standalone, --rdzv-endpoint, --rdzv-id, --nnodes MIN:MAX):\n"
      "see docs/elastic.md; the node-rank-0 agent hosts the coordinator.\n"
      "Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT, TORCHELASTIC_*, DNALLM_GENERATION and DNALLM_JOB_TOKEN. Exit codes:\n"
      "0 ok, 2 usage, 3/5 a worker's bad data / corrupt checkpoint, 4 a worker failed,\n"
      "75 preempted (SIGUSR1 forwarded; the workers checkpointed; run again to resume),\n"
      "128+N stopped by signal N. Slurm: --sbatch-script, docs/slurm.md; mpirun: docs/mpirun.md.",
      "dnallm-launch"};
  app.add_option("--nproc-per-node", args.nproc,
                 "workers on this node: a number, or 'auto' (one per GPU, else 1)")
      ->capture_default_str();
  // --config/-c, --set, --metrics-file, --log-level (passed through to dnallm-train) and
  // --print-config, as every configuration-reading binary has them.
  add_config_options(app, args.config);
  app.add_option("--nnodes", args.nnodes,
                 "nodes in the job, one dnallm-launch each: N, or MIN:MAX for an elastic job "
                 "(default: from a Slurm step, else 1)");
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
  // Slurm batch script (docs/slurm.md).
  app.add_flag("--sbatch-script", args.sbatch_script,
               "print an sbatch file that runs this launch on --nnodes nodes (srun, preemption "
               "signal, requeue on exit 75) and exit");
  app.add_flag("--sbatch-gpus", args.sbatch_gpus,
               "--sbatch-script: the workers are GPUs (--gpus-per-node = --nproc-per-node); "
               "implied by training.device = \"cuda\" or parallel.backend = \"nccl\"");
  app.add_option("--cpus-per-task", args.cpus_per_task,
                 "--sbatch-script: cores per node for the launcher and its workers (default: "
                 "one per worker)");
  app.add_option("--signal-lead", args.signal_lead_s,
                 "--sbatch-script: seconds before the time limit at which Slurm sends USR1 "
                 "(the workers checkpoint and the job requeues)")
      ->capture_default_str();
  app.add_option("--job-name", args.job_name, "--sbatch-script: the job name")
      ->capture_default_str();
  app.add_option("--sbatch-output", args.sbatch_output,
                 "--sbatch-script: sbatch --output (appended to across requeues)")
      ->capture_default_str();
  app.add_option("--job-dir", args.job_dir,
                 "--sbatch-script: directory for the job token (default: "
                 "$SLURM_SUBMIT_DIR/dnallm-job-$SLURM_JOB_ID)");
  app.add_option("--sbatch-arg", args.sbatch_args,
                 "--sbatch-script: one more #SBATCH line, e.g. --sbatch-arg=--time=04:00:00 "
                 "(repeatable)");
  // Elastic (docs/elastic.md).
  app.add_flag("--standalone", args.standalone,
               "elastic job on this node alone, with its own coordinator on a free port");
  app.add_option("--rdzv-endpoint", args.rdzv_endpoint,
                 "HOST:PORT of the coordinator (hosted by the node-rank-0 agent); makes the "
                 "job elastic");
  app.add_option("--rdzv-id", args.rdzv_id, "job id (TORCHELASTIC_RUN_ID); makes the job elastic");
  app.add_option("--rdzv-host", args.rdzv_host,
                 "address the hosted coordinator binds (default: the endpoint's host)");
  app.add_option("--node-id", args.node_id, "this agent's unique id (default: HOST:PID)");
  app.add_option("--token-file", args.token_file,
                 "file whose first line is the job token (default: $DNALLM_JOB_TOKEN)");
  app.add_option("--monitor-interval", args.monitor_interval_s,
                 "seconds between heartbeats (workers' progress) to the coordinator")
      ->capture_default_str();
  app.add_option("--rdzv-settle", args.settle_s,
                 "hosted coordinator: seconds without a new join before a round closes with at "
                 "least MIN nodes")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout", args.heartbeat_timeout_s,
                 "hosted coordinator: seconds of silence before a node is declared dead")
      ->capture_default_str();
  app.add_option("--hang-timeout", args.hang_timeout_s,
                 "hosted coordinator: seconds without step progress before a rank is a hang")
      ->capture_default_str();
  app.add_option("--join-timeout", args.join_timeout_s,
                 "hosted coordinator: seconds a round may stay below MIN nodes")
      ->capture_default_str();
  app.add_option("--max-membership-changes", args.max_membership_changes,
                 "hosted coordinator: job-wide budget of node deaths and late joins")
      ->capture_default_str();
  app.add_option("command", args.command,
                 "worker command after '--' (default: dnallm-train beside this program)");

  return run_main("dnallm-launch", app, argc, argv, [&] { return run(args, app); });
}
