// Running the local workers: one generation (LocalWorkerGroup) and the restart loop
// around it (RestartLoop). The failure and exit-code policy are pure functions.
//
// Spares (WorkerSpec::spare_id >= 0, Note [In-process recovery]) run beside the ranks: a spare
// that ends before it took a place is logged and forgotten; one that took a place is a rank
// from then on (GroupOptions::replenish_spares: another spare starts in its stead); the
// generation ends when every rank has, and the spares left are then stopped (SIGTERM; they
// exit 0).
//
// One generation, as LocalWorkerGroup::run() does it:
//   1. spawn every worker (on a spawn error: stop those started, rethrow);
//   2. every tick (StopSignals::wait, GroupOptions::tick) reap ended workers;
//      a worker that ended with a non-zero code or a signal is a failure "on its own";
//   3. all ended with 0: succeeded;
//   4. a failure: SIGTERM the others' process groups, wait up to `grace`, SIGKILL the rest;
//   5. a stop signal (SIGINT/SIGTERM) for the launcher: forward it to every worker's group,
//      wait up to `grace`, SIGKILL the rest. A second stop signal kills at once.
//   6. every tick, GroupOptions::should_stop (when set) is asked; true stops the workers
//      as in step 4 (outcome kStopped): the elastic agent uses it for heartbeats and to
//      leave a generation the coordinator has replaced.
//   7. SIGUSR1 for the launcher: forwarded to every live worker's group; monitoring goes
//      on (Note [Preemption]).
// Workers that end after step 4 or 5 started were stopped by us and are not failures.
//
// See Note [Preemption] (worker/train/preemption.hpp, both sides: the worker saves and exits
// 75; step 5 there is this launcher's part): a worker that exits 75 did not fail, and a
// generation whose workers all ended with 0 or 75, at least one with 75, is kPreempted.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "launcher/spawner.hpp"
#include "launcher/stop_signals.hpp"

namespace dnallm::launcher {

struct WorkerFailure;

struct GroupOptions {
  std::chrono::milliseconds grace{10000};  // SIGTERM (or forwarded signal) -> SIGKILL
  std::chrono::milliseconds tick{50};      // monitor loop period
  // Called on the monitor thread once per tick while workers run; must not block long.
  std::function<bool()> should_stop;
  // Note [In-process recovery]: a rank failed and a live spare (WorkerSpec::spare_id >= 0) is
  // left: true when the spare `spare_id` was given the failed rank's place, which it then holds
  // (the failure is not one of the generation); false: the failure counts as usual. Unset: no
  // spare is ever used.
  std::function<bool(const WorkerFailure& failure, int spare_id)> hand_to_spare;
  // After a spare took a place, start another (a new spare id) so that as many stay warm.
  bool replenish_spares = false;
  // Note [Shrink and grow] (worker/train/in_process_recovery.hpp): a rank failed and no spare
  // took its place: true when the survivors go on without it (elastic.shrink), after which a
  // fresh worker is started in its stead as a spare that returns to the place. Unset: no shrink.
  std::function<bool(const WorkerFailure& failure)> shrink;
  // Asked every tick for such a returning spare `spare_id` (local rank `local_rank`): true when
  // it was given place `place` back (it then is that rank).
  std::function<bool(int place, int local_rank, int spare_id)> grow;
};

struct WorkerFailure {
  int rank = 0;
  int local_rank = 0;
  int pid = 0;
  WorkerExit exit;
  std::vector<std::string> last_lines;
};

// kStopped: GroupOptions::should_stop asked for it (step 6). kPreempted: the workers saved a
// checkpoint and exited 75 (Note [Preemption]).
enum class GenerationOutcome { kSucceeded, kWorkerFailed, kInterrupted, kStopped, kPreempted };

struct GenerationResult {
  GenerationOutcome outcome = GenerationOutcome::kSucceeded;
  // Workers that failed on their own, in the order seen (lowest rank first within a tick).
  std::vector<WorkerFailure> failures;
  int stop_signal = 0;     // kInterrupted (or kPreempted by one): the signal the launcher received
  int preempt_signal = 0;  // SIGUSR1 when one was forwarded (step 7), else 0
};

// Runs one generation of workers to its end. Called from one thread; blocks until every
// worker it started has been reaped.
class LocalWorkerGroup {
 public:
  LocalWorkerGroup(Spawner& spawner, StopSignals& signals, GroupOptions options)
      : spawner_(spawner), signals_(signals), options_(options) {}

  GenerationResult run(const std::vector<WorkerSpec>& specs);

