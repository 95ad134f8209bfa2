// dnallm-launch: the per-node agent. Without a rendezvous it runs one node (or a static
// placement): it spawns --nproc-per-node workers with the torchrun-compatible environment,
// prefixes their output with the rank, forwards SIGINT/SIGTERM/SIGUSR1, stops the group when a
// worker fails and restarts it up to --max-restarts times (docs/launch.md). With
// --standalone, --rdzv-endpoint, --rdzv-id or --nnodes MIN:MAX it is an elastic agent of a
// coordinator-driven job (launcher/elastic_agent.hpp, docs/elastic.md); the node-rank-0
// agent (and the --standalone one) hosts the coordinator. The [elastic] keys of its
// --config/--set are the defaults of its flags (Note [Elastic settings], core/config.hpp).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>

#include "checkpoint/manifest.hpp"
#include "cluster/topology.hpp"
#include "coordinator/elastic_client.hpp"
#include "coordinator/elastic_config.hpp"
#include "coordinator/elastic_service.hpp"
#include "coordinator/recovery.hpp"
#include "coordinator/store_server.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/cli.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/worker_env.hpp"
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
  // --config, --set, --metrics-file, --log-level, --print-config, and the flags that stand
  // for [elastic] keys (--max-restarts, --monitor-interval, ...; Note [Elastic settings]).
  ConfigOptions config;
  std::string nnodes;  // "" = [elastic] min_nodes:max_nodes when not 1, else Slurm, else 1
  int node_rank = 0;
  // Elastic (docs/elastic.md).
  bool standalone = false;
  std::string rdzv_endpoint;
  std::string rdzv_id;
  std::string rdzv_host;
  std::string node_id;
  std::string token_file;
  std::string master_addr;
  int master_port = 0;
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

// An elastic job: --standalone, --rdzv-endpoint, --rdzv-id, --nnodes MIN:MAX, or (without
// --nnodes) [elastic] min_nodes < max_nodes.
bool is_elastic(const Args& args, const CLI::App& app, const ElasticConfig& elastic) {
  return args.standalone || app.count("--rdzv-endpoint") > 0 || app.count("--rdzv-id") > 0 ||
         args.nnodes.find(':') != std::string::npos || elastic.min_nodes < elastic.max_nodes;
}

// This agent's node rank in an elastic job: --node-rank, else SLURM_NODEID, else -1 (unknown:
// the coordinator places it).
int elastic_node_rank(const Args& args, const CLI::App& app, const cluster::EnvMap& env) {
  if (app.count("--node-rank") > 0) return args.node_rank;
  auto slurm_node = env.find("SLURM_NODEID");
  return slurm_node != env.end() ? std::atoi(slurm_node->second.c_str()) : -1;
}

// Where the coordinator is (or will be, for the agent hosting it: port 0 = a free one).
std::pair<std::string, int> coordinator_endpoint(const Args& args, const CLI::App& app) {
  if (!args.rdzv_endpoint.empty()) return parse_endpoint(args.rdzv_endpoint, "--rdzv-endpoint");
  if (args.standalone) return {"127.0.0.1", 0};
  DNALLM_CHECK(app.count("--master-addr") > 0 && app.count("--master-port") > 0, ExitCode::kUsage,
               "an elastic job needs the coordinator's address: give --rdzv-endpoint HOST:PORT "
               "(or --master-addr and --master-port), or --standalone for one node");
  return {args.master_addr, args.master_port};
}

// The job token every node shares: --token-file, else DNALLM_JOB_TOKEN, else (--standalone
// only) the one the plan generated.
std::string elastic_job_token(const Args& args, const cluster::EnvMap& env,
                              const std::string& generated) {
  if (!args.token_file.empty()) return read_token_file(args.token_file);
  if (std::string token = job_token_of(env); !token.empty()) return token;
  DNALLM_CHECK(args.standalone, ExitCode::kUsage,
               "the nodes of a job must share a job token: set DNALLM_JOB_TOKEN (the same on "
               "every node) or pass --token-file FILE");
  return generated;  // only this node's workers need it
}

