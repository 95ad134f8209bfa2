#include "worker/train/in_process_recovery.hpp"

#include <spdlog/spdlog.h>

#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/train/preemption.hpp"
#include "worker/train/recovery_detail.hpp"

namespace dnallm::train {

using namespace recovery_detail;  // NOLINT: this file's half of the recovery

InProcessRecovery::InProcessRecovery(RecoveryOptions options) : o_(std::move(options)) {
  DNALLM_CHECK(o_.config && o_.store && o_.comm && o_.loader && o_.env.generation,
               ExitCode::kFailure,
               "in-process recovery without its group (a bug; please report it)");
  step_start_ = o_.loader->state();
  sharded_ = o_.config->parallel.zero_stage > 0;
}

void InProcessRecovery::install(TrainerOptions& options) {
  options.before_step.push_back([this](Trainer& t, int64_t) {
    step_start_ = o_.loader->state();
    marked_step_ = t.step();
    // Note [Buddy copies]: the state the run starts from is the first commit.
    if (sharded_ && committed_ < 0) commit(t);
    if (o_.comm->world_size() < o_.initial_world) maybe_grow(t);
  });
  options.recover = [this](Trainer& t) { return recover(t); };
  options.after_step.push_back(
      [this](Trainer& t, const StepResult& r) { return after_step(t, r); });
}

std::optional<coordinator::RecoveryRecord> InProcessRecovery::wait_for_record() {
  const int64_t generation = *o_.env.generation;
  const auto deadline =
      Clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(o_.config->parallel.timeout_s * 1000.0));
  while (Clock::now() < deadline && Preemption::signal_received() == 0) {
    // The newest announced recovery: after two deaths at once, the last one names every place.
    const int64_t n = coordinator::latest_recovery(*o_.store, generation);
    if (n > recoveries_) {
      if (auto record = coordinator::try_read_recovery(*o_.store, generation, n)) return record;
    }
    wait_a_while(*o_.store, coordinator::recovery_key(generation, recoveries_ + 1));
  }
  return std::nullopt;
}

void InProcessRecovery::reform(const coordinator::RecoveryRecord& record) {
  const int64_t generation = *o_.env.generation;
  const std::string name = coordinator::recovery_comm_name(generation, record.number);
  // Note [Shrink and grow]: this place's rank in the group after the record.
  const auto m =
      coordinator::membership_after(*o_.store, generation, o_.initial_world, record.number);
  const int rank = m.rank_of(o_.place);
  DNALLM_CHECK(rank >= 0, ExitCode::kPeerFailed,
               "recovery {} of generation {} gave up this rank's place {} while it lived",
               record.number, generation, o_.place);
  resized_ = rank != o_.topo.rank || m.world() != o_.topo.world_size;
  if (resized_ && (sharded_ || o_.reform_groups)) {
    throw StateLost(
        ExitCode::kPeerFailed,
        fmt::format("in-process recovery: the group goes from {} to {} ranks, which ZeRO shards "
                    "and context groups cannot follow in process; the generation restarts from "
                    "its last checkpoint",
                    o_.topo.world_size, m.world()));
  }
  previous_rank_ = o_.topo.rank;
  o_.topo.rank = rank;
  o_.topo.world_size = m.world();
  o_.env.rank = rank;
  o_.env.world_size = m.world();
  auto backend =
      connect_recovery_group(*o_.config, o_.env, o_.topo, o_.device, o_.store, record.number);
  if (resized_) {
    o_.comm->resize(std::move(backend), name);
  } else {
    o_.comm->replace(std::move(backend), name);
  }
  if (o_.reform_groups) o_.reform_groups(*o_.comm, name);
  recoveries_ = record.number;
  reformed_at_ = Clock::now();
}

void InProcessRecovery::regroup(Trainer& t) {
  const int rank = o_.comm->rank(), world = o_.comm->world_size();
  const int64_t accum = coordinator::accum_for_world(o_.initial_accum, o_.initial_world, world);
  const int64_t micro = o_.config->training.micro_batch_size;
  if (accum * world != o_.initial_accum * o_.initial_world) {
    spdlog::warn(
        "the group now has {} ranks: no gradient accumulation keeps the global batch of {} "
        "sequences; it is {} until the group is whole again",
        world, o_.initial_accum * o_.initial_world * micro, accum * world * micro);
  }
  spdlog::warn("rank {} of {} now (was rank {}): {} micro-batch(es) a step", rank, world,
               previous_rank_, accum);
  set_log_identity(rank);
  t.regroup(accum);
  if (rank == 0 && previous_rank_ != 0) {
    // It takes over from a rank 0 that died: the lines that one wrote are not written again.
    if (!o_.config->logging.metrics_file.empty()) {
      for (const auto& [kind, step] : last_logged_steps(o_.config->logging.metrics_file)) {
        t.set_logged_through(step, kind);
      }
    }
    t.log_last_evaluation();
    if (o_.on_rank_zero) o_.on_rank_zero();
  }
}

