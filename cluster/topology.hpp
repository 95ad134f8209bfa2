// "Where am I": the rank layout of this process, detected from the environment.
//
// Precedence, first match wins for the source; explicit command-line values then override
// single fields of whatever the source gave:
//   1. command line   (TopologyOverrides; world_size given = the command line is the source)
//   2. torchrun       RANK and WORLD_SIZE set (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
//                     GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
//   3. OpenMPI        OMPI_COMM_WORLD_RANK set (_SIZE, _LOCAL_RANK, _LOCAL_SIZE)
//   4. Slurm step     SLURM_PROCID set (SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
//                     SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, SLURM_STEP_TASKS_PER_NODE,
//                     SLURM_JOB_ID)
//   5. else a single process (rank 0 of 1).
// MASTER_ADDR / MASTER_PORT, when set, are honoured under every source.
//
// See Note [Slurm coordinator endpoint] in topology.cpp for how Slurm picks the address and
// port. Everything here is pure: the environment is passed in as a map (current_env() reads
// the real one), so tests need no setenv().
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dnallm::cluster {

using EnvMap = std::map<std::string, std::string>;

// A snapshot of this process's environment (environ).
EnvMap current_env();

enum class TopologySource { kCommandLine, kTorchrun, kOpenMpi, kSlurm, kSingleProcess };

// "command line", "torchrun", "openmpi", "slurm", "single process".
const char* to_string(TopologySource source);

struct Topology {
  int rank = 0;                           // global rank, [0, world_size)
  int local_rank = 0;                     // rank on this node, [0, local_world_size)
  int world_size = 1;                     // processes in the job
  int local_world_size = 1;               // processes on this node
  int node_rank = 0;                      // index of this node, [0, nnodes) (torchrun's GROUP_RANK)
  int nnodes = 1;                         // nodes in the job
  std::string master_addr = "127.0.0.1";  // coordinator host; "" = unknown (MPI bootstrap)
  int master_port = 0;                    // coordinator port; 0 = not given (a launcher picks one)
  TopologySource source = TopologySource::kSingleProcess;
  std::vector<std::string> hosts;  // node host names when the source lists them (Slurm)
  std::string job_id;              // scheduler job id when there is one
};

// Command-line values; each one given replaces the detected field.
struct TopologyOverrides {
  std::optional<int> rank;
  std::optional<int> local_rank;
  std::optional<int> world_size;
  std::optional<int> local_world_size;
  std::optional<int> node_rank;
  std::optional<int> nnodes;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
};

// Detects the topology from `env` (see the precedence above) and applies `overrides`.
// Throws Error(kUsage) naming the variables on a non-integer value or an inconsistent
// layout (validate_topology).
Topology detect_topology(const EnvMap& env, const TopologyOverrides& overrides = {});

// Refuses rank >= world_size, local_rank >= local_world_size, local_world_size >
// world_size, node_rank >= nnodes, nnodes > world_size, ports outside [0, 65535], sizes
// < 1. The message names the source (torchrun, slurm, ...).
void validate_topology(const Topology& topology);

// Where a per-node agent (dnallm-launch, one per node) sits among the nodes of the job.
struct NodePlacement {
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr = "127.0.0.1";  // where node rank 0 runs (hosts the coordinator)
  int master_port = 0;                    // 0: not given (one node: the launcher picks one)
  TopologySource source = TopologySource::kSingleProcess;
  std::vector<std::string> hosts;  // node host names when known (Slurm)
  std::string job_id;
};

struct NodeOverrides {
  std::optional<int> nnodes;
  std::optional<int> node_rank;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
};

// The agent's placement, first match wins:
//   1. command line: nnodes given (node_rank defaults to 0);
//   2. mpirun (OMPI_COMM_WORLD_RANK set; checked before Slurm), as
//      `mpirun --map-by ppr:1:node dnallm-launch ...` starts it (Note [mpirun placement]):
//      node rank OMPI_COMM_WORLD_RANK, nnodes OMPI_COMM_WORLD_SIZE; the coordinator is
//      MASTER_ADDR (required across hosts: `mpirun -x MASTER_ADDR=...`; 127.0.0.1 when every
//      rank is on this host) and MASTER_PORT, else 20000 + OMPI_MCA_ess_base_jobid % 20000;
//   3. a Slurm step (SLURM_PROCID and SLURM_STEP_NODELIST set; a batch script or an salloc
//      shell is not a step and counts as a single node) with one task per node, as
//      `srun --ntasks-per-node=1 dnallm-launch ...` starts it: node rank SLURM_NODEID, the
//      step's node list, Note [Slurm coordinator endpoint]; a step with several tasks on
//      this node is refused (each would start a full set of workers);
//   4. a single node.
// Command-line node_rank / master_addr / master_port then replace the detected ones, and
// MASTER_ADDR / MASTER_PORT from the environment are honoured under Slurm. With more than
// one node, master_addr and master_port must be known (each node cannot pick a free port
// on its own). Throws Error(kUsage) naming the flag or variable.
NodePlacement detect_node_placement(const EnvMap& env, const NodeOverrides& overrides = {});

// Slurm's tasks-per-node syntax, "4(x2),3" -> {4, 4, 3}. Throws Error(kUsage).
std::vector<int> expand_tasks_per_node(const std::string& spec);

// Note [Slurm coordinator endpoint]: the port derived from a Slurm job id.
int slurm_default_port(long long job_id);

}  // namespace dnallm::cluster
