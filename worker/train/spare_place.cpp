// Note [In-process recovery] steps 1 and 4 for a spare: its wait, the place it takes, the group
// it joins (worker/train/in_process_recovery.hpp).
#include <unistd.h>

#include <spdlog/spdlog.h>

#include "coordinator/store.hpp"
#include "worker/train/in_process_recovery.hpp"
#include "worker/train/preemption.hpp"
#include "worker/train/recovery_detail.hpp"

namespace dnallm::train {

using namespace recovery_detail;  // NOLINT: this file's half of the recovery

std::optional<SparePlace> wait_for_place(const WorkerEnv& env) {
  DNALLM_CHECK(env.spare_id && env.generation && env.master_addr && env.master_port,
               ExitCode::kUsage,
               "DNALLM_SPARE_ID needs DNALLM_GENERATION, MASTER_ADDR and MASTER_PORT (a spare is "
               "started by dnallm-launch --spare-workers)");
  auto client = coordinator_client(*env.master_addr, *env.master_port, env.job_token);
  coordinator::Store& store = *client;
  const std::string key = coordinator::spare_key(*env.generation, *env.spare_id);
  // Note [Shrink and grow]: a spare started in a dead rank's stead is given its place back
  // only once it is ready.
  store.set(coordinator::spare_ready_key(*env.generation, *env.spare_id),
            coordinator::to_bytes(std::to_string(::getpid())));
  spdlog::info("spare {}: ready; waiting for a rank's place (generation {})", *env.spare_id,
               *env.generation);
  while (Preemption::signal_received() == 0) {
    if (!wait_a_while(store, key)) continue;
    if (auto v = store.try_get(key)) {
      const auto assigned = Clock::now();
      const int64_t n = std::stoll(coordinator::to_string(*v));
      SparePlace place;
      place.record =
          coordinator::read_recovery(store, *env.generation, n, std::chrono::seconds(10));
      place.assigned = assigned;
      place.initial_world = env.world_size.value_or(1);
      place.membership =
          coordinator::membership_after(store, *env.generation, place.initial_world, n);
      return place;
    }
  }
  spdlog::info("spare {}: stopped before it was needed", *env.spare_id);
  return std::nullopt;
}

void take_place(const SparePlace& spare, std::map<std::string, std::string>& process_env,
                WorkerEnv& env) {
  const auto& record = spare.record;
  env.rank = record.rank;
  env.local_rank = record.local_rank;
  env.progress_file = record.progress_file;
  env.spare_id.reset();
  process_env.erase("DNALLM_SPARE_ID");
  env.to_environment(process_env);
}

void place_in_group(const SparePlace& spare, cluster::Topology& topo, Config& config) {
  const int rank = spare.membership.rank_of(spare.record.rank);
  DNALLM_CHECK(rank >= 0, ExitCode::kPeerFailed,
               "recovery {} gives place {} to this spare, but the group after it has no such "
               "place (a bug; please report it)",
               spare.record.number, spare.record.rank);
  topo.rank = rank;
  topo.world_size = spare.membership.world();
  config.training.grad_accum_steps = coordinator::accum_for_world(
      spare.initial_accum, spare.initial_world, spare.membership.world());
}

comm::ProcessGroup join_as_spare(Config& config, const WorkerEnv& env, cluster::Topology& topo,
                                 const parallel::RankDevice& device, SparePlace& spare) {
  coordinator::RecoveryRecord& record = spare.record;
  std::shared_ptr<coordinator::Store> store =
      coordinator_client(topo.master_addr, topo.master_port, env.job_token);
  const int64_t generation = *env.generation;
  comm::ProcessGroup group;
  group.store = store;
  while (true) {
    const std::string name = coordinator::recovery_comm_name(generation, record.number);
    try {
      group.comm = connect_recovery_group(config, env, topo, device, store, record.number);
      spdlog::info("rank {} of {} ({} backend on {}): joined {}", topo.rank, topo.world_size,
                   group.comm->backend(), device.device.str(), name);
      return group;
    } catch (const Error& e) {
      const int64_t newest = coordinator::latest_recovery(*store, generation);
      if (newest <= record.number) throw;
      spdlog::warn("spare: {} ({}); joining recovery {}", name, e.what(), newest);
      record.number = newest;
      spare.membership =
          coordinator::membership_after(*store, generation, spare.initial_world, newest);
      place_in_group(spare, topo, config);
    }
  }
}

}  // namespace dnallm::train