// The coordinator this agent hosts (--standalone or node rank 0). Declared in this order so
// that the server (whose io thread runs the service's handlers) is stopped and joined before
// the service is destroyed, also on an exception.
struct HostedCoordinator {
  coordinator::ElasticServiceOptions options;
  std::unique_ptr<coordinator::ElasticService> service;
  std::unique_ptr<coordinator::StoreServer> server;
};

std::unique_ptr<HostedCoordinator> host_coordinator(const Args& args, const ElasticConfig& elastic,
                                                    const std::string& endpoint_host,
                                                    int endpoint_port, const std::string& token) {
  auto hosted = std::make_unique<HostedCoordinator>();
  coordinator::StoreServerOptions so;
  so.host = !args.rdzv_host.empty() ? args.rdzv_host : endpoint_host;
  so.port = static_cast<uint16_t>(endpoint_port);
  so.token = token;
  auto& eo = hosted->options.state;
  eo = coordinator::elastic_options(elastic);
  if (args.standalone) eo.min_nodes = eo.max_nodes = 1;
  hosted->server = std::make_unique<coordinator::StoreServer>(so);
  hosted->service = std::make_unique<coordinator::ElasticService>(*hosted->server, hosted->options);
  hosted->server->start();
  hosted->service->start();
  spdlog::info("hosting the coordinator on {}:{} (nodes {}..{}, max restarts {})", so.host,
               hosted->server->port(), eo.min_nodes, eo.max_nodes, eo.max_restarts);
  return hosted;
}

// Lets the other agents learn the job's outcome (`code`), then stops the coordinator.
void stop_coordinator(HostedCoordinator& hosted, int code) {
  if (code == static_cast<int>(ExitCode::kRequeue)) {
    // Preempted: this node's workers committed and exited 75. The coordinator cannot
    // know that (it would wait a heartbeat timeout, declare this node dead and open a new
    // generation that nobody will run): stop it now. Other nodes got the same notice.
    spdlog::warn(
        "preempted: the workers stopped and exited {}; stopping the coordinator hosted here", code);
  } else if (code < 128) {  // the job ended (not this agent interrupted by a signal)
    hosted.service->wait_outcome_delivered(hosted.options.state.heartbeat_timeout);
  }
  hosted.service->stop();
  hosted.server->stop();
  hosted.service->join();
  hosted.server->join();
}

