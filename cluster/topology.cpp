#include "cluster/topology.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "cluster/hostlist.hpp"
#include "core/enum_names.hpp"
#include "core/error.hpp"
#include "core/parse_int.hpp"

extern char** environ;

namespace dnallm::cluster {
namespace {

const std::string* find(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

long long parse_int(const std::string& name, const std::string& value, const char* source) {
  const auto v = parse_whole_int(value);
  if (!v) fail(ExitCode::kUsage, "{} environment: {}='{}' is not an integer", source, name, value);
  return *v;
}

int get_int(const EnvMap& env, const std::string& name, const char* source) {
  const std::string* v = find(env, name);
  if (v == nullptr) {
    fail(ExitCode::kUsage, "{} environment: {} is not set", source, name);
  }
  long long x = parse_int(name, *v, source);
  if (x < -1000000000LL || x > 1000000000LL) {
    fail(ExitCode::kUsage, "{} environment: {}={} is out of range", source, name, x);
  }
  return static_cast<int>(x);
}

std::optional<int> get_opt_int(const EnvMap& env, const std::string& name, const char* source) {
  if (find(env, name) == nullptr) return std::nullopt;
  return get_int(env, name, source);
}

int ceil_div(int a, int b) { return b <= 0 ? 1 : (a + b - 1) / b; }

void apply_master_env(const EnvMap& env, Topology& t, const char* source) {
  if (const std::string* a = find(env, "MASTER_ADDR"); a != nullptr && !a->empty()) {
    t.master_addr = *a;
  }
  if (auto p = get_opt_int(env, "MASTER_PORT", source)) t.master_port = *p;
}

// What every launcher's environment must give: this process's rank and the world size.
// `src` names the launcher in errors.
Topology rank_and_world(const EnvMap& env, TopologySource source, const char* src,
                        const char* rank_var, const char* world_size_var) {
  Topology t;
  t.source = source;
  t.rank = get_int(env, rank_var, src);
  t.world_size = get_int(env, world_size_var, src);
  return t;
}

Topology from_torchrun(const EnvMap& env) {
  const char* src = "torchrun";
  Topology t = rank_and_world(env, TopologySource::kTorchrun, src, "RANK", "WORLD_SIZE");
  // Missing local values: assume a single node, as torchrun --standalone would export.
  t.local_world_size = get_opt_int(env, "LOCAL_WORLD_SIZE", src).value_or(t.world_size);
  t.local_rank =
      get_opt_int(env, "LOCAL_RANK", src).value_or(t.rank % std::max(1, t.local_world_size));
  t.node_rank =
      get_opt_int(env, "GROUP_RANK", src).value_or(t.rank / std::max(1, t.local_world_size));
  t.nnodes = get_opt_int(env, "GROUP_WORLD_SIZE", src)
                 .value_or(ceil_div(t.world_size, t.local_world_size));
  apply_master_env(env, t, src);
  return t;
}

Topology from_openmpi(const EnvMap& env) {
  const char* src = "OpenMPI";
  Topology t = rank_and_world(env, TopologySource::kOpenMpi, src, "OMPI_COMM_WORLD_RANK",
                              "OMPI_COMM_WORLD_SIZE");
  t.local_world_size = get_opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", src).value_or(t.world_size);
  t.local_rank = get_opt_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", src).value_or(t.rank);
  // OpenMPI exports no node index. Assume the default by-slot mapping (ranks fill a node
  // before the next) with equal nodes; the MPI backend bootstraps over MPI itself, so only
  // the coordinator address depends on this.
  t.node_rank = t.rank / std::max(1, t.local_world_size);
  t.nnodes = ceil_div(t.world_size, t.local_world_size);
  // mpirun tells nobody where rank 0 runs: on one node it is here, else it must be given.
  t.master_addr = t.nnodes == 1 ? "127.0.0.1" : "";
  apply_master_env(env, t, src);
  return t;
}

Topology from_slurm(const EnvMap& env) {
  const char* src = "Slurm";
  Topology t =
      rank_and_world(env, TopologySource::kSlurm, src, "SLURM_PROCID",
                     find(env, "SLURM_NTASKS") != nullptr ? "SLURM_NTASKS" : "SLURM_NPROCS");
  t.local_rank = get_opt_int(env, "SLURM_LOCALID", src).value_or(0);
  t.node_rank = get_opt_int(env, "SLURM_NODEID", src).value_or(0);

  const std::string* nodelist = find(env, "SLURM_STEP_NODELIST");
  if (nodelist == nullptr) nodelist = find(env, "SLURM_JOB_NODELIST");
  if (nodelist == nullptr) nodelist = find(env, "SLURM_NODELIST");
  if (nodelist != nullptr) t.hosts = expand_hostlist(*nodelist);

  if (auto n = get_opt_int(env, "SLURM_STEP_NUM_NODES", src)) {
    t.nnodes = *n;
  } else if (!t.hosts.empty()) {
    t.nnodes = static_cast<int>(t.hosts.size());
  } else if (auto nn = get_opt_int(env, "SLURM_NNODES", src)) {
    t.nnodes = *nn;
  } else {
    t.nnodes = 1;
  }

  const std::string* tpn = find(env, "SLURM_STEP_TASKS_PER_NODE");
  if (tpn == nullptr) tpn = find(env, "SLURM_TASKS_PER_NODE");
  std::vector<int> per_node;
  if (tpn != nullptr) per_node = expand_tasks_per_node(*tpn);
  if (t.node_rank >= 0 && static_cast<std::size_t>(t.node_rank) < per_node.size()) {
    t.local_world_size = per_node[t.node_rank];
  } else if (auto n = get_opt_int(env, "SLURM_NTASKS_PER_NODE", src)) {
    t.local_world_size = *n;
  } else {
    t.local_world_size = ceil_div(t.world_size, t.nnodes);
  }

  // Note [Slurm coordinator endpoint]: every task of a step must agree on the coordinator
  // without talking to each other first. The first host of the step's node list runs node
  // rank 0 (Slurm numbers nodes in list order), so it hosts the coordinator. The port, when
  // MASTER_PORT is not set, is 20000 + job_id % 20000: the same on every node, different for
  // jobs sharing a node (unless their ids are 20000 apart), and in [20000, 40000), below the
  // Linux ephemeral range (32768+ overlaps a little; set MASTER_PORT to choose).
  if (!t.hosts.empty()) t.master_addr = t.hosts.front();
  if (const std::string* job = find(env, "SLURM_JOB_ID")) {
    t.job_id = *job;
    t.master_port = slurm_default_port(parse_int("SLURM_JOB_ID", *job, src));
  }
  apply_master_env(env, t, src);
  return t;
}

}  // namespace

EnvMap current_env() {
  EnvMap env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

namespace {

constexpr EnumName<TopologySource> kTopologySourceNames[] = {
    {TopologySource::kCommandLine, "command line"},
    {TopologySource::kTorchrun, "torchrun"},
    {TopologySource::kOpenMpi, "openmpi"},
    {TopologySource::kSlurm, "slurm"},
    {TopologySource::kSingleProcess, "single process"}};
static_assert(lists_each_in_order<TopologySource::kSingleProcess>(kTopologySourceNames));

}  // namespace

const char* to_string(TopologySource source) {
  return name_of(kTopologySourceNames, source, "unknown");
}

int slurm_default_port(long long job_id) {
  long long m = job_id % 20000;
  if (m < 0) m += 20000;
  return static_cast<int>(20000 + m);
}

std::vector<int> expand_tasks_per_node(const std::string& spec) {
  std::vector<int> out;
  auto bad = [&](const char* what) {
    fail(ExitCode::kUsage, "Slurm environment: tasks-per-node '{}' is malformed: {}", spec, what);
  };
  if (spec.empty()) bad("empty");
  std::size_t pos = 0;
  while (pos < spec.size()) {
    std::size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(pos, end - pos);
    long long count = 0, repeat = 1;
    auto paren = item.find('(');
    try {
      std::size_t used = 0;
      count = std::stoll(item, &used);
      if (paren == std::string::npos) {
        if (used != item.size()) bad("expected N or N(xR)");
      } else {
        if (used != paren || item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 ||
            item.back() != ')') {
          bad("expected N or N(xR)");
        }
        std::string r = item.substr(paren + 2, item.size() - paren - 3);
        repeat = std::stoll(r, &used);
        if (used != r.size()) bad("expected N or N(xR)");
      }
    } catch (const std::logic_error&) {
      bad("expected N or N(xR)");
    }
    if (count < 1 || repeat < 1 || repeat > 1000000) bad("counts must be positive");
    for (long long i = 0; i < repeat; ++i) out.push_back(static_cast<int>(count));
    pos = end + 1;
    if (end == spec.size()) break;
    if (pos >= spec.size()) bad("trailing ','");
  }
  return out;
}

void validate_topology(const Topology& t) {
  const char* src = to_string(t.source);
  auto refuse = [&](const std::string& what) {
    fail(ExitCode::kUsage,
         "inconsistent rank layout from {}: {}; check the launcher flags and "
         "environment",
         src, what);
  };
  if (t.world_size < 1) refuse(fmt::format("world size {} < 1", t.world_size));
  if (t.local_world_size < 1) refuse(fmt::format("local world size {} < 1", t.local_world_size));
  if (t.nnodes < 1) refuse(fmt::format("nnodes {} < 1", t.nnodes));
  if (t.rank < 0 || t.rank >= t.world_size) {
    refuse(fmt::format("rank {} is not in [0, world size {})", t.rank, t.world_size));
  }
  if (t.local_rank < 0 || t.local_rank >= t.local_world_size) {
    refuse(fmt::format("local rank {} is not in [0, local world size {})", t.local_rank,
                       t.local_world_size));
  }
  if (t.local_world_size > t.world_size) {
    refuse(fmt::format("local world size {} > world size {}", t.local_world_size, t.world_size));
  }
  if (t.local_rank > t.rank) {
    refuse(fmt::format("local rank {} > rank {}", t.local_rank, t.rank));
  }
  if (t.node_rank < 0 || t.node_rank >= t.nnodes) {
    refuse(fmt::format("node rank {} is not in [0, nnodes {})", t.node_rank, t.nnodes));
  }
  if (t.nnodes > t.world_size) {
    refuse(fmt::format("nnodes {} > world size {}", t.nnodes, t.world_size));
  }
  if (t.master_port < 0 || t.master_port > 65535) {
    refuse(fmt::format("master port {} is not in [0, 65535]", t.master_port));
  }
}

Topology detect_topology(const EnvMap& env, const TopologyOverrides& o) {
  Topology t;
  if (find(env, "RANK") != nullptr || find(env, "WORLD_SIZE") != nullptr) {
    t = from_torchrun(env);
  } else if (find(env, "OMPI_COMM_WORLD_RANK") != nullptr) {
    t = from_openmpi(env);
  } else if (find(env, "SLURM_PROCID") != nullptr) {
    t = from_slurm(env);
  } else {
    apply_master_env(env, t, "process");
  }
  if (o.world_size) {
    // The command line describes a whole layout: fields it leaves out fall back to a
    // single-node layout rather than to a half-used environment.
    Topology c;
    c.source = TopologySource::kCommandLine;
    c.world_size = *o.world_size;
    c.rank = 0;
    c.local_world_size = c.world_size;
    c.master_addr = t.master_addr;
    c.master_port = t.master_port;
    c.hosts = t.hosts;
    c.job_id = t.job_id;
    t = c;
  }
  if (o.rank) t.rank = *o.rank;
  if (o.local_world_size) t.local_world_size = *o.local_world_size;
  if (o.local_rank) {
    t.local_rank = *o.local_rank;
  } else if (o.world_size || o.rank || o.local_world_size) {
    t.local_rank = t.rank % std::max(1, t.local_world_size);
  }
  if (o.nnodes) {
    t.nnodes = *o.nnodes;
  } else if (o.world_size || o.local_world_size) {
    t.nnodes = ceil_div(t.world_size, t.local_world_size);
  }
  if (o.node_rank) {
    t.node_rank = *o.node_rank;
  } else if (o.world_size || o.rank || o.local_world_size) {
    t.node_rank = t.rank / std::max(1, t.local_world_size);
  }
  if (o.master_addr) t.master_addr = *o.master_addr;
  if (o.master_port) t.master_port = *o.master_port;
  validate_topology(t);
  return t;
}

namespace {

// Note [mpirun placement]: `mpirun --map-by ppr:1:node dnallm-launch ...` starts one
// launcher per node; each MPI rank is a node. Checked before Slurm: mpirun inside a
// Slurm allocation starts its daemons through srun, whose step variables describe them.
NodePlacement placement_from_mpirun(const EnvMap& env) {
  const char* src = "OpenMPI";
  NodePlacement p;
  p.source = TopologySource::kOpenMpi;
  p.node_rank = get_int(env, "OMPI_COMM_WORLD_RANK", src);
  p.nnodes = get_int(env, "OMPI_COMM_WORLD_SIZE", src);
  const int local = get_opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", src).value_or(1);
  // mpirun tells nobody where rank 0 runs: on one host it is here, else MASTER_ADDR.
  p.master_addr = local == p.nnodes ? "127.0.0.1" : "";
  if (const std::string* a = find(env, "MASTER_ADDR"); a != nullptr && !a->empty()) {
    p.master_addr = *a;
  }
  if (auto port = get_opt_int(env, "MASTER_PORT", src)) {
    p.master_port = *port;
  } else if (const std::string* job = find(env, "OMPI_MCA_ess_base_jobid")) {
    // The same on every rank of this mpirun; Note [Slurm coordinator endpoint] for the range.
    p.master_port = slurm_default_port(parse_int("OMPI_MCA_ess_base_jobid", *job, src));
    p.job_id = *job;
  }
  if (p.nnodes > 1 && p.master_addr.empty()) {
    fail(ExitCode::kUsage,
         "mpirun started {} dnallm-launch on several hosts but did not say where rank 0 "
         "runs: pass its address, e.g. mpirun -x MASTER_ADDR=<host of rank 0> ...",
         p.nnodes);
  }
  return p;
}

// An srun step with one dnallm-launch per node.
NodePlacement placement_from_srun(const EnvMap& env) {
  Topology t = from_slurm(env);
  if (t.local_world_size != 1) {
    fail(ExitCode::kUsage,
         "the Slurm step runs {} tasks on this node ({}): start one dnallm-launch per node "
         "(srun --ntasks-per-node=1) and let it start the workers",
         t.local_world_size, t.hosts.empty() ? std::string("?") : t.hosts[0]);
  }
  NodePlacement p;
  p.source = TopologySource::kSlurm;
  p.node_rank = t.node_rank;
  p.nnodes = t.nnodes;
  p.master_addr = t.master_addr;
  p.master_port = t.master_port;
  p.hosts = t.hosts;
  p.job_id = t.job_id;
  return p;
}

void validate_placement(const NodePlacement& p) {
  const char* src = to_string(p.source);
  if (p.nnodes < 1) fail(ExitCode::kUsage, "nnodes {} (from {}) must be >= 1", p.nnodes, src);
  if (p.node_rank < 0 || p.node_rank >= p.nnodes) {
    fail(ExitCode::kUsage, "node rank {} (from {}) is not in [0, nnodes {})", p.node_rank, src,
         p.nnodes);
  }
  if (p.master_port < 0 || p.master_port > 65535) {
    fail(ExitCode::kUsage, "master port {} (from {}) is not in [0, 65535]", p.master_port, src);
  }
  if (p.nnodes > 1 && p.master_addr.empty()) {
    fail(ExitCode::kUsage,
         "{} nodes need the coordinator host: give --master-addr (the host of "
         "node rank 0)",
         p.nnodes);
  }
  if (p.nnodes > 1 && p.master_port == 0) {
    fail(ExitCode::kUsage,
         "{} nodes need an agreed coordinator port: give --master-port (or "
         "MASTER_PORT)",
         p.nnodes);
  }
}

}  // namespace

NodePlacement detect_node_placement(const EnvMap& env, const NodeOverrides& o) {
  NodePlacement p;
  if (o.nnodes) {
    p.source = TopologySource::kCommandLine;
    p.nnodes = *o.nnodes;
    // 127.0.0.1 reaches node 0 only from node 0 itself.
    if (p.nnodes > 1) p.master_addr.clear();
  } else if (find(env, "OMPI_COMM_WORLD_RANK") != nullptr) {
    p = placement_from_mpirun(env);  // See Note [mpirun placement].
  } else if (find(env, "SLURM_PROCID") != nullptr && find(env, "SLURM_STEP_NODELIST") != nullptr) {
    // Only an srun step: a batch script or salloc shell (no SLURM_STEP_NODELIST) runs
    // dnallm-launch on its own node, as a single node.
    p = placement_from_srun(env);
  }
  if (o.node_rank) p.node_rank = *o.node_rank;
  if (o.master_addr) p.master_addr = *o.master_addr;
  if (o.master_port) p.master_port = *o.master_port;
  validate_placement(p);
  return p;
}

}  // namespace dnallm::cluster
