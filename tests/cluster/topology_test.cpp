#include "cluster/topology.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::cluster {
namespace {

using dnallm::testing::expect_error;

struct Expect {
  int rank, local_rank, world_size, local_world_size, node_rank, nnodes;
  std::string master_addr;
  int master_port;
  TopologySource source;
};

void expect_topology(const Topology& t, const Expect& e, const std::string& what) {
  EXPECT_EQ(t.rank, e.rank) << what;
  EXPECT_EQ(t.local_rank, e.local_rank) << what;
  EXPECT_EQ(t.world_size, e.world_size) << what;
  EXPECT_EQ(t.local_world_size, e.local_world_size) << what;
  EXPECT_EQ(t.node_rank, e.node_rank) << what;
  EXPECT_EQ(t.nnodes, e.nnodes) << what;
  EXPECT_EQ(t.master_addr, e.master_addr) << what;
  EXPECT_EQ(t.master_port, e.master_port) << what;
  EXPECT_EQ(t.source, e.source) << what;
}

const EnvMap kTorchrun = {{"RANK", "5"},           {"LOCAL_RANK", "1"},
                          {"WORLD_SIZE", "8"},     {"LOCAL_WORLD_SIZE", "4"},
                          {"GROUP_RANK", "1"},     {"MASTER_ADDR", "node0"},
                          {"MASTER_PORT", "29500"}};
const EnvMap kOpenMpi = {{"OMPI_COMM_WORLD_RANK", "3"},
                         {"OMPI_COMM_WORLD_SIZE", "4"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
const EnvMap kSlurm = {{"SLURM_PROCID", "6"},
                       {"SLURM_NTASKS", "8"},
                       {"SLURM_LOCALID", "2"},
                       {"SLURM_NODEID", "1"},
                       {"SLURM_STEP_NODELIST", "gpu[07-08]"},
                       {"SLURM_JOB_NODELIST", "gpu[01-08]"},
                       {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                       {"SLURM_JOB_ID", "123456"}};

EnvMap merge(EnvMap a, const EnvMap& b) {
  for (const auto& kv : b) a[kv.first] = kv.second;
  return a;
}

TEST(Topology, SingleProcessWhenNothingIsSet) {
  expect_topology(detect_topology({}),
                  {0, 0, 1, 1, 0, 1, "127.0.0.1", 0, TopologySource::kSingleProcess}, "empty");
  expect_topology(detect_topology({{"PATH", "/bin"}, {"MASTER_PORT", "1234"}}),
                  {0, 0, 1, 1, 0, 1, "127.0.0.1", 1234, TopologySource::kSingleProcess},
                  "master port only");
}

TEST(Topology, Torchrun) {
  expect_topology(detect_topology(kTorchrun),
                  {5, 1, 8, 4, 1, 2, "node0", 29500, TopologySource::kTorchrun}, "full");
  // Only RANK and WORLD_SIZE: one node assumed.
  expect_topology(detect_topology({{"RANK", "2"}, {"WORLD_SIZE", "3"}}),
                  {2, 2, 3, 3, 0, 1, "127.0.0.1", 0, TopologySource::kTorchrun}, "minimal");
}

TEST(Topology, OpenMpi) {
  expect_topology(detect_topology(kOpenMpi), {3, 1, 4, 2, 1, 2, "", 0, TopologySource::kOpenMpi},
                  "two nodes");
  expect_topology(detect_topology({{"OMPI_COMM_WORLD_RANK", "1"},
                                   {"OMPI_COMM_WORLD_SIZE", "2"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                  {1, 1, 2, 2, 0, 1, "127.0.0.1", 0, TopologySource::kOpenMpi}, "one node");
  expect_topology(detect_topology(merge(kOpenMpi, {{"MASTER_ADDR", "h0"}, {"MASTER_PORT", "7"}})),
                  {3, 1, 4, 2, 1, 2, "h0", 7, TopologySource::kOpenMpi}, "master given");
}

TEST(Topology, SlurmUsesStepNodeListAndJobIdPort) {
  Topology t = detect_topology(kSlurm);
  expect_topology(t, {6, 2, 8, 4, 1, 2, "gpu07", 20000 + 123456 % 20000, TopologySource::kSlurm},
                  "step");
  EXPECT_EQ(t.hosts, (std::vector<std::string>{"gpu07", "gpu08"}));
  EXPECT_EQ(t.job_id, "123456");
  EXPECT_EQ(slurm_default_port(123456), 23456);
  EXPECT_EQ(slurm_default_port(20000), 20000);
  EXPECT_EQ(slurm_default_port(39999), 39999);
}

TEST(Topology, SlurmFallsBackToJobNodeListAndUnevenTasks) {
  EnvMap env = {{"SLURM_PROCID", "4"},
                {"SLURM_NTASKS", "5"},
                {"SLURM_LOCALID", "0"},
                {"SLURM_NODEID", "2"},
                {"SLURM_JOB_NODELIST", "c[1-3]"},
                {"SLURM_TASKS_PER_NODE", "2(x2),1"},
                {"SLURM_JOB_ID", "7"},
                {"MASTER_PORT", "4000"}};
  Topology t = detect_topology(env);
  expect_topology(t, {4, 0, 5, 1, 2, 3, "c1", 4000, TopologySource::kSlurm}, "uneven");
}

TEST(Topology, PrecedenceTorchrunOverOpenMpiOverSlurm) {
  EXPECT_EQ(detect_topology(merge(merge(kSlurm, kOpenMpi), kTorchrun)).source,
            TopologySource::kTorchrun);
  EXPECT_EQ(detect_topology(merge(kSlurm, kOpenMpi)).source, TopologySource::kOpenMpi);
  EXPECT_EQ(detect_topology(kSlurm).source, TopologySource::kSlurm);
}

TEST(Topology, CommandLineOverridesFields) {
  TopologyOverrides o;
  o.master_addr = "10.0.0.1";
  o.master_port = 30000;
  Topology t = detect_topology(kTorchrun, o);
  expect_topology(t, {5, 1, 8, 4, 1, 2, "10.0.0.1", 30000, TopologySource::kTorchrun}, "addr");

  TopologyOverrides full;
  full.world_size = 4;
  full.rank = 3;
  full.local_world_size = 2;
  expect_topology(detect_topology(kSlurm, full),
                  {3, 1, 4, 2, 1, 2, "gpu07", 23456, TopologySource::kCommandLine}, "layout");
}

TEST(Topology, RefusesInconsistentLayoutsNamingThem) {
  struct Bad {
    EnvMap env;
    TopologyOverrides o;
    const char* needle;
  };
  TopologyOverrides big_rank;
  big_rank.rank = 8;
  TopologyOverrides big_port;
  big_port.master_port = 70000;
  const std::vector<Bad> cases = {
      {{{"RANK", "4"}, {"WORLD_SIZE", "4"}}, {}, "rank 4 is not in [0, world size 4)"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {}, "world size 0 < 1"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       {},
       "local rank 2 is not in [0, local world size 2)"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "4"}},
       {},
       "local world size 4 > world size 2"},
      {{{"RANK", "1"},
        {"WORLD_SIZE", "4"},
        {"LOCAL_RANK", "1"},
        {"LOCAL_WORLD_SIZE", "2"},
        {"GROUP_RANK", "2"}},
       {},
       "node rank 2 is not in [0, nnodes 2)"},
      {{{"RANK", "x"}, {"WORLD_SIZE", "4"}}, {}, "RANK='x' is not an integer"},
      {{{"RANK", "1"}}, {}, "WORLD_SIZE is not set"},
      {{{"OMPI_COMM_WORLD_RANK", "1"}}, {}, "OMPI_COMM_WORLD_SIZE is not set"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[1-"}},
       {},
       "malformed hostlist"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "2(y2)"}},
       {},
       "tasks-per-node '2(y2)'"},
      {kTorchrun, big_rank, "rank 8 is not in [0, world size 8)"},
      {kTorchrun, big_port, "master port 70000"},
  };
  for (const auto& c : cases) {
    try {
      detect_topology(c.env, c.o);
      ADD_FAILURE() << "accepted, expected " << c.needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos)
          << "expected '" << c.needle << "' in: " << e.what();
    }
  }
}

TEST(Topology, TasksPerNode) {
  EXPECT_EQ(expand_tasks_per_node("4"), (std::vector<int>{4}));
  EXPECT_EQ(expand_tasks_per_node("4(x2),3"), (std::vector<int>{4, 4, 3}));
  EXPECT_EQ(expand_tasks_per_node("1,2(x1)"), (std::vector<int>{1, 2}));
  for (const char* bad : {"", "x", "4(x)", "4(x2", "0", "4,", "2(x0)"}) {
    EXPECT_THROW(expand_tasks_per_node(bad), Error) << bad;
  }
}

TEST(Topology, CurrentEnvReadsProcessEnvironment) {
  ::setenv("DNALLM_TOPOLOGY_TEST", "a=b", 1);
  EnvMap env = current_env();
  EXPECT_EQ(env.at("DNALLM_TOPOLOGY_TEST"), "a=b");
}

}  // namespace
}  // namespace dnallm::cluster

namespace dnallm::cluster {
namespace {

TEST(NodePlacement, SingleNodeByDefault) {
  NodePlacement p = detect_node_placement({{"RANK", "3"}, {"WORLD_SIZE", "4"}});
  EXPECT_EQ(p.source, TopologySource::kSingleProcess);
  EXPECT_EQ(p.nnodes, 1);
  EXPECT_EQ(p.node_rank, 0);
  EXPECT_EQ(p.master_addr, "127.0.0.1");
  EXPECT_EQ(p.master_port, 0);
}

TEST(NodePlacement, SlurmStepWithOneTaskPerNode) {
  EnvMap env = {{"SLURM_PROCID", "2"},
                {"SLURM_NTASKS", "3"},
                {"SLURM_LOCALID", "0"},
                {"SLURM_NODEID", "2"},
                {"SLURM_STEP_NODELIST", "n[4-6]"},
                {"SLURM_STEP_TASKS_PER_NODE", "1(x3)"},
                {"SLURM_JOB_ID", "41"}};
  NodePlacement p = detect_node_placement(env);
  EXPECT_EQ(p.source, TopologySource::kSlurm);
  EXPECT_EQ(p.node_rank, 2);
  EXPECT_EQ(p.nnodes, 3);
  EXPECT_EQ(p.master_addr, "n4");
  EXPECT_EQ(p.master_port, 20041);
  EXPECT_EQ(p.hosts, (std::vector<std::string>{"n4", "n5", "n6"}));

  NodeOverrides o;
  o.master_port = 3000;
  EXPECT_EQ(detect_node_placement(env, o).master_port, 3000);
  env["MASTER_ADDR"] = "n9";
  EXPECT_EQ(detect_node_placement(env).master_addr, "n9");
}

// Note [mpirun placement]: mpirun --map-by ppr:1:node dnallm-launch: each MPI rank a node.
TEST(NodePlacement, MpirunOneLauncherPerNode) {
  EnvMap env = {{"OMPI_COMM_WORLD_RANK", "1"},
                {"OMPI_COMM_WORLD_SIZE", "3"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                {"OMPI_MCA_ess_base_jobid", "1399521281"},
                {"MASTER_ADDR", "head"}};
  NodePlacement p = detect_node_placement(env);
  EXPECT_EQ(p.source, TopologySource::kOpenMpi);
  EXPECT_EQ(p.node_rank, 1);
  EXPECT_EQ(p.nnodes, 3);
  EXPECT_EQ(p.master_addr, "head");
  EXPECT_EQ(p.master_port, 20000 + 1399521281 % 20000);
  env["MASTER_PORT"] = "29999";
  EXPECT_EQ(detect_node_placement(env).master_port, 29999);
}

TEST(NodePlacement, MpirunOnOneHostUsesLoopback) {
  NodePlacement p = detect_node_placement({{"OMPI_COMM_WORLD_RANK", "0"},
                                           {"OMPI_COMM_WORLD_SIZE", "2"},
                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                           {"OMPI_MCA_ess_base_jobid", "7"}});
  EXPECT_EQ(p.nnodes, 2);
  EXPECT_EQ(p.master_addr, "127.0.0.1");
  EXPECT_EQ(p.master_port, 20007);
}

TEST(NodePlacement, MpirunAcrossHostsNeedsMasterAddr) {
  EnvMap env = {{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "2"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                {"OMPI_MCA_ess_base_jobid", "7"}};
  expect_error([&] { detect_node_placement(env); }, ExitCode::kUsage, {"mpirun -x MASTER_ADDR="});
}

TEST(NodePlacement, MpirunWinsOverTheSlurmStepOfItsDaemons) {
  NodePlacement p = detect_node_placement({{"OMPI_COMM_WORLD_RANK", "1"},
                                           {"OMPI_COMM_WORLD_SIZE", "2"},
                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                                           {"OMPI_MCA_ess_base_jobid", "7"},
                                           {"MASTER_ADDR", "n1"},
                                           {"SLURM_PROCID", "0"},
                                           {"SLURM_NTASKS", "2"},
                                           {"SLURM_NODEID", "0"},
                                           {"SLURM_STEP_NODELIST", "n[1-2]"},
                                           {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
                                           {"SLURM_JOB_ID", "5"}});
  EXPECT_EQ(p.source, TopologySource::kOpenMpi);
  EXPECT_EQ(p.node_rank, 1);
}

TEST(NodePlacement, BatchScriptIsASingleNode) {
  // sbatch's environment has the job's layout but no step node list.
  NodePlacement p = detect_node_placement({{"SLURM_PROCID", "0"},
                                           {"SLURM_NTASKS", "8"},
                                           {"SLURM_NODEID", "0"},
                                           {"SLURM_JOB_NODELIST", "n[1-2]"},
                                           {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                           {"SLURM_JOB_ID", "5"}});
  EXPECT_EQ(p.source, TopologySource::kSingleProcess);
  EXPECT_EQ(p.nnodes, 1);
}

TEST(NodePlacement, CommandLineWins) {
  NodeOverrides o;
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_addr = "head";
  o.master_port = 29400;
  NodePlacement p = detect_node_placement({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}, o);
  EXPECT_EQ(p.source, TopologySource::kCommandLine);
  EXPECT_EQ(p.nnodes, 2);
  EXPECT_EQ(p.node_rank, 1);
  EXPECT_EQ(p.master_addr, "head");
  EXPECT_EQ(p.master_port, 29400);
}

TEST(NodePlacement, RefusesWhatCannotWork) {
  auto with = [](std::optional<int> nnodes, std::optional<int> node_rank,
                 std::optional<std::string> addr, std::optional<int> port) {
    NodeOverrides o;
    o.nnodes = nnodes;
    o.node_rank = node_rank;
    o.master_addr = addr;
    o.master_port = port;
    return o;
  };
  struct Bad {
    EnvMap env;
    NodeOverrides o;
    const char* needle;
  };
  const std::vector<Bad> cases = {
      {{}, with(2, 2, "h", 1), "node rank 2 (from command line) is not in [0, nnodes 2)"},
      {{}, with(0, {}, {}, {}), "nnodes 0"},
      {{}, with(2, 0, {}, 1), "give --master-addr"},  // 127.0.0.1 is no default for 2 nodes
      {{}, with(2, 0, "", 1), "give --master-addr"},
      {{}, with(2, 1, "h", {}), "give --master-port"},
      {{}, with({}, 1, {}, {}), "node rank 1 (from single process)"},
      {{{"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "4"},
        {"SLURM_NODEID", "0"},
        {"SLURM_LOCALID", "1"},
        {"SLURM_STEP_NODELIST", "a[1-2]"},
        {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}},
       {},
       "start one dnallm-launch per node"},
  };
  for (const auto& c : cases) {
    try {
      detect_node_placement(c.env, c.o);
      ADD_FAILURE() << "accepted, expected " << c.needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos)
          << "expected '" << c.needle << "' in: " << e.what();
    }
  }
}

}  // namespace
}  // namespace dnallm::cluster
