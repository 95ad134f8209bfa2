#include "worker/train/in_process_recovery.hpp"

#include <fstream>

#include <spdlog/spdlog.h>

#include "coordinator/store.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"
#include "worker/parallel/process_group.hpp"
#include "worker/tensor_buffer.hpp"
#include "worker/train/preemption.hpp"

namespace dnallm::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void wait_all(comm::WorkPtr work) { work->wait(); }

// The state the source broadcasts beside the tensors (step 5 of the Note), as doubles: every
// count is far below 2^53.
struct StateHeader {
  enum : int64_t {
    kStep,
    kAdamSteps,
    kRawScale,
    kCleanSteps,
    kSkipped,
    kBest,
    kCursor,
    kAccum,  // checked: a spare must accumulate as the survivors do
    kLoss,   // the source's last step, for a rank 0 that did not log it
    kLr,
    kGradNorm,
    kCount
  };
};

// Broadcasts `t` (contiguous, the same numel on every rank) from `root` in place, in chunks.
int64_t broadcast_tensor(comm::Communicator& comm, const torch::Tensor& t, int root) {
  if (!t.defined() || t.numel() == 0) return 0;
  const auto dtype = dtype_of(t.scalar_type());
  DNALLM_CHECK(dtype.has_value() && t.is_contiguous(), ExitCode::kFailure,
               "in-process recovery cannot broadcast a {} tensor (a bug; please report it)",
               std::string(c10::toString(t.scalar_type())));
  for (int64_t begin = 0; begin < t.numel(); begin += kRecoveryChunkElements) {
    const int64_t count = std::min(kRecoveryChunkElements, t.numel() - begin);
    wait_all(comm.broadcast(buffer_view(t, begin, count, *dtype), root));
  }
  return t.numel() * static_cast<int64_t>(t.element_size());
}

double allreduce_max(comm::Communicator& comm, double value) {
  auto t = torch::full({1}, value, torch::kFloat64);
  wait_all(comm.allreduce(buffer_view(t, 0, 1, DType::kFloat64), comm::ReduceOp::kMax));
  return t.item<double>();
}

// Waits up to kWaitSlice for `key` (the server answers as soon as it is set): true when it
// exists. Short slices, so that the caller sees a stop signal or its deadline in time.
constexpr auto kWaitSlice = std::chrono::milliseconds(100);
bool wait_a_while(coordinator::Store& store, const std::string& key) {
  try {
    store.wait({key}, kWaitSlice);
    return true;
  } catch (const Error&) {
    return store.check({key});  // a timeout; a lost coordinator throws from here
  }
}

// The last step of a metrics line (not an event) in `path`; 0 when there is none.
int64_t last_logged_step(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  int64_t last = 0;
  while (std::getline(f, line)) {
    try {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("event") && j.contains("step"))
        last = std::max(last, j["step"].get<int64_t>());
    } catch (const std::exception&) {
      // a line cut short by the death of the rank that wrote it
    }
  }
  return last;
}

}  // namespace

std::optional<SparePlace> wait_for_place(const WorkerEnv& env) {
  DNALLM_CHECK(env.spare_id && env.generation && env.master_addr && env.master_port,
               ExitCode::kUsage,
               "DNALLM_SPARE_ID needs DNALLM_GENERATION, MASTER_ADDR and MASTER_PORT (a spare is "
               "started by dnallm-launch --spare-workers)");
  coordinator::TcpStoreClientOptions co;
  co.host = *env.master_addr;
  co.port = static_cast<uint16_t>(*env.master_port);
  co.token = env.job_token;
  coordinator::TcpStoreClient store(co);
  const std::string key = coordinator::spare_key(*env.generation, *env.spare_id);
  spdlog::info("spare {}: ready; waiting for a rank's place (generation {})", *env.spare_id,
               *env.generation);
  while (Preemption::signal_received() == 0) {
    if (!wait_a_while(store, key)) continue;
    if (auto v = store.try_get(key)) {
      const auto assigned = Clock::now();
      const int64_t n = std::stoll(coordinator::to_string(*v));
      const std::string record_key = coordinator::recovery_key(*env.generation, n);
      return SparePlace{
          coordinator::RecoveryRecord::from_json(
              coordinator::to_string(store.get(record_key, std::chrono::seconds(10))), record_key),
          assigned};
    }
  }
  spdlog::info("spare {}: stopped before it was needed", *env.spare_id);
  return std::nullopt;
}

void take_place(const coordinator::RecoveryRecord& record,
                std::map<std::string, std::string>& process_env, WorkerEnv& env) {
  env.rank = record.rank;
  env.local_rank = record.local_rank;
  env.progress_file = record.progress_file;
  env.spare_id.reset();
  process_env.erase("DNALLM_SPARE_ID");
  env.to_environment(process_env);
}

InProcessRecovery::InProcessRecovery(RecoveryOptions options) : o_(std::move(options)) {
  DNALLM_CHECK(o_.config && o_.store && o_.comm && o_.loader && o_.env.generation,
               ExitCode::kFailure,
               "in-process recovery without its group (a bug; please report it)");
  step_start_ = o_.loader->state();
}

