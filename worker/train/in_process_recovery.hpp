// Note [In-process recovery]
// A rank that dies costs no step: the survivors stay in process, a warm spare takes the dead
// rank's place, and every rank takes the newest state from a peer instead of a checkpoint.
//   1. Spares. `dnallm-launch --spare-workers K` (elastic.spare_workers) starts K extra
//      dnallm-train processes beside each agent's ranks (DNALLM_SPARE_ID). A spare reads its
//      configuration and tokenizer, opens the training set, then waits at the coordinator's
//      store (key recover/g<G>/spare/<id>) with LibTorch loaded; a stop signal ends the wait
//      (exit 0). Every worker of such a job has DNALLM_IN_PROCESS_RECOVERY=1.
//   2. Detection. The agent reaps a rank that ended on its own (a signal, or an exit that is
//      neither a diagnosis 2/3/5, nor 4, nor 75: replaceable_by_spare in
//      launcher/elastic_agent.hpp) and, while a spare of its own waits, writes a
//      coordinator::RecoveryRecord (coordinator/recovery.hpp): the dead rank, its host, the
//      reason, the spare, its own detection time. No other agent and no generation change is
//      involved: the coordinator's membership is untouched.
//   3. Abort. A survivor's next collective with the dead rank fails (gloo sees the closed
//      connection at once; a rank whose coordinator connection closed is named dead, Note
//      [Peer failure] in comm/communicator.hpp). Trainer::run catches the step's error and asks
//      TrainerOptions::recover, which goes on only when this rank's communicator recorded the
//      failure (comm/<name>/failed/<rank>): any other error is rethrown as before.
//   4. Re-form. The survivor waits (parallel.timeout_s at most; a stop signal ends the wait) for
//      the record of the next recovery, builds a new backend for the same rank and world over
//      the same store, named "g<G>.r<n>" (recovery_comm_name), and swaps it into the
//      comm::ReformableCommunicator that DDP, the checkpointer and the evaluation hold: model,
//      optimizer, data loader and LibTorch stay. The spare joins the same communicator as the
//      dead rank (its rank, its local rank, its progress file; rank 0's directory lock too).
//   5. State. Every rank tells the others the last step it completed (the spare: none); the
//      lowest rank at the newest step is the source and broadcasts its step, optimizer step
//      count, loss scaler, best evaluation value, the data cursor at that step, the flat
//      parameters and both Adam moments, in chunks of at most kRecoveryChunkElements elements
//      into the buffers every rank already has (no second copy). A survivor whose all-reduce
//      completed before the death is ahead by one step: its state wins, the others catch up.
//      Every rank resets its loader to the source's cursor and its DDP engine drops the
//      broken step (GradientSync::abandon_step). Under ZeRO-1/2/3 a shard is not on every rank:
//      it comes from the copies of Note [Buddy copies] instead, at the newest committed step.
//   6. Exactness. The step in flight is run again from the same batch (the data of a step is a
//      function of the cursor and the rank) with the same dropout seeds (Note [Dropout
//      randomness]: a function of seed, step, micro-step and rank), so the run is bit-identical
//      to one without the failure. A rank 0 that died after writing a step's metrics line is
//      not followed by a second line for it (Trainer::set_logged_through).
//   7. Report. Rank 0 writes {"event":"restart","kind":"spare",...} after the first step the
//      re-formed group completes: the generation, recovery number, dead rank and host, reason,
//      source rank, bytes broadcast, steps lost (0), and the phases in seconds: abort_s (this
//      rank's failed step to the record, or 0 for the spare), reform_s, transfer_s,
//      first_step_s, and total_s from the agent's detection to the end of that step.
// Where this cannot hold, the worker keeps today's behaviour (exit 4; the agent restarts the
// generation from the last checkpoint): sync-free steps (their update precedes the last
// collective), the MPI backend (it cannot abort), no spare left (without elastic.shrink: Note
// [Shrink and grow]), a dead rank whose buddy died
// too (ZeRO), a third broken attempt. A failure in the evaluation or a checkpoint save goes on
// without them (DDP) or runs the step again (ZeRO); a rank that takes over rank 0 writes the
// line of an evaluation that the dead rank 0 completed but did not log.
// Sub-groups of the world (the context group) are split again after the re-form
// (RecoveryOptions::reform_groups); a group whose forming a later recovery overtakes (a rank died
// meanwhile) gives way to it at once, and every rank joins the newest recovery's group
// (coordinator::until_next_recovery, join_as_spare).
//
// Note [Buddy copies]
// Under ZeRO-1/2/3 a rank's range of the optimizer state and of the parameters (only it updates
// them; ZeRO-3 holds no other) lives on that rank alone. With spares in the job, every rank keeps a
// host copy of its shard [parameters | exp_avg | exp_avg_sq] and of the step's scalars (the header
// of step 5) and sends it to its buddy, the next rank (rank + 1 mod world), which keeps it:
//   commit(step): own copy into the slot of the step's parity; send it to the next rank and
//   receive the previous rank's into the same slot of its buddy copies; a barrier; committed.
// It runs after every step (an after-step hook, before the checkpoint's) and once before the
// first. Past the barrier of step S every rank holds its own copy and its predecessor's of S;
// a rank that has not passed it yet holds them too as soon as any rank has passed it (every rank
// entered the barrier after its exchange). No rank reaches the copies of S + 2 before every
// rank passed the barrier of S + 1, so two slots always hold the newest committed step T.
// Recovery (step 5): T = the newest step any survivor committed, or the step after it where
// every shard's copy of that one survived (a failure during its barrier); every survivor takes its
// shard back from its own copy of T (one that ran on into step T + 1 goes back: the step is
// run again bit for bit, and rank 0 does not log again the steps it logged), a spare takes the
// dead rank's from that rank's buddy (send/recv, chunked), the header comes from the lowest
// survivor, ZeRO-1/2 gather the parameters whole again (after_optimizer_step), the copies of T
// are committed afresh, the spare's included. A dead rank whose buddy died too (or no commit
// at all) leaves no copy: the recovery says so and the generation restarts from its checkpoint.
// Cost: host memory 2 slots x (own + buddy) x 3 x 4 bytes a shard element = 48 x P / world
// bytes for P trainable parameters; each step copies 12 x P / world bytes to the host and sends
// as many to the next rank, then one barrier (docs/elastic.md has the figures).
//
// Note [Shrink and grow]
// elastic.shrink = true: a rank that dies when no spare is left costs no step either; the
// survivors go on without it (DDP only: under ZeRO or context parallelism a shard or a context
// group would change shape, and the generation restarts as before).
//   1. Places. Every process of a generation has a place, the rank it was started as. The
//      agent announces a record for a place: kSpare (a spare takes it), kShrink (it is given
//      up) or kGrow (a spare returns to it). The group after recovery n is
//      coordinator::membership_after(n): a shrink drops the place, a grow appends it, a spare
//      keeps its position; a process's rank is its place's index, the world the places' count.
//      So only a rank above a dead one moves, and rank 0 only when rank 0 died.
//   2. Shrink. Steps 3-5 of Note [In-process recovery], with the new rank and world: the world
//      communicator is resized (ReformableCommunicator::resize), gradient accumulation becomes
//      coordinator::accum_for_world (the global batch is kept where a whole number does it, as
//      a resume at another world size keeps it), the training loader takes the new rank's
//      share of the same global batches (DataLoader::reshard: the global sample stream does
//      not depend on the world size), the evaluation data is split again, and a rank that
//      becomes rank 0 takes over the metrics file and the checkpoint directory's lock
//      (Trainer::regroup, RecoveryOptions::on_rank_zero). The step in flight is run again by the
//      smaller group on the same samples: no step is lost, but the run is not bit-identical
//      (other ranks sum other rows, and dropout seeds follow the rank).
//   3. Grow. The agent starts a fresh worker in the dead one's stead, as a spare; once it waits,
//      warm (its ready key), the agent announces a kGrow record for the place. Nobody failed, so
//      the group takes it at a step boundary all ranks agree on: rank 0, at the start of a
//      step S + 1, sees the record and writes its grow step S + 1 (grow_step_key); every
//      rank looks for that key at each step boundary while the group is smaller than it began
//      (one store read a step) and grows at the boundary after S + 1 steps. No rank can pass
//      that boundary unseen: finishing step S + 1 needs rank 0's part in its all-reduce, which
//      comes after the key was written. The joiner gets the state as a spare does (step 5).
//   4. Report. The restart event's kind is "shrink" or "grow", with the world size and gradient
//      accumulation after it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cluster/topology.hpp"
#include "comm/bootstrap.hpp"
#include "comm/reformable_communicator.hpp"
#include "coordinator/recovery.hpp"
#include "core/config.hpp"
#include "core/worker_env.hpp"
#include "worker/data/data_loader.hpp"
#include "worker/parallel/device_group.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::coordinator {
class Store;
}

