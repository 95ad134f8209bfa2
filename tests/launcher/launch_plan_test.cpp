#include "launcher/launch_plan.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::launcher {
namespace {

using dnallm::testing::expect_error;

std::map<std::string, std::string> env_of(const WorkerSpec& spec) {
  std::map<std::string, std::string> m;
  for (const auto& kv : spec.env) {
    auto eq = kv.find('=');
    EXPECT_NE(eq, std::string::npos) << kv;
    EXPECT_TRUE(m.emplace(kv.substr(0, eq), kv.substr(eq + 1)).second) << "duplicate " << kv;
  }
  return m;
}

TEST(ResolveNproc, Table) {
  struct Case {
    std::string spec;
    cluster::EnvMap env;
    int gpus;
    int expected;
  };
  const std::vector<Case> cases = {
      {"4", {}, 0, 4},
      {"1", {}, 8, 1},
      {"auto", {}, 0, 1},
      {"auto", {}, 4, 4},
      {"auto", {{"CUDA_VISIBLE_DEVICES", "0,1,3"}}, 8, 3},
      {"auto", {{"CUDA_VISIBLE_DEVICES", "2"}}, 8, 1},
      {"auto", {{"CUDA_VISIBLE_DEVICES", ""}}, 8, 1},
      {"auto", {{"CUDA_VISIBLE_DEVICES", "-1"}}, 8, 1},
      {"auto", {{"CUDA_VISIBLE_DEVICES", "0,-1,2"}}, 8, 1},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(resolve_nproc(c.spec, c.env, c.gpus), c.expected) << c.spec << " gpus " << c.gpus;
  }
  for (const char* bad : {"0", "-2", "x", "", "2x", "auto2", "99999"}) {
    expect_error([&] { resolve_nproc(bad, {}, 0); }, ExitCode::kUsage, {"--nproc-per-node"});
  }
}

TEST(ResolveNproc, CountsNvidiaDeviceNodesOnly) {
  char tmpl[] = "/tmp/dnallm-dev-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  for (const char* name : {"nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm", "null"}) {
    int fd = ::open((dir + "/" + name).c_str(), O_CREAT | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  EXPECT_EQ(count_nvidia_devices(dir), 3);
  EXPECT_EQ(count_nvidia_devices(dir + "/missing"), 0);
  for (const char* name : {"nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm", "null"}) {
    ::unlink((dir + "/" + name).c_str());
  }
  ::rmdir(dir.c_str());
}

TEST(LaunchPlan, OmpThreadsSplitCores) {
  EXPECT_EQ(default_omp_threads(16, 4), 4);
  EXPECT_EQ(default_omp_threads(16, 3), 5);
  EXPECT_EQ(default_omp_threads(2, 4), 1);
  EXPECT_EQ(default_omp_threads(0, 1), 1);
}

TEST(LaunchPlan, WorkersOfALauncherUnderMpirunDoNotSeeItsMpiIdentity) {
  LaunchPlan plan;
  plan.nproc_per_node = 2;
  plan.command = {"/bin/true"};
  cluster::EnvMap base = {{"PATH", "/bin"},
                          {"OMPI_COMM_WORLD_RANK", "1"},
                          {"OMPI_COMM_WORLD_SIZE", "2"},
                          {"OMPI_MCA_ess_base_jobid", "7"},
                          {"PMIX_RANK", "1"},
                          {"OMP_NUM_THREADS", "1"}};
  for (const auto& spec : make_worker_specs(plan, base, 0)) {
    auto env = env_of(spec);
    EXPECT_EQ(env.count("OMPI_COMM_WORLD_RANK"), 0u);
    EXPECT_EQ(env.count("OMPI_COMM_WORLD_SIZE"), 0u);
    EXPECT_EQ(env.count("OMPI_MCA_ess_base_jobid"), 0u);
    EXPECT_EQ(env.count("PMIX_RANK"), 0u);
    EXPECT_EQ(env.at("OMP_NUM_THREADS"), "1");  // not an MPI variable
    EXPECT_EQ(env.at("PATH"), "/bin");
  }
}

// Note [Worker environment]: what the launcher exports is what a worker parses back.
TEST(LaunchPlan, SpawnedEnvironmentParsesBackToWhatTheLauncherSet) {
  LaunchPlan plan;
  plan.nproc_per_node = 2;
  plan.nnodes = 2;
  plan.node_rank = 1;
  plan.master_addr = "node-0";
  plan.master_port = 29400;
  plan.run_id = "r";
  plan.job_token = "tok";
  plan.max_restarts = 3;
  plan.omp_num_threads = 4;
  const cluster::EnvMap base = {{"PATH", "/bin"}, {"DNALLM_TEST_STEP_DELAY_MS", "50"}};
  const auto specs = make_worker_specs(plan, base, 1, "rank 0 exited with code 7");
  ASSERT_EQ(specs.size(), 2u);
  for (int local = 0; local < 2; ++local) {
    WorkerEnv expected = worker_env(plan, local, 1, "rank 0 exited with code 7");
    expected.test.step_delay = std::chrono::milliseconds(50);  // inherited from the launcher
    const WorkerEnv parsed = WorkerEnv::from_environment(env_of(specs[local]));
    EXPECT_TRUE(parsed == expected) << "local rank " << local;
    EXPECT_EQ(parsed.rank, 2 + local);
    EXPECT_EQ(parsed.world_size, 4);
    EXPECT_EQ(parsed.generation, 1);
    EXPECT_EQ(parsed.restart_reason, "rank 0 exited with code 7");
    EXPECT_EQ(specs[local].rank, 2 + local);
  }
  // `adjust` changes what is exported.
  const auto adjusted = make_worker_specs(plan, base, 0, "", [](WorkerEnv& w) {
    w.external_coordinator = true;
    w.progress_file = "/p/" + std::to_string(*w.local_rank);
  });
  const WorkerEnv w = WorkerEnv::from_environment(env_of(adjusted[1]));
  EXPECT_TRUE(w.external_coordinator);
  EXPECT_EQ(w.progress_file, "/p/1");
  EXPECT_EQ(w.restart_reason, "");
}

TEST(LaunchPlan, WorkerEnvironment) {
  LaunchPlan plan;
  plan.nproc_per_node = 3;
  plan.master_addr = "10.1.2.3";
  plan.master_port = 29511;
  plan.command = {"/bin/true", "x"};
  plan.run_id = "job7";
  plan.job_token = "tok";
  plan.max_restarts = 4;
  plan.omp_num_threads = 5;
  cluster::EnvMap base = {{"PATH", "/bin"}, {"RANK", "99"}, {"DNALLM_JOB_TOKEN", "old"}};
  auto specs = make_worker_specs(plan, base, 2);
  ASSERT_EQ(specs.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(specs[i].rank, i);
    EXPECT_EQ(specs[i].local_rank, i);
    EXPECT_EQ(specs[i].argv, plan.command);
    auto env = env_of(specs[i]);
    EXPECT_EQ(env.at("PATH"), "/bin");
    EXPECT_EQ(env.at("RANK"), std::to_string(i));
    EXPECT_EQ(env.at("LOCAL_RANK"), std::to_string(i));
    EXPECT_EQ(env.at("WORLD_SIZE"), "3");
    EXPECT_EQ(env.at("LOCAL_WORLD_SIZE"), "3");
    EXPECT_EQ(env.at("GROUP_RANK"), "0");
    EXPECT_EQ(env.at("MASTER_ADDR"), "10.1.2.3");
    EXPECT_EQ(env.at("MASTER_PORT"), "29511");
    EXPECT_EQ(env.at("TORCHELASTIC_RESTART_COUNT"), "2");
    EXPECT_EQ(env.at("TORCHELASTIC_MAX_RESTARTS"), "4");
    EXPECT_EQ(env.at("TORCHELASTIC_RUN_ID"), "job7");
    EXPECT_EQ(env.at("DNALLM_GENERATION"), "2");
    EXPECT_EQ(env.at("DNALLM_JOB_TOKEN"), "tok");
    EXPECT_EQ(env.at("OMP_NUM_THREADS"), "5");
  }
  EXPECT_EQ(env_of(specs[0]).count("DNALLM_RESTART_REASON"), 0u);  // no reason given
  auto restarted = make_worker_specs(plan, base, 1, "rank 2 exited with code 9");
  EXPECT_EQ(env_of(restarted[0]).at("DNALLM_RESTART_REASON"), "rank 2 exited with code 9");
  base["DNALLM_RESTART_REASON"] = "stale";
  EXPECT_EQ(env_of(make_worker_specs(plan, base, 0)[0]).count("DNALLM_RESTART_REASON"), 0u);
  base.erase("DNALLM_RESTART_REASON");
  // A user's OMP_NUM_THREADS wins.
  base["OMP_NUM_THREADS"] = "7";
  EXPECT_EQ(env_of(make_worker_specs(plan, base, 0)[1]).at("OMP_NUM_THREADS"), "7");
}

TEST(LaunchPlan, RanksFollowNodeRank) {
  LaunchPlan plan;
  plan.nproc_per_node = 2;
  plan.nnodes = 3;
  plan.node_rank = 2;
  plan.command = {"w"};
  auto specs = make_worker_specs(plan, {}, 0);
  EXPECT_EQ(specs[0].rank, 4);
  EXPECT_EQ(specs[1].rank, 5);
  EXPECT_EQ(env_of(specs[1]).at("WORLD_SIZE"), "6");
  EXPECT_EQ(env_of(specs[1]).at("GROUP_RANK"), "2");
}

TEST(LaunchPlan, JobTokensAreRandomHex) {
  std::string a = generate_job_token();
  std::string b = generate_job_token();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

TEST(LaunchPlan, PicksABindablePort) {
  int port = pick_free_port();
  ASSERT_GT(port, 0);
  ASSERT_LE(port, 65535);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
}

TEST(LaunchPlan, DescribesDryRun) {
  LaunchPlan plan;
  plan.nproc_per_node = 4;
  plan.master_port = 1234;
  plan.master_port_source = "picked free";
  plan.job_token_source = "generated";
  plan.command = {"/bin/sh", "-c", "echo $RANK"};
  std::string text = describe_plan(plan, "gloo", "config run.toml");
  for (const char* needle :
       {"nodes          : 1", "ranks per node : 4", "world size     : 4", "127.0.0.1:1234",
        "backend        : gloo (config run.toml)", "job token      : generated",
        "command        : /bin/sh -c 'echo $RANK'"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << needle << " in\n" << text;
  }
}

HostFacts fake_host() {
  HostFacts h;
  h.gpu_devices = 2;
  h.cores = 16;
  h.exe_dir = "/opt/dnallm/bin";
  h.pick_port = [] { return 45678; };
  h.make_token = [] { return std::string("fresh-token"); };
  return h;
}

TEST(ResolveLaunchPlan, SingleNodeDefaults) {
  LaunchRequest req;
  req.nproc_per_node = "auto";
  req.config = "run.toml";
  req.sets = {"training.max_steps=3", "training.lr=0.1"};
  req.metrics_file = "m.jsonl";
  LaunchPlan p = resolve_launch_plan(req, {}, fake_host());
  EXPECT_EQ(p.nproc_per_node, 2);
  EXPECT_EQ(p.nnodes, 1);
  EXPECT_EQ(p.node_rank, 0);
  EXPECT_EQ(p.master_addr, "127.0.0.1");
  EXPECT_EQ(p.master_port, 45678);
  EXPECT_EQ(p.master_port_source, "picked free");
  EXPECT_EQ(p.run_id, "none");
  EXPECT_EQ(p.job_token, "fresh-token");
  EXPECT_EQ(p.job_token_source, "generated");
  EXPECT_EQ(p.omp_num_threads, 8);
  EXPECT_EQ(p.command,
            (std::vector<std::string>{"/opt/dnallm/bin/dnallm-train", "--config", "run.toml",
                                      "--set", "training.max_steps=3", "--set", "training.lr=0.1",
                                      "--metrics-file", "m.jsonl"}));
}

TEST(ResolveLaunchPlan, ExplicitValuesAndEnvironment) {
  LaunchRequest req;
  req.nproc_per_node = "3";
  req.master_addr = "10.0.0.5";
  req.master_port = 29500;
  req.max_restarts = 2;
  req.log_level = "debug";
  req.command = {"python3", "train.py"};
  cluster::EnvMap env = {
      {"DNALLM_JOB_TOKEN", "given"}, {"OMP_NUM_THREADS", "4"}, {"SLURM_JOB_ID", "77"}};
  LaunchPlan p = resolve_launch_plan(req, env, fake_host());
  EXPECT_EQ(p.nproc_per_node, 3);
  EXPECT_EQ(p.master_addr, "10.0.0.5");
  EXPECT_EQ(p.master_port, 29500);
  EXPECT_EQ(p.master_port_source, "from --master-port");
  EXPECT_EQ(p.max_restarts, 2);
  EXPECT_EQ(p.run_id, "77");  // a batch script is not a step: still one node
  EXPECT_EQ(p.nnodes, 1);
  EXPECT_EQ(p.job_token, "given");
  EXPECT_EQ(p.job_token_source, "from DNALLM_JOB_TOKEN");
  EXPECT_EQ(p.omp_num_threads, 0);  // the user's value is kept
  EXPECT_EQ(p.command, (std::vector<std::string>{"python3", "train.py"}));  // no pass-through
}

TEST(ResolveLaunchPlan, SlurmStepGivesPlacementAndPort) {
  LaunchRequest req;
  req.nproc_per_node = "4";
  req.log_level = "warn";
  cluster::EnvMap env = {{"SLURM_PROCID", "1"},
                         {"SLURM_NTASKS", "2"},
                         {"SLURM_NODEID", "1"},
                         {"SLURM_LOCALID", "0"},
                         {"SLURM_STEP_NODELIST", "g[1-2]"},
                         {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
                         {"SLURM_JOB_ID", "20005"}};
  LaunchPlan p = resolve_launch_plan(req, env, fake_host());
  EXPECT_EQ(p.nnodes, 2);
  EXPECT_EQ(p.node_rank, 1);
  EXPECT_EQ(p.world_size(), 8);
  EXPECT_EQ(p.master_addr, "g1");
  EXPECT_EQ(p.master_port, 20005);
  EXPECT_EQ(p.master_port_source, "from the Slurm job id");
  EXPECT_EQ(p.placement_source, "slurm");
  EXPECT_EQ(p.command.back(), "warn");
  auto specs = make_worker_specs(p, env, 0);
  EXPECT_EQ(specs[0].rank, 4);
  EXPECT_EQ(specs[3].rank, 7);
}

TEST(ResolveLaunchPlan, RefusesBadRequests) {
  auto refused = [](LaunchRequest req, const char* needle) {
    expect_error([&] { resolve_launch_plan(req, {}, fake_host()); }, ExitCode::kUsage, {needle});
  };
  LaunchRequest r;
  r.master_port = 70000;
  refused(r, "--master-port 70000");
  r = {};
  r.max_restarts = -1;
  refused(r, "--max-restarts -1");
  r = {};
  r.nnodes = 2;
  r.master_addr = "h";
  r.master_port = 1;
  r.max_restarts = 1;
  refused(r, "needs the elastic coordinator");
  r = {};
  r.nproc_per_node = "none";
  refused(r, "--nproc-per-node 'none'");
}

TEST(LaunchPlan, ResolvesExecutables) {
  EXPECT_EQ(resolve_executable("sh", "/nonexistent:/bin"), "/bin/sh");
  EXPECT_EQ(resolve_executable("/bin/sh", ""), "/bin/sh");
  for (const char* bad : {"no-such-dnallm-command", "/nonexistent/x", "/tmp", ""}) {
    expect_error([&] { resolve_executable(bad, "/bin:/usr/bin"); }, ExitCode::kUsage);
  }
}

}  // namespace
}  // namespace dnallm::launcher