// The directory of the workers' progress files (Note [Progress file]), removed with them.
class ProgressDir {
 public:
  explicit ProgressDir(int nproc) : nproc_(nproc) {
    char tmpl[] = "/tmp/dnallm-progress-XXXXXX";
    DNALLM_CHECK(::mkdtemp(tmpl) != nullptr, ExitCode::kFailure,
                 "cannot create a progress directory under /tmp");
    path_ = tmpl;
  }
  ~ProgressDir() {
    for (int i = 0; i < nproc_; ++i) std::remove(progress_file(path_, i).c_str());
    ::rmdir(path_.c_str());
  }
  ProgressDir(const ProgressDir&) = delete;
  ProgressDir& operator=(const ProgressDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  int nproc_;
  std::string path_;
};

// Runs this node's agent against the coordinator at plan.master_addr:master_port.
int run_agent(const Args& args, const LaunchPlan& plan, const cluster::EnvMap& env,
              StopSignals& signals, const ElasticConfig& elastic) {
  coordinator::TcpStoreClientOptions co;
  co.host = plan.master_addr;
  co.port = static_cast<uint16_t>(plan.master_port);
  co.token = plan.job_token;
  co.connect_timeout = std::chrono::seconds(60);
  // A coordinator silent for a heartbeat timeout would declare this node dead: the agent
  // gives up on it after as long (the first connect, above, may wait for node 0 to start).
  co.op_timeout = std::max(coordinator::to_millis(elastic.heartbeat_timeout_s),
                           std::chrono::milliseconds(1000));

  const ProgressDir progress(plan.nproc_per_node);
  ElasticAgentOptions ao;
  ao.node.host = this_host();
  ao.node.node_id =
      !args.node_id.empty() ? args.node_id : fmt::format("{}:{}", ao.node.host, ::getpid());
  ao.node.nproc = plan.nproc_per_node;
  ao.monitor_interval = coordinator::to_millis(elastic.heartbeat_interval_s);
  ao.poll_interval = std::min(ao.monitor_interval, std::chrono::milliseconds(100));
  ao.progress_dir = progress.path();
  ao.group.grace = coordinator::to_millis(args.grace_s);

  PrefixedConsole console;
  ProcessSpawner spawner(console);
  coordinator::ElasticClient client(co);
  // Note [In-process recovery]: the agent hands a dead rank's place to a spare through the
  // coordinator's store.
  ao.spare_workers = static_cast<int>(elastic.spare_workers);
  ao.shrink = elastic.shrink;  // Note [Shrink and grow]
  if (ao.spare_workers > 0 || ao.shrink) {
    ao.store = std::make_shared<coordinator::TcpStoreClient>(co);
  }
  ElasticAgent agent(client, spawner, signals, ao,
                     [&](const coordinator::NodeAssignment& a, const std::string& reason) {
                       return make_elastic_worker_specs(plan, env, a, reason, progress.path(),
                                                        ao.spare_workers, ao.shrink);
                     });
  return agent.run();
}

// The elastic path (docs/elastic.md): optionally host the coordinator, then run the agent.
int run_elastic(const Args& args, const CLI::App& app, LaunchPlan plan, const cluster::EnvMap& env,
                const ElasticConfig& elastic) {
  const int node_rank = elastic_node_rank(args, app, env);
  auto [endpoint_host, endpoint_port] = coordinator_endpoint(args, app);
  plan.job_token = elastic_job_token(args, env, plan.job_token);

  // Before any thread exists: every thread inherits the blocked SIGINT/SIGTERM.
  SignalFdStopSignals signals;
  std::unique_ptr<HostedCoordinator> hosted;
  if (args.standalone || node_rank == 0) {
    hosted = host_coordinator(args, elastic, endpoint_host, endpoint_port, plan.job_token);
    endpoint_port = hosted->server->port();
  }
  plan.master_addr = endpoint_host;
  plan.master_port = endpoint_port;
  const int code = run_agent(args, plan, env, signals, elastic);
  if (hosted) stop_coordinator(*hosted, code);
  return code;
}

// Note [What exit 75 says]: workers exit 75 after a stop signal, normally once their
// checkpoint is committed; a worker blocked outside a step (Note [Stop while blocked] in
// worker/train/stop_watchdog.hpp) exits 75 with no new checkpoint. So the launcher reports
// what checkpoint.dir holds, not what the workers should have saved.
void report_resume_point(const std::string& dir) {
  std::vector<std::pair<int64_t, std::filesystem::path>> committed;
  try {
    committed = checkpoint::list_committed(dir);
  } catch (const std::exception&) {
  }
  if (committed.empty()) {
    spdlog::warn(
        "no committed checkpoint in {}: the workers stopped before saving one; running the job "
        "again starts from step 0",
        dir);
    return;
  }
  spdlog::warn(
      "the newest committed checkpoint is step {} in {}: running the job again resumes "
      "from it",
      committed.back().first, dir);
}

std::string absolute(const std::string& path) {
  return path.empty() ? path : std::filesystem::absolute(path).lexically_normal().string();
}

// The dnallm-launch command line that --sbatch-script runs on every node.
std::vector<std::string> sbatch_launch_argv(const Args& args, const CLI::App& app,
                                            int nproc_per_node) {
  std::vector<std::string> a = {self_exe_dir() + "/dnallm-launch", "--nproc-per-node",
                                std::to_string(nproc_per_node)};
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
  if (!args.command.empty()) {
    a.push_back("--");
    a.insert(a.end(), args.command.begin(), args.command.end());
  }
  return a;
}

// --sbatch-script: print an sbatch file that runs this launch on every node of a Slurm job
// (launcher/sbatch_script.hpp). Paths become absolute so the job finds them from any node.
int print_sbatch_script(const Args& args, const CLI::App& app, const Config& config) {
  if (is_elastic(args, app, config.elastic)) {
    fail(ExitCode::kUsage,
         "--sbatch-script writes a static Slurm job (one dnallm-launch per node, placed by "
         "srun); drop --standalone/--rdzv-*/--nnodes MIN:MAX (or elastic.min_nodes < "
         "elastic.max_nodes)");
  }
  if (app.count("--node-rank") > 0 || app.count("--master-addr") > 0) {
    fail(ExitCode::kUsage,
         "--sbatch-script: --node-rank and --master-addr come from the Slurm step on each node; "
         "drop them");
  }
  if (args.nproc == "auto") {
    fail(ExitCode::kUsage,
         "--sbatch-script needs --nproc-per-node as a number (it sets --cpus-per-task and, for "
         "GPU workers, --gpus-per-node), not 'auto'");
  }
  if (config.elastic.max_restarts != 0) {
    fail(ExitCode::kUsage,
         "--sbatch-script: --max-restarts (elastic.max_restarts) {} needs the elastic "
         "coordinator across nodes; a preempted or failed job is requeued by Slurm instead "
         "(use 0)",
         config.elastic.max_restarts);
  }
  SbatchOptions o;
  o.nodes = static_cast<int>(config.elastic.min_nodes);
  o.nproc_per_node = resolve_nproc(args.nproc, {}, 0);
  const bool cuda_config = config.training.device == cfg::Device::kCuda ||
                           config.parallel.backend == cfg::Backend::kNccl;
  o.gpus = args.sbatch_gpus || cuda_config;
  o.cpus_per_task = args.cpus_per_task;
  o.signal_lead_s = args.signal_lead_s;
  o.job_name = args.job_name;
  o.output = args.sbatch_output;
  o.job_dir = absolute(args.job_dir);
  o.chdir = std::filesystem::current_path().string();
  o.extra_sbatch = args.sbatch_args;
  o.launch_argv = sbatch_launch_argv(args, app, o.nproc_per_node);
  fmt::print("{}", make_sbatch_script(o));
  return 0;
}

// What the command line and the configuration ask this node to start.
LaunchRequest launch_request(const Args& args, const CLI::App& app, const Config& config,
                             bool elastic) {
  const ConfigOptions& co = args.config;
  LaunchRequest request;
  request.nproc_per_node = args.nproc;
  // A static node count: --nnodes, or [elastic] min_nodes when not 1; else Slurm's, else 1.
  if (!elastic && (app.count("--nnodes") > 0 || config.elastic.min_nodes != 1)) {
    request.nnodes = static_cast<int>(config.elastic.min_nodes);
  }
  if (app.count("--node-rank") > 0) request.node_rank = args.node_rank;
  if (app.count("--master-addr") > 0) request.master_addr = args.master_addr;
  if (app.count("--master-port") > 0) request.master_port = args.master_port;
  request.max_restarts = static_cast<int>(config.elastic.max_restarts);
  request.run_id = !args.rdzv_id.empty() ? args.rdzv_id : args.run_id;
  if (elastic) {
    // The coordinator places this node; resolve the rest as for one node.
    request.node_rank.reset();
    if (!request.master_addr) request.master_addr = "127.0.0.1";
    if (!request.master_port) request.master_port = 0;
  }
  request.command = args.command;
  request.config = co.config_path;
  request.sets = co.overrides;
  request.metrics_file = co.metrics_file;
  if (!co.log_level.empty()) request.log_level = co.log_level;
  return request;
}

void require_worker_command(const Args& args, const LaunchPlan& plan) {
  if (args.command.empty() && ::access(plan.command[0].c_str(), X_OK) != 0) {
    fail(ExitCode::kUsage,
         "dnallm-train was not found beside dnallm-launch ({}); build it, or give the worker "
         "command after '--'",
         plan.command[0]);
  }
}

// One node (or a static placement): start the group and restart it on failure.
int run_static(const Args& args, const LaunchPlan& plan, const cluster::EnvMap& env) {
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
  options.group.grace = coordinator::to_millis(args.grace_s);
  RestartLoop loop(spawner, signals, options, [&](int restart, const std::string& reason) {
    return make_worker_specs(plan, env, restart, reason);
  });
  int code = loop.run();
  if (code == 0) spdlog::info("all {} worker(s) finished", plan.nproc_per_node);
  return code;
}

// The configuration, read here to fail early on a bad file (exit 2 before anything starts),
// to report the backend, for the launcher's own log level and for its [elastic] settings; the
// workers read it themselves. --nnodes stands for [elastic] min_nodes and max_nodes.
Config launcher_config(Args& args, const CLI::App& app) {
  if (app.count("--nnodes") > 0) {
    const auto [lo, hi] = parse_nnodes(args.nnodes);
    const std::string origin = "--nnodes " + args.nnodes;
    args.config.key_flags.push_back({"elastic.min_nodes", std::to_string(lo), origin});
    args.config.key_flags.push_back({"elastic.max_nodes", std::to_string(hi), origin});
  }
  Config config = resolve_config(args.config);
  spdlog::set_level(log_level_of(config.logging.level));
  return config;
}

int run(Args& args, const CLI::App& app) {
  const ConfigOptions& co = args.config;
  init_logging("launch", co.log_level.empty() ? "info" : co.log_level);
  cluster::EnvMap env = cluster::current_env();
  const Config config = launcher_config(args, app);
  if (co.print_config) {
    fmt::print("{}", to_toml(config));
    return 0;
  }
  if (args.sbatch_script) return print_sbatch_script(args, app, config);
  if (args.grace_s < 0) fail(ExitCode::kUsage, "--grace-period must be >= 0");

  if (config.elastic.spare_workers > 0) {
    const std::string why = coordinator::in_process_recovery_unsupported(config);
    DNALLM_CHECK(why.empty(), ExitCode::kUsage,
                 "--spare-workers (elastic.spare_workers): no in-process recovery with {}; use "
                 "--max-restarts (a restart from the last checkpoint) instead",
                 why);
  }
  if (config.elastic.shrink) {
    const std::string why = coordinator::shrink_unsupported(config);
    DNALLM_CHECK(why.empty(), ExitCode::kUsage,
                 "elastic.shrink: the group cannot go on with fewer ranks with {}; set "
                 "elastic.shrink = false (a failure then restarts the group from the last "
                 "checkpoint)",
                 why);
  }
  const bool in_process = config.elastic.spare_workers > 0 || config.elastic.shrink;
  if (in_process && !is_elastic(args, app, config.elastic)) {
    // Note [In-process recovery]: spares wait at a coordinator; one node gets its own.
    DNALLM_CHECK(app.count("--nnodes") == 0 || args.nnodes == "1", ExitCode::kUsage,
                 "--spare-workers (elastic.spare_workers) and elastic.shrink on --nnodes {} need "
                 "the elastic coordinator: add --rdzv-endpoint HOST:PORT (docs/elastic.md)",
                 args.nnodes);
    spdlog::info("in-process recovery: running as --standalone (a coordinator on this node)");
    args.standalone = true;
  }
  const bool elastic = is_elastic(args, app, config.elastic);
  HostFacts host;
  host.gpu_devices = count_nvidia_devices();
  host.cores = static_cast<int>(std::thread::hardware_concurrency());
  host.exe_dir = self_exe_dir();
  const LaunchPlan plan =
      resolve_launch_plan(launch_request(args, app, config, elastic), env, host);
  if (args.dry_run) {
    const bool configured = !co.config_path.empty() || !co.overrides.empty();
    const std::string source = !co.config_path.empty() ? "config " + co.config_path
                               : configured            ? "--set"
                                                       : "default";
    fmt::print("{}", describe_plan(plan, cfg::spelling(config.parallel.backend), source));
    return 0;
  }
  require_worker_command(args, plan);
  const int code =
      elastic ? run_elastic(args, app, plan, env, config.elastic) : run_static(args, plan, env);
  if (code == static_cast<int>(ExitCode::kRequeue)) report_resume_point(config.checkpoint.dir);
  return code;
}

void add_placement_options(CLI::App& app, Args& args) {
  app.add_option("--nproc-per-node", args.nproc,
                 "workers on this node: a number, or 'auto' (one per GPU, else 1)")
      ->capture_default_str();
  // --config/-c, --set, --metrics-file, --log-level (passed through to dnallm-train) and
  // --print-config, as every configuration-reading binary has them.
  add_config_options(app, args.config);
  app.add_option("--nnodes", args.nnodes,
                 "nodes in the job, one dnallm-launch each: N, or MIN:MAX for an elastic job "
                 "(elastic.min_nodes, elastic.max_nodes; default: those when not 1, else from a "
                 "Slurm step, else 1)");
  app.add_option("--node-rank", args.node_rank,
                 "this node's index in [0, nnodes) (default: SLURM_NODEID, else 0)");
  app.add_option("--master-addr", args.master_addr,
                 "coordinator host exported as MASTER_ADDR (default: 127.0.0.1 on one node, "
                 "the first host of a Slurm step)");
  app.add_option("--master-port", args.master_port,
                 "coordinator port exported as MASTER_PORT (default: a free port)");
  add_key_option(app, args.config, "--max-restarts", "elastic.max_restarts",
                 "restart the worker group up to R times after a failure");
  app.add_option("--grace-period", args.grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  app.add_option("--run-id", args.run_id,
                 "TORCHELASTIC_RUN_ID (default: SLURM_JOB_ID, else 'none')");
  app.add_flag("--dry-run", args.dry_run, "print the resolved plan and exit");
  app.add_option("command", args.command,
                 "worker command after '--' (default: dnallm-train beside this program)");
}

void add_sbatch_options(CLI::App& app, Args& args) {
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
}

void add_elastic_options(CLI::App& app, Args& args) {
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
  add_key_option(app, args.config, "--spare-workers", "elastic.spare_workers",
                 "warm spare workers beside this node's ranks: a dead rank's place goes to a "
                 "spare, the survivors stay in process, no step is lost (docs/elastic.md)");
  add_key_option(app, args.config, "--monitor-interval", "elastic.heartbeat_interval_s",
                 "seconds between heartbeats (workers' progress) to the coordinator");
  add_coordinator_key_options(app, args.config, "hosted coordinator: ");
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{
      "dnallm-launch: start and watch the dnallm-train workers of this node.\n"
      "Elastic multi-node jobs (--standalone, --rdzv-endpoint, --rdzv-id, --nnodes MIN:MAX):\n"
      "see docs/elastic.md; the node-rank-0 agent hosts the coordinator.\n"
      "Flags naming a key (elastic.max_restarts, ...) override the --config file's [elastic].\n"
      "Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT, TORCHELASTIC_*, DNALLM_GENERATION and DNALLM_JOB_TOKEN. Exit codes:\n"
      "0 ok, 2 usage, 3/5 a worker's bad data / corrupt checkpoint, 4 a worker failed,\n"
      "75 preempted (SIGUSR1 forwarded; the workers checkpointed; run again to resume),\n"
      "128+N stopped by signal N. Slurm: --sbatch-script, docs/slurm.md; mpirun: docs/mpirun.md.",
      "dnallm-launch"};
  add_placement_options(app, args);
  add_sbatch_options(app, args);   // docs/slurm.md
  add_elastic_options(app, args);  // docs/elastic.md
  return run_main("dnallm-launch", app, argc, argv, [&] { return run(args, app); });
}
