// Note [Worker environment]: what dnallm-launch tells each worker through environment
// variables, as one typed struct. WorkerEnv::from_environment() and to_environment() (in
// worker_env.cpp, side by side) are the only places the variable names are spelled: the
// launcher builds every child's environment with to_environment(), dnallm-train reads its own
// with from_environment(). The variables (DESIGN.md, "Contracts"):
//   torchrun-compatible: RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK
//     GROUP_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT
//     TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID, and OMP_NUM_THREADS;
//   dnallm-launch's own: DNALLM_GENERATION DNALLM_JOB_TOKEN DNALLM_EXTERNAL_COORDINATOR
//     DNALLM_PROGRESS_FILE DNALLM_RESTART_REASON DNALLM_STOP_GRACE_MS
//     DNALLM_IN_PROCESS_RECOVERY DNALLM_SPARE_ID;
//   test-only hooks (WorkerTestHooks): DNALLM_TEST_STEP_DELAY_MS
//     DNALLM_TEST_KILL_AFTER_SAVE_STEP DNALLM_TEST_STAGE_HOST_BUFFERS.
// cluster::detect_topology still reads the torchrun, OpenMPI and Slurm variables for the
// worker's place in the job (a worker may be started without dnallm-launch).
// Torch-free and pure: no global state, parsing errors are Error(kUsage) naming the variable.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace dnallm {

// Name -> value, as cluster::EnvMap (cluster/topology.hpp) and cluster::current_env().
using EnvVars = std::map<std::string, std::string>;

// Hooks that integration tests need in the real dnallm-train binary, and nothing else does.
// Off unless their variable is set.
struct WorkerTestHooks {
  // DNALLM_TEST_STEP_DELAY_MS: sleep this long after every step, so that a test can signal a
  // run of a tiny model while it still runs, however fast the machine is.
  std::chrono::milliseconds step_delay{0};
  // DNALLM_TEST_KILL_AFTER_SAVE_STEP: SIGKILL the worker right after handing step K's
  // checkpoint to the writer (the previous one is committed, K's write is in flight). 0: off.
  int64_t kill_after_save_step = 0;
  // DNALLM_TEST_STAGE_HOST_BUFFERS=1: take the staged-collectives path (Note [Staged
  // collectives], worker/parallel/device_group.hpp) on CPU too.
  bool stage_host_buffers = false;

  bool operator==(const WorkerTestHooks& o) const {
    return step_delay == o.step_delay && kill_after_save_step == o.kill_after_save_step &&
           stage_host_buffers == o.stage_host_buffers;
  }
};

struct WorkerEnv {
  // torchrun-compatible; unset when the variable is absent.
  std::optional<int> rank, local_rank, world_size, local_world_size;
  std::optional<int> group_rank, group_world_size;  // node rank, node count
  std::optional<std::string> master_addr;           // the coordinator (or rank 0's store)
  std::optional<int> master_port;
  std::optional<int> restart_count, max_restarts;  // TORCHELASTIC_*
  std::optional<std::string> run_id;
  // Exported by the launcher only when its own environment lacks it (Note [OMP_NUM_THREADS]
  // in launcher/launch_plan.hpp); kept as text (OpenMP accepts lists such as "4,2").
  std::optional<std::string> omp_num_threads;

  // The restart generation (docs/elastic.md): names the generation's communicator and store
  // keys ("g<N>"); unset outside dnallm-launch.
  std::optional<int64_t> generation;
  // The job token every coordinator request carries ("" : none).
  std::string job_token;
  // Set by the elastic agent: the coordinator is hosted by a launcher (rank 0 hosts no
  // store) and keeps the checkpoint commit registry.
  bool external_coordinator = false;
  // Elastic agents watch progress through this file ("": none): the last completed step.
  std::string progress_file;
  // Why the previous generation ended ("" for the first): rank 0's "restart" metrics line.
  std::string restart_reason;
  // Note [In-process recovery] (worker/train/in_process_recovery.hpp): the agent keeps warm
  // spares (dnallm-launch --spare-workers), so a survivor of a failed collective waits for a
  // spare to take the dead rank's place instead of exiting (DNALLM_IN_PROCESS_RECOVERY=1).
  bool in_process_recovery = false;
  // This worker is spare number N of its agent (DNALLM_SPARE_ID): it starts, then waits at
  // the coordinator until it is given a dead rank's place. Unset for ranks.
  std::optional<int> spare_id;
  // Note [Stop while blocked] (worker/train/stop_watchdog.hpp): must stay below the
  // launcher's --grace-period (10 s) so that the worker, not SIGKILL, ends a blocked worker.
  std::chrono::milliseconds stop_grace{5000};

  WorkerTestHooks test;

  // Reads every variable above from `env`; absent ones keep their defaults. Throws
  // Error(kUsage) naming the variable when a number does not parse.
  static WorkerEnv from_environment(const EnvVars& env);
  // Writes every field that is set (or differs from its default) into `env`, replacing what
  // is there. Others are left as `env` has them, so a test hook or DNALLM_STOP_GRACE_MS given
  // to the launcher reaches its workers; only DNALLM_RESTART_REASON is removed when empty (a
  // reason belongs to one generation). OMP_NUM_THREADS is written only when `env` lacks it.
  void to_environment(EnvVars& env) const;

  bool operator==(const WorkerEnv& o) const;
};

// DNALLM_JOB_TOKEN in `env` ("" when unset): for the launcher and the coordinator, which read
// only that variable of their own environment.
std::string job_token_of(const EnvVars& env);
// The same in this process's environment.
std::string job_token_of();

}  // namespace dnallm