namespace dnallm::train {

inline constexpr int64_t kRecoveryChunkElements = int64_t{16} << 20;
// Recoveries one broken step may go through (a rank dying while the group re-forms).
inline constexpr int kRecoveryAttempts = 3;

// A spare's wait (step 1): polls the coordinator's store (MASTER_ADDR, MASTER_PORT, the job
// token of `env`) until spare env.spare_id of env.generation is given a place, and returns
// that recovery's record and when it came; nullopt when a stop signal came first.
struct SparePlace {
  coordinator::RecoveryRecord record;
  std::chrono::steady_clock::time_point assigned;
  // The training set, opened while the spare waited (the same on every rank): the loader of
  // the place it takes only cuts its shard.
  std::shared_ptr<const data::Dataset> train_set;
  // Note [Shrink and grow]: the generation's first world size and gradient accumulation.
  int initial_world = 1;
  int64_t initial_accum = 1;
  coordinator::Membership membership;  // the group after `record`
};
std::optional<SparePlace> wait_for_place(const WorkerEnv& env);
// The worker environment of the rank whose place `spare.record` gives: RANK (the place), LOCAL_RANK
// and the progress file written over `process_env` and `env`; no longer a spare.
void take_place(const SparePlace& spare, std::map<std::string, std::string>& process_env,
                WorkerEnv& env);
// Note [Shrink and grow]: `topo` (detected from that environment) at the place's rank and world
// in the group after the record, and `config` accumulating as that group does. The node's local
// sizes stay the slots the launcher started.
void place_in_group(const SparePlace& spare, cluster::Topology& topo, Config& config);

// A spare given `record`'s place joins the re-formed group (step 4) with the survivors. When
// that group gives way to a later recovery (a rank died while it formed: two deaths at once),
// it joins the newest one instead, as the survivors do;
// Collective with the survivors' reform(); blocking.
// `spare.record.number` is then that one, and place_in_group() moves `topo` and `config` to it.
comm::ProcessGroup join_as_spare(Config& config, const WorkerEnv& env, cluster::Topology& topo,
                                 const parallel::RankDevice& device, SparePlace& spare);

struct RecoveryOptions {
  const Config* config = nullptr;
  WorkerEnv env;
  cluster::Topology topo;
  parallel::RankDevice device;
  std::shared_ptr<coordinator::Store> store;
  comm::ReformableCommunicator* comm = nullptr;  // the group's world communicator
  data::DataLoader* loader = nullptr;            // the trainer's training loader
  // Drops a checkpoint save in flight (Checkpointer::abandon_in_flight): its commit would wait
  // for the dead rank's shard. Null: no checkpoints.
  std::function<void()> abandon_saves;
  // After the world was re-formed as `name`: its sub-groups split again (the context mesh's).
  // Collective over `world`; null: none.
  std::function<void(comm::Communicator& world, const std::string& name)> reform_groups;
  // When a peer's failure is known: the sub-groups' backends destroyed (ReformableCommunicator::
  // abort), as the world's is; null: none.
  std::function<void()> abort_groups;
  // Note [Shrink and grow]: this process's place, and the generation's first world size and
  // gradient accumulation (a spare's: SparePlace's).
  int place = 0;
  int initial_world = 1;
  int64_t initial_accum = 1;
  // Called when a resize made this process rank 0 (the checkpoint directory's lock); null: none.
  std::function<void()> on_rank_zero;
};

class InProcessRecovery {
 public:
  explicit InProcessRecovery(RecoveryOptions options);