void InProcessRecovery::maybe_grow(Trainer& t) {
  const int64_t generation = *o_.env.generation;
  const int64_t next = recoveries_ + 1;
  coordinator::Store& store = *o_.store;
  // Rank 0 picks the step (Note [Shrink and grow] step 3); one that ends the run is none.
  if (o_.comm->rank() == 0 && grow_at_ < next && t.step() + 1 < t.total_steps() &&
      coordinator::latest_recovery(store, generation) >= next) {
    const auto record = coordinator::try_read_recovery(store, generation, next);
    if (record && record->kind == coordinator::RecoveryKind::kGrow) {
      store.set(coordinator::grow_step_key(generation, next),
                coordinator::to_bytes(std::to_string(t.step() + 1)));
      grow_at_ = next;
    }
  }
  const auto at = store.try_get(coordinator::grow_step_key(generation, next));
  if (!at || std::stoll(coordinator::to_string(*at)) != t.step()) return;
  constexpr std::chrono::seconds kRecordWait(10);
  auto record = coordinator::read_recovery(store, generation, next, kRecordWait);
  const auto announced = Clock::now();
  spdlog::info("recovery {}: {}; the group grows at step {}", record.number, record.reason,
               t.step() + 1);
  int source = 0;
  int64_t bytes = 0;
  for (int attempt = 1;; ++attempt) {
    try {
      bytes = rejoin(t, record, source);
      break;
    } catch (const StateLost&) {
      throw;
    } catch (const std::exception& e) {
      // A later recovery overtook this one (another grow, or a death while the group formed):
      // every member goes to the newest, as a spare does (join_as_spare).
      const int64_t newest = coordinator::latest_recovery(store, generation);
      if (attempt >= kRecoveryAttempts || newest <= record.number) throw;
      spdlog::warn("recovery {} broke off ({}); joining recovery {}", record.number, e.what(),
                   newest);
      record = coordinator::read_recovery(store, generation, newest, kRecordWait);
    }
  }
  const auto transferred = Clock::now();
  report(t, record, source, bytes, {0.0, seconds_between(announced, transferred), 0.0},
         transferred);
}

int64_t InProcessRecovery::rejoin(Trainer& t, const coordinator::RecoveryRecord& record,
                                  int& source) {
  reform(record);
  DNALLM_CHECK(
      t.sync().abandon_step(), ExitCode::kFailure,
      "in-process recovery: the gradient engine cannot drop a step (a bug; please report it)");
  if (resized_) regroup(t);
  const int64_t bytes = exchange_state(t, /*holds_state=*/true, source);
  if (resized_) {
    // The new rank's share of the same global batches, from the step the state is at.
    o_.loader->reshard(o_.comm->rank(), o_.comm->world_size(), t.config().training.grad_accum_steps,
                       o_.loader->state(), static_cast<uint64_t>(t.step()));
  }
  return bytes;
}

torch::Tensor InProcessRecovery::state_header(Trainer& t, int64_t steps_done) const {
  auto header = torch::zeros({StateHeader::kCount}, torch::kFloat64);
  auto h = header.accessor<double, 1>();
  h[StateHeader::kStep] = double(steps_done);
  h[StateHeader::kAdamSteps] = double(t.optimizer().steps());
  h[StateHeader::kRawScale] = t.loss_scaler().raw_scale();
  h[StateHeader::kCleanSteps] = double(t.loss_scaler().clean_steps());
  h[StateHeader::kSkipped] = double(t.loss_scaler().skipped_steps());
  h[StateHeader::kBest] = t.best_value();
  h[StateHeader::kCursor] = double(cursor_after(steps_done).consumed_samples);
  h[StateHeader::kAccum] = double(t.config().training.grad_accum_steps);
  h[StateHeader::kLoss] = t.last_step().loss;
  h[StateHeader::kLr] = t.last_step().lr;
  h[StateHeader::kGradNorm] = t.last_step().grad_norm;
  return header;
}

