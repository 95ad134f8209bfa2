#include "launcher/worker_group.hpp"

#include <csignal>
#include <memory>
#include <optional>

#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "core/signals.hpp"

namespace dnallm::launcher {

struct LocalWorkerGroup::Running {
  const WorkerSpec* spec;
  std::unique_ptr<WorkerProcess> process;
  bool ended = false;
  std::optional<WorkerExit> exit;  // once ended
  // Note [In-process recovery]: >= 0 while a spare waits; a spare that took a dead rank's
  // place holds its rank from then on, and the dead worker is `replaced` (no rank any more).
  int spare_id = -1;
  int rank = 0, local_rank = 0;
  bool replaced = false;
  // Note [Shrink and grow]: the place a spare started in a dead rank's stead returns to; -1: none.
  int returns_to = -1;
  bool is_rank() const { return spare_id < 0 && !replaced; }
};

namespace {

constexpr int kRequeueCode = static_cast<int>(ExitCode::kRequeue);

bool is_requeue(const WorkerExit& e) { return !e.signaled && e.code == kRequeueCode; }

}  // namespace

GenerationResult LocalWorkerGroup::run(const std::vector<WorkerSpec>& specs) {
  GenerationResult result;
  Workers workers;
  extra_specs_.clear();
  next_spare_id_ = 0;
  for (const auto& spec : specs) next_spare_id_ = std::max(next_spare_id_, spec.spare_id + 1);
  try {
    for (const auto& spec : specs) {
      workers.push_back({&spec, spawner_.spawn(spec), false, std::nullopt, spec.spare_id, spec.rank,
                         spec.local_rank, false});
    }
  } catch (...) {
    stop_all(workers, SIGTERM, result);
    throw;
  }

  std::size_t ended = 0;  // of every worker, spares too
  auto ranks_running = [&] {
    for (const auto& w : workers) {
      if (w.is_rank() && !w.ended) return true;
    }
    return false;
  };
  std::size_t requeued = 0;      // workers that exited 75 (Note [Preemption])
  std::vector<Running*> failed;  // parallel to result.failures
  SpareStarts to_start;          // spares to start after this tick
  while (ranks_running()) {
    int sig = signals_.wait(options_.tick);
    if (sig == SIGUSR1) {
      // Step 7: a preemption notice. The workers checkpoint and exit 75 on their own.
      spdlog::warn(
          "received SIGUSR1 (preemption notice): forwarding it to {} worker(s); they "
          "checkpoint at the next step and exit {}",
          workers.size() - ended, kRequeueCode);
      result.preempt_signal = SIGUSR1;
      for (auto& w : workers) {
        if (!w.ended) w.process->send_signal(SIGUSR1);
      }
      sig = 0;
    }
    if (sig != 0) {
      spdlog::warn("received {}: forwarding it to {} worker(s)", signal_name(sig),
                   workers.size() - ended);
      result.outcome = GenerationOutcome::kInterrupted;
      result.stop_signal = sig;
      stop_all(workers, sig, result);
      // Workers that handle the signal save a checkpoint and exit 75 (Note [Preemption]).
      bool requeue = false, all_clean = true;
      for (const auto& w : workers) {
        if (w.exit && is_requeue(*w.exit)) {
          requeue = true;
        } else if (!w.exit || !w.exit->ok()) {
          all_clean = false;
        }
      }
      if (requeue && all_clean) result.outcome = GenerationOutcome::kPreempted;
      return result;
    }
    for (auto& w : workers) {
      if (w.ended) continue;
      auto exit = w.process->try_wait();
      if (!exit) continue;
      w.ended = true;
      w.exit = exit;
      ++ended;
      if (w.spare_id >= 0) {
        spdlog::warn("spare {} (pid {}) {} while waiting; {} spare(s) left", w.spare_id,
                     w.process->pid(), exit->describe(), live_spares(workers));
        continue;
      }
      if (exit->ok()) {
        spdlog::debug("rank {} exited with code 0", w.rank);
        continue;
      }
      if (is_requeue(*exit)) {
        spdlog::info("rank {} exited {} (preempted)", w.rank, kRequeueCode);
        ++requeued;
        continue;
      }
      WorkerFailure failure{w.rank, w.local_rank, w.process->pid(), *exit, {}};
      if (recovered_in_process(workers, w, failure, to_start)) continue;
      // The output tail is collected after the others were stopped: reading it may wait
      // for the pipes to drain, which must not delay stopping the group.
      result.failures.push_back(std::move(failure));
      failed.push_back(&w);
    }
    for (const auto& [like, returns_to] : to_start) start_spare(workers, *like, returns_to);
    to_start.clear();
    if (options_.grow) grow_back(workers);
    if (result.failures.empty() && ranks_running() && options_.should_stop &&
        options_.should_stop()) {
      result.outcome = GenerationOutcome::kStopped;
      stop_all(workers, SIGTERM, result);
      return result;
    }
    if (!result.failures.empty()) {
      result.outcome = GenerationOutcome::kWorkerFailed;
      if (ended < workers.size()) {
        spdlog::error("rank {} {}; stopping the other {} worker(s)", result.failures[0].rank,
                      result.failures[0].exit.describe(), workers.size() - ended);
      }
      stop_all(workers, SIGTERM, result);
      for (std::size_t i = 0; i < failed.size(); ++i) {
        result.failures[i].last_lines = failed[i]->process->last_lines();
      }
      return result;
    }
  }
  if (ended < workers.size()) {
    spdlog::info("every rank ended; stopping {} unused spare(s)", workers.size() - ended);
    stop_all(workers, SIGTERM, result);
  }
  if (requeued > 0) result.outcome = GenerationOutcome::kPreempted;
  return result;
}

bool LocalWorkerGroup::recovered_in_process(Workers& workers, Running& dead,
                                            const WorkerFailure& failure, SpareStarts& to_start) {
  if (const Running* spare = hand_to_spare(workers, dead, failure)) {
    if (options_.replenish_spares) to_start.emplace_back(spare->spec, -1);
    return true;
  }
  if (options_.shrink && options_.shrink(failure)) {
    dead.replaced = true;
    to_start.emplace_back(dead.spec, dead.rank);
    return true;
  }
  return false;
}

std::size_t LocalWorkerGroup::live_spares(const Workers& workers) {
  std::size_t n = 0;
  for (const auto& w : workers) n += w.spare_id >= 0 && !w.ended;
  return n;
}

const LocalWorkerGroup::Running* LocalWorkerGroup::hand_to_spare(Workers& workers, Running& dead,
                                                                 const WorkerFailure& failure) {
  if (!options_.hand_to_spare) return nullptr;
  for (auto& w : workers) {
    if (w.spare_id < 0 || w.ended || w.returns_to >= 0) continue;
    if (!options_.hand_to_spare(failure, w.spare_id)) return nullptr;
    spdlog::warn("{}; spare {} (pid {}) takes its place", describe_failure(failure), w.spare_id,
                 w.process->pid());
    w.spare_id = -1;
    w.rank = dead.rank;
    w.local_rank = dead.local_rank;
    dead.replaced = true;
    return &w;
  }
  return nullptr;
}

void LocalWorkerGroup::start_spare(Workers& workers, const WorkerSpec& like, int returns_to) {
  WorkerSpec spec = like;
  spec.spare_id = next_spare_id_++;
  const std::string id_var = "DNALLM_SPARE_ID=";
  std::erase_if(spec.env, [&](const std::string& kv) { return kv.rfind(id_var, 0) == 0; });
  spec.env.push_back(id_var + std::to_string(spec.spare_id));
  extra_specs_.push_back(std::move(spec));
  const WorkerSpec& kept = extra_specs_.back();
  try {
    workers.push_back({&kept, spawner_.spawn(kept), false, std::nullopt, kept.spare_id, kept.rank,
                       kept.local_rank, false, returns_to});
    if (returns_to >= 0) {
      spdlog::info("started spare {} (pid {}) to return to rank {}'s place", kept.spare_id,
                   workers.back().process->pid(), returns_to);
    } else {
      spdlog::info("started spare {} (pid {}) in its place", kept.spare_id,
                   workers.back().process->pid());
    }
  } catch (const std::exception& e) {
    spdlog::error("cannot start another spare: {}", e.what());
  }
}

void LocalWorkerGroup::grow_back(Workers& workers) {
  for (auto& w : workers) {
    if (w.returns_to < 0 || w.spare_id < 0 || w.ended) continue;
    if (!options_.grow(w.returns_to, w.local_rank, w.spare_id)) continue;
    spdlog::warn("spare {} (pid {}) returns to rank {}'s place", w.spare_id, w.process->pid(),
                 w.returns_to);
    w.spare_id = -1;
    w.rank = w.returns_to;
    w.returns_to = -1;
  }
}

void LocalWorkerGroup::stop_all(Workers& workers, int first_signal, GenerationResult& result) {
  for (auto& w : workers) {
    if (!w.ended) w.process->send_signal(first_signal);
  }
  auto live = [&] {
    std::size_t n = 0;
    for (auto& w : workers) {
      if (!w.ended) {
        if (auto e = w.process->try_wait()) {
          w.ended = true;
          w.exit = e;
        }
      }
      if (!w.ended) ++n;
    }
    return n;
  };
  auto deadline = std::chrono::steady_clock::now() + options_.grace;
  while (live() > 0 && std::chrono::steady_clock::now() < deadline) {
    int sig = signals_.wait(options_.tick);
    if (sig == SIGUSR1) {  // a preemption notice is not a second stop signal
      for (auto& w : workers) {
        if (!w.ended) w.process->send_signal(SIGUSR1);
      }
      continue;
    }
    if (sig != 0) {
      spdlog::warn("received {} again: killing the workers now", signal_name(sig));
      if (result.outcome == GenerationOutcome::kInterrupted && result.stop_signal == 0) {
        result.stop_signal = sig;
      }
      break;
    }
  }
  if (live() > 0) {
    for (auto& w : workers) {
      if (!w.ended) {
        spdlog::warn("rank {} (pid {}) did not exit within {} ms: sending SIGKILL", w.rank,
                     w.process->pid(), options_.grace.count());
        w.process->send_signal(SIGKILL);
      }
    }
    // SIGKILL cannot be refused; the wait is short unless the process is stuck in the
    // kernel (uninterruptible I/O), where nothing better can be done than waiting.
    while (live() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int exit_code_for(const GenerationResult& result) {
  switch (result.outcome) {
    case GenerationOutcome::kSucceeded:
      return 0;
    case GenerationOutcome::kPreempted:
      return kRequeueCode;
    case GenerationOutcome::kInterrupted:
      return 128 + result.stop_signal;
    case GenerationOutcome::kStopped:
      return static_cast<int>(ExitCode::kPeerFailed);
    case GenerationOutcome::kWorkerFailed:
      break;
  }
  if (result.failures.empty()) return static_cast<int>(ExitCode::kPeerFailed);
  // Note [Launcher exit code]: one diagnosis that every other failure agrees with or follows.
  const int peer_failed = static_cast<int>(ExitCode::kPeerFailed);
  int diagnosis = 0;
  for (const auto& f : result.failures) {
    if (!f.exit.signaled && f.exit.code == peer_failed) continue;
    if (f.exit.signaled || !is_worker_diagnosis(f.exit.code)) return peer_failed;
    if (diagnosis != 0 && f.exit.code != diagnosis) return peer_failed;
    diagnosis = f.exit.code;
  }
  return diagnosis != 0 ? diagnosis : peer_failed;
}

bool should_restart(const GenerationResult& result, int restarts_done, int max_restarts) {
  if (result.outcome != GenerationOutcome::kWorkerFailed) return false;
  if (restarts_done >= max_restarts) return false;
  // The job is being preempted: a new generation would only be killed too, and would
  // swallow the notice (the requeued job resumes from the newest committed checkpoint).
  if (result.preempt_signal != 0) return false;
  return exit_code_for(result) == static_cast<int>(ExitCode::kPeerFailed);
}

std::string describe_failure(const WorkerFailure& f) {
  std::string out = fmt::format("rank {} (local rank {}, pid {}) {}", f.rank, f.local_rank, f.pid,
                                f.exit.describe());
  if (f.last_lines.empty()) return out + "; it wrote nothing";
  out += fmt::format("; its last {} line(s):", f.last_lines.size());
  for (const auto& l : f.last_lines) out += "\n    " + l;
  return out;
}

std::string restart_reason(const GenerationResult& result) {
  if (result.failures.empty()) return "";
  const WorkerFailure& f = result.failures.front();
  return fmt::format("rank {} {}", f.rank, f.exit.describe());
}

int RestartLoop::run() {
  LocalWorkerGroup group(spawner_, signals_, options_.group);
  std::string reason;
  while (true) {
    last_ = group.run(make_specs_(restarts_, reason));
    reason = restart_reason(last_);
    for (const auto& f : last_.failures) spdlog::error("{}", describe_failure(f));
    if (!should_restart(last_, restarts_, options_.max_restarts)) break;
    ++restarts_;
    spdlog::warn("restarting the local worker group ({} of {} restarts)", restarts_,
                 options_.max_restarts);
  }
  int code = exit_code_for(last_);
  if (last_.outcome == GenerationOutcome::kPreempted) {
    spdlog::warn(
        "the workers stopped after a stop signal (preempted); exiting with code {} "
        "so that the job is requeued",
        code);
  }
  if (last_.outcome == GenerationOutcome::kWorkerFailed) {
    spdlog::error("job failed after {} restart(s); exiting with code {}", restarts_, code);
  }
  return code;
}

}  // namespace dnallm::launcher