  // TrainerOptions::before_step (the loader's cursor at each step's start), ::recover, and an
  // after_step hook that writes the pending restart event (rank 0).
  void install(TrainerOptions& options);
  // Steps 4-5 for a spare given `record`'s place, once its trainer is built (collective with
  // the survivors' recover()). `assigned`: when the spare read the record.
  void join(Trainer& trainer, const coordinator::RecoveryRecord& record,
            std::chrono::steady_clock::time_point assigned);

 private:
  bool recover(Trainer& trainer);
  // Waits for the record of a recovery after the last one this rank took part in.
  std::optional<coordinator::RecoveryRecord> wait_for_record();
  // Step 5; returns the bytes the source broadcast (DDP) or the buddies sent (ZeRO).
  int64_t exchange_state(Trainer& trainer, bool holds_state, int& source);
  // Note [Buddy copies]: step 5 under ZeRO-1/2, and the commit of a step's shard copies.
  int64_t exchange_shards(Trainer& trainer, bool holds_state, int& source);
  void commit(Trainer& trainer);
  // The scalars of step 5 after `steps_done` steps, and taking them from rank `source`
  // (`own_step`: the last step this rank completed before, -1 for a spare).
  torch::Tensor state_header(Trainer& trainer, int64_t steps_done) const;
  void apply_header(Trainer& trainer, const torch::Tensor& header, int64_t own_step, int source);
  void reform(const coordinator::RecoveryRecord& record);
  // Note [Shrink and grow]: after a resize, the trainer and the loaders follow the new world.
  void regroup(Trainer& trainer);
  // Note [Shrink and grow] step 3, at each step boundary while the group is smaller than it began.
  void maybe_grow(Trainer& trainer);
  int64_t grow_at_ = -1;  // rank 0: the last recovery whose grow step it wrote
  // reform(), the resize's regroup() and the state (step 5); the bytes exchanged.
  int64_t rejoin(Trainer& trainer, const coordinator::RecoveryRecord& record, int& source);
  int previous_rank_ = 0;                              // before the last reform()
  std::chrono::steady_clock::time_point reformed_at_;  // when the last reform() ended
  StepAction after_step(Trainer& trainer, const StepResult& r);
  struct Phases {
    double abort_s = 0, reform_s = 0, transfer_s = 0;
  };
  // Rank 0: the restart event (step 7 of the Note), written after the next step.
  void report(const Trainer& trainer, const coordinator::RecoveryRecord& record, int source,
              int64_t bytes, const Phases& phases, std::chrono::steady_clock::time_point resumed);