void InProcessRecovery::install(TrainerOptions& options) {
  options.before_step.push_back([this](Trainer& t, int64_t) {
    step_start_ = o_.loader->state();
    marked_step_ = t.step();
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
    const auto count = o_.store->try_get(coordinator::recovery_count_key(generation));
    const int64_t n = count ? std::stoll(coordinator::to_string(*count)) : 0;
    const std::string key = coordinator::recovery_key(generation, n);
    if (n > recoveries_ && o_.store->check({key})) {
      return coordinator::RecoveryRecord::from_json(coordinator::to_string(*o_.store->try_get(key)),
                                                    key);
    }
    wait_a_while(*o_.store, coordinator::recovery_key(generation, recoveries_ + 1));
  }
  return std::nullopt;
}

void InProcessRecovery::reform(const coordinator::RecoveryRecord& record) {
  const std::string name = coordinator::recovery_comm_name(*o_.env.generation, record.number);
  o_.comm->replace(
      parallel::rejoin_process_group(*o_.config, o_.env, o_.topo, o_.device, o_.store, name), name);
  recoveries_ = record.number;
}

int64_t InProcessRecovery::exchange_state(Trainer& t, bool holds_state, int& source) {
  comm::Communicator& comm = *o_.comm;
  const int world = comm.world_size();
  const double newest = allreduce_max(comm, holds_state ? double(t.step()) : -1.0);
  DNALLM_CHECK(newest >= 0, ExitCode::kPeerFailed,
               "in-process recovery: no rank of the re-formed group holds a state");
  // The lowest rank at the newest step.
  const bool at_newest = holds_state && double(t.step()) == newest;
  source = world - static_cast<int>(allreduce_max(comm, at_newest ? world - comm.rank() : 0));

  auto header = torch::zeros({StateHeader::kCount}, torch::kFloat64);
  if (comm.rank() == source) {
    auto h = header.accessor<double, 1>();
    h[StateHeader::kStep] = double(t.step());
    h[StateHeader::kAdamSteps] = double(t.optimizer().steps());
    h[StateHeader::kRawScale] = t.loss_scaler().raw_scale();
    h[StateHeader::kCleanSteps] = double(t.loss_scaler().clean_steps());
    h[StateHeader::kSkipped] = double(t.loss_scaler().skipped_steps());
    h[StateHeader::kBest] = t.best_value();
    h[StateHeader::kCursor] = double(cursor_after(t.step()).consumed_samples);
    h[StateHeader::kAccum] = double(o_.config->training.grad_accum_steps);
    h[StateHeader::kLoss] = t.last_step().loss;
    h[StateHeader::kLr] = t.last_step().lr;
    h[StateHeader::kGradNorm] = t.last_step().grad_norm;
  }
  const int64_t own_step = holds_state ? t.step() : -1;
  int64_t bytes = broadcast_tensor(comm, header, source);
  {
    torch::NoGradGuard no_grad;
    bytes += broadcast_tensor(comm, t.flat().params(), source);
    bytes += broadcast_tensor(comm, t.optimizer().exp_avg(), source);
    bytes += broadcast_tensor(comm, t.optimizer().exp_avg_sq(), source);
  }
  const auto h = header.accessor<double, 1>();
  DNALLM_CHECK(h[StateHeader::kAccum] == double(o_.config->training.grad_accum_steps),
               ExitCode::kFailure,
               "in-process recovery: rank {} accumulates {} micro-batches a step, the source rank "
               "{} {} (training.keep_global_batch resolved otherwise); restart the job",
               comm.rank(), o_.config->training.grad_accum_steps, source, h[StateHeader::kAccum]);
  const auto step = static_cast<int64_t>(h[StateHeader::kStep]);
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
  return bytes;
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
  spdlog::warn("step {} broke off: a peer failed; waiting for a spare to take its place",
               t.step() + 1);
  if (o_.abandon_saves) o_.abandon_saves();
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
      reform(*record);
      DNALLM_CHECK(
          t.sync().abandon_step(), ExitCode::kFailure,
          "in-process recovery: the gradient engine cannot drop a step (a bug; please report it)");
      const auto reformed = Clock::now();
      int source = 0;
      const int64_t bytes = exchange_state(t, /*holds_state=*/true, source);
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
    t.set_logged_through(last_logged_step(o_.config->logging.metrics_file));
  }
  int source = 0;
  const int64_t bytes = exchange_state(t, /*holds_state=*/false, source);
  const auto transferred = Clock::now();
  spdlog::warn(
      "spare: took rank {}'s place ({}) at step {}: state from rank {} ({} bytes) in {:.3f} s",
      record.rank, record.reason, t.step(), source, bytes, seconds_between(assigned, transferred));
  // Joined and received together: the whole of it counts as re-forming.
  report(t, record, source, bytes, {0.0, seconds_between(assigned, transferred), 0.0}, transferred);
}

void InProcessRecovery::report(const Trainer& t, const coordinator::RecoveryRecord& record,
                               int source, int64_t bytes, const Phases& phases,
                               Clock::time_point resumed) {
  if (o_.comm->rank() != 0) return;
  nlohmann::ordered_json e;
  e["event"] = "restart";
  e["kind"] = "spare";
  e["generation"] = *o_.env.generation;
  e["recovery"] = record.number;
  e["dead_rank"] = record.rank;
  e["dead_host"] = record.host;
  e["reason"] = record.reason;
  e["step"] = t.step() + 1;
  e["steps_lost"] = 0;
  e["source_rank"] = source;
  e["bytes"] = bytes;
  e["abort_s"] = phases.abort_s;
  e["reform_s"] = phases.reform_s;
  e["transfer_s"] = phases.transfer_s;
  pending_ = Pending{std::move(e), resumed, record.detected_unix_ms};
}

StepAction InProcessRecovery::after_step(Trainer& t, const StepResult& r) {
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
