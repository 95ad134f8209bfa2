// Note [Preemption] (the definition for both sides; launcher/worker_group.hpp refers here):
// a scheduler about to preempt the job (Slurm's --signal=B:USR1@T, forwarded by the batch
// script, srun and dnallm-launch, or a forwarded SIGTERM) asks the workers to save and stop.
//   1. dnallm-train installs SIGUSR1 and SIGTERM handlers first thing
//      (install_preemption_handlers); dnallm-launch starts workers with both blocked (Note
//      [Early stop signals] in launcher/spawner.hpp), so one that arrived earlier is delivered
//      then. The handler only stores the first signal's number (a lock-free atomic:
//      async-signal-safe). Repeats are ignored on purpose: the same notice often arrives
//      twice (srun signals every process of the step and dnallm-launch forwards it too); a
//      stuck worker is ended by the launcher's SIGKILL after its grace period, and SIGINT
//      keeps its default action.
//   2. After every step every rank sums its flag over all ranks (Preemption's step hook, last
//      in TrainerOptions::after_step: one scalar allreduce, a max in effect), so all ranks stop
//      at the same step even when the signal reached them at different steps.
//   3. Each rank then saves that step synchronously (Checkpointer::finish: waits for the writer
//      and rank 0's commit; also with checkpoint.save_steps = 0), rank 0 writes
//      {"event":"preempted","step","reason","exit_code":75}, the hook returns
//      StepAction::kStop and Trainer::run() returns without the end-of-run work; the worker
//      exits with ExitCode::kRequeue (75).
//   4. A worker blocked outside a step is ended by the StopWatchdog (Note [Stop while blocked]
//      in worker/train/stop_watchdog.hpp) with 75 and no new checkpoint.
//   5. The launcher (launcher/worker_group.hpp): a worker that exits 75 did not fail. When
//      every worker ended with 0 or 75 and at least one with 75 (also after a forwarded
//      SIGINT/SIGTERM, within the grace period), the generation's outcome is kPreempted, the
//      group is not restarted in-job, and dnallm-launch exits 75 so that the batch script can
//      requeue the job (docs/slurm.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "worker/train/stop_watchdog.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {

class Checkpointer;

// Step 1 of the Note: installs the handlers and unblocks SIGUSR1/SIGTERM. Call first in main,
// before anything that can block. Process-wide (a signal handler needs the one global flag).
void install_preemption_handlers();

// Owned by dnallm-train's main for the whole run (training thread), after the handlers.
class Preemption {
 public:
  // Starts the StopWatchdog (`stop_grace`: DNALLM_STOP_GRACE_MS) over the handlers' flag;
  // `checkpoint_dir` is named in its message.
  Preemption(std::chrono::milliseconds stop_grace, const std::string& checkpoint_dir);
  Preemption(const Preemption&) = delete;
  Preemption& operator=(const Preemption&) = delete;

  // The watchdog's step boundary, as a hook (Note [Stop while blocked]): before the checkpoint
  // hook, so that a save in progress counts as past the boundary.
  StepHook boundary_hook();
  // Steps 2-3 of the Note, as a hook; last in the list. Collective: every rank's hook runs
  // after every step. `checkpointer` must outlive the trainer's run().
  StepHook stop_hook(Checkpointer& checkpointer);

  // The step the run stopped at (a preemption checkpoint of it is committed); nullopt when
  // the run was not preempted.
  std::optional<int64_t> stopped_at() const { return stopped_at_; }
  // 0, or ExitCode::kRequeue (75) after logging why, when the run was preempted.
  int exit_code(const std::string& checkpoint_dir) const;
  // The stop signal this process received (SIGUSR1, SIGTERM), 0 while none came: for loops
  // that wait outside a step (a spare waiting for a place, Note [In-process recovery]).
  static int signal_received();

 private:
  StopWatchdog watchdog_;
  std::optional<int64_t> stopped_at_;
};

}  // namespace dnallm::train