  RecoveryOptions o_;
  // The loader's cursor where the current step began, after `marked_step_` steps.
  data::SamplerState step_start_;
  int64_t marked_step_ = 0;
  // The loader's cursor after `steps_done` steps (the trainer's step(): the current one's start,
  // or its end when the failure came after it).
  data::SamplerState cursor_after(int64_t steps_done) const;
  int64_t recoveries_ = 0;  // the last recovery number this rank took part in
  bool resized_ = false;    // the last reform() changed this rank's rank or world size
  coordinator::RecoveryKind last_kind_ = coordinator::RecoveryKind::kSpare;
  // Note [Buddy copies]: parallel.zero_stage > 0. A copy is a step's header and this rank's
  // shard [parameters | exp_avg | exp_avg_sq] (fp32, host), in the slot of the step's parity.
  struct StateCopy {
    int64_t step = -1;  // -1 while empty or being written
    torch::Tensor header, data;
  };
  bool sharded_ = false;
  StateCopy own_[2], buddy_[2];  // this rank's, and the rank before it's (rank - 1 mod world)
  int64_t committed_ = -1;       // the last step whose copies every rank had (the barrier)
  int64_t prev_numel_ = -1;      // the shard size of the rank before this one
  struct Pending {
    nlohmann::ordered_json event;
    std::chrono::steady_clock::time_point resumed;
    int64_t detected_unix_ms = 0;
  };
  std::optional<Pending> pending_;  // rank 0: the event written after the next step
};

}  // namespace dnallm::train