int64_t InProcessRecovery::exchange_state(Trainer& t, bool holds_state, int& source) {
  if (sharded_) return exchange_shards(t, holds_state, source);
  comm::Communicator& comm = *o_.comm;
  const int world = comm.world_size();
  const double newest = allreduce_max(comm, holds_state ? double(t.step()) : -1.0);
  DNALLM_CHECK(newest >= 0, ExitCode::kPeerFailed,
               "in-process recovery: no rank of the re-formed group holds a state");
  // The lowest rank at the newest step.
  const bool at_newest = holds_state && double(t.step()) == newest;
  source = world - static_cast<int>(allreduce_max(comm, at_newest ? world - comm.rank() : 0));

  auto header = comm.rank() == source ? state_header(t, t.step())
                                      : torch::zeros({StateHeader::kCount}, torch::kFloat64);
  const int64_t own_step = holds_state ? t.step() : -1;
  int64_t bytes = broadcast_tensor(comm, header, source);
  {
    torch::NoGradGuard no_grad;
    bytes += broadcast_tensor(comm, t.flat().params(), source);
    bytes += broadcast_tensor(comm, t.optimizer().exp_avg(), source);
    bytes += broadcast_tensor(comm, t.optimizer().exp_avg_sq(), source);
  }
  apply_header(t, header, own_step, source);
  return bytes;
}

void InProcessRecovery::apply_header(Trainer& t, const torch::Tensor& header, int64_t own_step,
                                     int source) {
  comm::Communicator& comm = *o_.comm;
  const auto h = header.accessor<double, 1>();
  DNALLM_CHECK(h[StateHeader::kAccum] == double(t.config().training.grad_accum_steps),
               ExitCode::kFailure,
               "in-process recovery: rank {} accumulates {} micro-batches a step, the source rank "
               "{} {} (training.keep_global_batch resolved otherwise); restart the job",
               comm.rank(), t.config().training.grad_accum_steps, source, h[StateHeader::kAccum]);
  const auto step = static_cast<int64_t>(h[StateHeader::kStep]);
  // Note [Buddy copies]: a rank 0 that goes back to an earlier step does not log the steps it
  // logged again (they are run again bit for bit).
  if (comm.rank() == 0 && own_step > step) t.set_logged_through(own_step);
  t.set_step(step);
  t.optimizer().set_steps(static_cast<int64_t>(h[StateHeader::kAdamSteps]));
  t.loss_scaler().restore(h[StateHeader::kRawScale],
                          static_cast<int64_t>(h[StateHeader::kCleanSteps]),
                          static_cast<int64_t>(h[StateHeader::kSkipped]));
  t.set_best_value(h[StateHeader::kBest]);
  t.reload_host_params();
  data::SamplerState cursor = o_.loader->state();
  cursor.consumed_samples = static_cast<uint64_t>(h[StateHeader::kCursor]);
  o_.loader->reset(cursor, static_cast<uint64_t>(step));
  step_start_ = cursor;
  marked_step_ = step;
  // The source completed a step this rank did not: when this is rank 0, nobody logged it (a
  // rank 0 that died logged at most what the file holds: set_logged_through filters that).
  if (comm.rank() == 0 && step > own_step && step > 0 && t.logs_step(step)) {
    nlohmann::ordered_json line;
    line["step"] = step;
    line["loss"] = h[StateHeader::kLoss];
    line["lr"] = h[StateHeader::kLr];
    line["grad_norm"] = h[StateHeader::kGradNorm];
    line["recovered_from_rank"] = source;
    t.write_metrics(line);
  }
}

data::SamplerState InProcessRecovery::cursor_after(int64_t steps_done) const {
  // The step's batches were all taken before its first collective (Trainer::train_step), and
  // none after it: a rank whose failure came after its step (in the evaluation or a hook) has
  // the loader exactly past that step.
  if (steps_done == marked_step_) return step_start_;
  DNALLM_CHECK(steps_done == marked_step_ + 1, ExitCode::kFailure,
               "in-process recovery: step {} done, but the loader was marked at step {} (a bug; "
               "please report it)",
               steps_done, marked_step_);
  return o_.loader->state();
}