 private:
  struct Running;
  // A deque: a replacement spare is added while pointers to the others are held.
  using Workers = std::deque<Running>;
  // Signals every live worker, waits up to grace (a stop signal meanwhile cuts it
  // short), then SIGKILLs and reaps what is left.
  void stop_all(Workers& workers, int first_signal, GenerationResult& result);
  // Note [In-process recovery]: GroupOptions::hand_to_spare for `dead`'s failure with the
  // first live spare; true when a spare took its place.
  // Returns the spare, null when none took the place.
  const Running* hand_to_spare(Workers& workers, Running& dead, const WorkerFailure& failure);
  // Spares to start after a tick: (like, the place it returns to or -1).
  using SpareStarts = std::vector<std::pair<const WorkerSpec*, int>>;
  // Note [In-process recovery], Note [Shrink and grow]: whether `dead`'s failure was taken in
  // process: a spare took its place (another is queued when spares are replenished), or the
  // group shrank (a spare returning to the place is queued).
  bool recovered_in_process(Workers& workers, Running& dead, const WorkerFailure& failure,
                            SpareStarts& to_start);
  static std::size_t live_spares(const Workers& workers);
  // Starts a new spare like `like` (its DNALLM_SPARE_ID set to the next free id) so that
  // GroupOptions::spare_workers stay warm, or (`returns_to` >= 0) one that returns to that
  // place (Note [Shrink and grow]); a spawn error is logged, not thrown.
  void start_spare(Workers& workers, const WorkerSpec& like, int returns_to = -1);
  // GroupOptions::grow for every returning spare still waiting.
  void grow_back(Workers& workers);
  std::deque<WorkerSpec> extra_specs_;  // the replacement spares' specs, for one run()
  int next_spare_id_ = 0;

  Spawner& spawner_;
  StopSignals& signals_;
  GroupOptions options_;
};

// Note [Launcher exit code]: 0 when the group succeeded; 75 (kRequeue) when it was
// preempted (Note [Preemption]); 128 + signal when the launcher was stopped by SIGINT/SIGTERM
// and the workers did not all exit 75 (the shell convention); for a worker failure, the failing
// worker's own code when it is 2 (usage), 3 (bad data) or 5 (checkpoint corrupt) and every
// worker that failed on its own agrees on it — those are the worker's diagnosis (Note [Worker
// diagnosis] in core/error.hpp) and a script can act on them — else 4 (kPeerFailed): a rank crashed
// or was killed. A worker that exited 4 itself saw a peer go, which the diagnosing worker
// explains: it neither disagrees nor hides the diagnosis (ranks refusing a configuration one
// by one leave the slower ones in a collective with the first that left).
int exit_code_for(const GenerationResult& result);

// Whether the group is started again: only after a worker failure, while restarts are
// left, and not when exit_code_for() is 2, 3 or 5 — a bad configuration, bad data or a
// corrupt checkpoint fail the same way every time.
bool should_restart(const GenerationResult& result, int restarts_done, int max_restarts);

// "rank 1 (local rank 1, pid 42) exited with code 7; its last 2 lines:\n  a\n  b".
std::string describe_failure(const WorkerFailure& failure);

// One line for the next generation (DNALLM_RESTART_REASON, the worker's "restart" metrics
// line): "rank 1 exited with code 7", "rank 0 was killed by signal 9 (SIGKILL)".
std::string restart_reason(const GenerationResult& result);

struct RestartOptions {
  int max_restarts = 0;
  GroupOptions group;
};

// Runs generations until one succeeds, is interrupted, or fails without a restart left.
// `make_specs(restart_count, restart_reason)` builds each generation's workers (the
// environment carries both; the reason is "" for the first generation, else
// restart_reason() of the failure that caused the restart). Failures are logged (describe_failure)
// at error level; restarts at warning level. Kept as a class so the elastic, multi-node agent can
// grow from it (rendezvous with the coordinator before each generation).
class RestartLoop {
 public:
  using SpecFactory =
      std::function<std::vector<WorkerSpec>(int restart_count, const std::string& restart_reason)>;

  RestartLoop(Spawner& spawner, StopSignals& signals, RestartOptions options,
              SpecFactory make_specs)
      : spawner_(spawner),
        signals_(signals),
        options_(options),
        make_specs_(std::move(make_specs)) {}

  // Returns the launcher's exit code (Note [Launcher exit code]).
  int run();

  int restarts() const { return restarts_; }
  const GenerationResult& last_result() const { return last_; }

 private:
  Spawner& spawner_;
  StopSignals& signals_;
  RestartOptions options_;
  SpecFactory make_specs_;
  int restarts_ = 0;
  GenerationResult last_;
};

}  // namespace dnallm::launcher
