// Joining the job's process group from dnallm-train (and the gradient sync over it): the
// backend, rank, coordinator and token from the configuration, the worker's place in the job
// (cluster::Topology) and what dnallm-launch exported (Note [Worker environment] in
// core/worker_env.hpp).
#pragma once

#include <memory>

#include "cluster/topology.hpp"
#include "comm/bootstrap.hpp"
#include "core/config.hpp"
#include "core/worker_env.hpp"
#include "worker/parallel/device_group.hpp"
#include "worker/parallel/gradient_sync.hpp"

namespace dnallm::parallel {

// Whether this worker builds a communicator: world size above 1, or an explicit nccl backend
// at world size 1 (a store in memory, nothing to reach: one GPU runs the code path of many).
bool needs_process_group(const Config& config, const cluster::Topology& topo);

// Connects this rank (blocking, collective over all ranks; comm::connect_process_group) and
// wraps the communicator for the rank's device (Note [Staged collectives]). Rank 0 hosts the
// store unless the coordinator is external (env.external_coordinator); under mpirun without
// MASTER_ADDR the MPI backend bootstraps itself. An elastic generation names the communicator
// "g<N>". Call only when needs_process_group(); logs "rank R of W (...)".
// `name`, when not empty, names the communicator instead (a spare joining a re-formed group:
// Note [In-process recovery] in worker/train/in_process_recovery.hpp).
comm::ProcessGroup join_process_group(const Config& config, const WorkerEnv& env,
                                      const cluster::Topology& topo, const RankDevice& device,
                                      const std::string& name = "");

// Note [In-process recovery]: a new communicator named `name` for this rank over the group's
// `store`, wrapped for the device as join_process_group wraps its own. Blocking, collective.
std::unique_ptr<comm::Communicator> rejoin_process_group(const Config& config, const WorkerEnv& env,
                                                         const cluster::Topology& topo,
                                                         const RankDevice& device,
                                                         std::shared_ptr<coordinator::Store> store,
                                                         const std::string& name);

// The name join_process_group gives the communicator: "g<N>" in an elastic generation N.
std::string process_group_name(const WorkerEnv& env);

// DDP/ZeRO over `group` (parallel.* options); a SingleProcessSync when `group` has no
// communicator. `group` must outlive the result. `joining`: a spare joining a re-formed group
// (Note [In-process recovery]), whose parameters come from a peer: no broadcast at attach.
std::shared_ptr<GradientSync> make_gradient_sync(const Config& config, comm::ProcessGroup& group,
                                                 bool joining = false);

}  // namespace dnallm::parallel