bool InProcessRecovery::recover(Trainer& t) {
  const auto failed_at = Clock::now();
  bool comm_failed = false;
  try {
    comm_failed = o_.comm->backend_failed(*o_.store);
  } catch (const std::exception& e) {
    spdlog::error("in-process recovery: the coordinator cannot be reached ({})", e.what());
  }
  if (!comm_failed) return false;  // not a peer's failure: the step's own error stands
  if (t.sync_free()) {
    spdlog::error(
        "in-process recovery: sync-free steps update before their last collective, so "
        "the state of the broken step is unknown; the generation restarts");
    return false;
  }
  spdlog::warn(
      "step {} broke off: a peer failed; waiting for a spare to take its place (or, with "
      "elastic.shrink, for the group to go on without it)",
      t.step() + 1);
  if (o_.abandon_saves) o_.abandon_saves();
  // Closing this rank's connections fails at once the collectives that other survivors still
  // wait in with it (one in another group's operation, or in an earlier one, would otherwise
  // wait for its timeout while this rank waits for it in the new group).
  o_.comm->abort();
  if (o_.abort_groups) o_.abort_groups();
  // A rank that dies while the group re-forms breaks the new communicator too: its agent
  // announces another recovery, which this loop then joins.
  for (int attempt = 1;; ++attempt) {
    const auto record = wait_for_record();
    if (!record) {
      spdlog::error("in-process recovery: no spare took the failed rank's place{}",
                    Preemption::signal_received() != 0 ? " (stopped)" : " in parallel.timeout_s");
      return false;
    }
    const auto announced = Clock::now();
    try {
      int source = 0;
      const int64_t bytes = rejoin(t, *record, source);
      const auto reformed = reformed_at_;
      const auto transferred = Clock::now();
      spdlog::warn(
          "recovery {}: {}; re-formed in {:.3f} s, state of step {} from rank {} ({} bytes) in "
          "{:.3f} s",
          record->number, record->reason, seconds_between(announced, reformed), t.step(), source,
          bytes, seconds_between(reformed, transferred));
      report(t, *record, source, bytes,
             {seconds_between(failed_at, announced), seconds_between(announced, reformed),
              seconds_between(reformed, transferred)},
             transferred);
      return true;
    } catch (const StateLost& e) {
      spdlog::error("{}", e.what());
      return false;
    } catch (const std::exception& e) {
      if (attempt >= kRecoveryAttempts) throw;
      spdlog::warn("recovery {} broke off too ({}); waiting for the next", record->number,
                   e.what());
    }
  }
}

void InProcessRecovery::join(Trainer& t, const coordinator::RecoveryRecord& record,
                             Clock::time_point assigned) {
  // The spare's own process group already is the group the survivors build for this record
  // (join_process_group named it so): only the number is recorded here.
  recoveries_ = record.number;
  if (o_.comm->rank() == 0 && !o_.config->logging.metrics_file.empty()) {
    for (const auto& [kind, step] : last_logged_steps(o_.config->logging.metrics_file)) {
      t.set_logged_through(step, kind);
    }
  }
  int source = 0;
  const int64_t bytes = exchange_state(t, /*holds_state=*/false, source);
  const auto transferred = Clock::now();
  spdlog::warn(
      "spare: took place {} as rank {} of {} ({}) at step {}: state from rank {} ({} bytes) in "
      "{:.3f} s",
      record.rank, o_.comm->rank(), o_.comm->world_size(), record.reason, t.step(), source, bytes,
      seconds_between(assigned, transferred));
  // Joined and received together: the whole of it counts as re-forming.
  report(t, record, source, bytes, {0.0, seconds_between(assigned, transferred), 0.0}, transferred);
}

void InProcessRecovery::report(const Trainer& t, const coordinator::RecoveryRecord& record,
                               int source, int64_t bytes, const Phases& phases,
                               Clock::time_point resumed) {
  if (o_.comm->rank() != 0) return;
  nlohmann::ordered_json e;
  e["event"] = "restart";
  e["kind"] = coordinator::recovery_kind_name(record.kind);
  e["generation"] = *o_.env.generation;
  e["recovery"] = record.number;
  e["dead_rank"] = record.rank;
  e["dead_host"] = record.host;
  e["reason"] = record.reason;
  e["step"] = t.step() + 1;
  e["steps_lost"] = 0;
  e["world_size"] = o_.comm->world_size();
  e["grad_accum_steps"] = t.config().training.grad_accum_steps;
  e["source_rank"] = source;
  e["bytes"] = bytes;
  e["abort_s"] = phases.abort_s;
  e["reform_s"] = phases.reform_s;
  e["transfer_s"] = phases.transfer_s;
  pending_ = Pending{std::move(e), resumed, record.detected_unix_ms};
}

StepAction InProcessRecovery::after_step(Trainer& t, const StepResult& r) {
  if (sharded_) commit(t);
  if (!pending_) return StepAction::kContinue;
  pending_->event["first_step_s"] = seconds_between(pending_->resumed, Clock::now());
  pending_->event["total_s"] =
      double(coordinator::unix_ms_now() - pending_->detected_unix_ms) / 1000.0;
  pending_->event["step"] = r.step;
  t.write_metrics(pending_->event);
  pending_.reset();
  return StepAction::kContinue;
}

}  // namespace dnallm::train
