#include "worker/parallel/process_group.hpp"

#include <spdlog/spdlog.h>

#include "comm/make_communicator.hpp"
#include "coordinator/store.hpp"
#include "worker/parallel/ddp.hpp"
#include "worker/parallel/fully_sharded.hpp"

namespace dnallm::parallel {
namespace {

comm::ProcessGroupOptions group_options(const Config& config, const WorkerEnv& env,
                                        const cluster::Topology& topo,
                                        const comm::CommOptions& wanted) {
  comm::ProcessGroupOptions po;
  po.backend = cfg::spelling(config.parallel.backend);
  po.rank = topo.rank;
  po.world_size = topo.world_size;
  po.master_addr = topo.master_addr;
  po.device = wanted.device;
  po.device_shared = wanted.device_shared;
  po.check_collectives = config.parallel.check_collectives;
  // Under mpirun without MASTER_ADDR, MPI bootstraps itself: no store to host or reach.
  const bool mpi = comm::resolve_backend(wanted) == "mpi";
  if (topo.source == cluster::TopologySource::kOpenMpi && mpi && !env.master_addr) {
    po.master_addr.clear();
  }
  po.master_port = topo.master_port > 0 ? topo.master_port : 29500;
  po.rank0_hosts_store = !env.external_coordinator;
  po.token = env.job_token;
  po.timeout = std::chrono::milliseconds(static_cast<int64_t>(config.parallel.timeout_s * 1000));
  po.name = process_group_name(env);
  return po;
}

comm::CommOptions wanted_options(const Config& config, const RankDevice& device) {
  comm::CommOptions wanted;
  wanted.backend = cfg::spelling(config.parallel.backend);
  wanted.device = comm_device(device.device);
  wanted.device_shared = device.shared;
  return wanted;
}

// Note [Staged collectives]: gloo/mpi with a CUDA model, or nccl with host scalars.
std::unique_ptr<comm::Communicator> staged(std::unique_ptr<comm::Communicator> comm,
                                           const WorkerEnv& env, const RankDevice& device) {
  StagingOptions staging;
  staging.stage_host_buffers = env.test.stage_host_buffers;  // tests: the staging path on CPU
  return stage_for_device(std::move(comm), device.device, staging);
}

}  // namespace

std::string process_group_name(const WorkerEnv& env) {
  return env.generation ? fmt::format("g{}", *env.generation) : std::string("default");
}

bool needs_process_group(const Config& config, const cluster::Topology& topo) {
  return topo.world_size > 1 || config.parallel.backend == cfg::Backend::kNccl;
}

comm::ProcessGroup join_process_group(const Config& config, const WorkerEnv& env,
                                      const cluster::Topology& topo, const RankDevice& device,
                                      const std::string& name) {
  comm::CommOptions wanted = wanted_options(config, device);
  comm::ProcessGroupOptions po = group_options(config, env, topo, wanted);
  if (!name.empty()) po.name = name;
  comm::ProcessGroup group;
  if (topo.world_size == 1) {  // nccl alone: needs_process_group()
    wanted.store = std::make_shared<coordinator::InMemoryStore>();
    wanted.timeout = po.timeout;
    group.store = wanted.store;
    group.comm = comm::make_communicator(wanted);
  } else {
    group = comm::connect_process_group(po);
  }
  if (config.parallel.check_collectives) {
    spdlog::warn(
        "parallel.check_collectives: every collective waits until every rank has issued "
        "it (Note [Collective check]): slow, for finding a hang's culprit");
  }
  group.comm = staged(std::move(group.comm), env, device);
  spdlog::info("rank {} of {} ({} backend on {}, topology from {})", topo.rank, topo.world_size,
               group.comm->backend(), device.device.str(), cluster::to_string(topo.source));
  return group;
}

std::unique_ptr<comm::Communicator> rejoin_process_group(const Config& config, const WorkerEnv& env,
                                                         const cluster::Topology& topo,
                                                         const RankDevice& device,
                                                         std::shared_ptr<coordinator::Store> store,
                                                         const std::string& name) {
  const comm::ProcessGroupOptions po =
      group_options(config, env, topo, wanted_options(config, device));
  return staged(comm::reconnect(po, std::move(store), name), env, device);
}

std::shared_ptr<GradientSync> make_gradient_sync(const Config& config, comm::ProcessGroup& group,
                                                 bool joining) {
  if (!group.comm) return std::make_shared<SingleProcessSync>();
  if (config.parallel.zero_stage == 3) {
    FullyShardedOptions o;
    o.precision = config.training.precision;
    o.reduce_dtype = cfg::dtype_of(config.parallel.grad_reduce_dtype);
    o.accumulate_unsharded = config.parallel.zero3_accumulate_unsharded;
    o.broadcast_on_place = !joining;
    return std::make_shared<FullyShardedSync>(*group.comm, o);
  }
  DdpOptions o = ddp_options_from_config(config.parallel);
  o.broadcast_on_attach = !joining;
  return std::make_shared<DdpGradientSync>(*group.comm, o, config.training.precision);
}

}  // namespace dnallm::parallel
