// `dnallm-launch --sbatch-script`: a ready sbatch file for the launch options given, as a
// pure function of them (printed, and unit-tested by content).
//
// What the script does (docs/slurm.md), in order:
//   1. #SBATCH: --nodes, --ntasks-per-node=1 (one dnallm-launch per node), --cpus-per-task,
//      --gpus-per-node (GPU workers only), --requeue, --signal=B:USR1@<lead>,
//      --open-mode=append (a requeued run appends to the same output), job name, output and
//      any extra lines the user asked for.
//   2. MASTER_PORT = 20000 + SLURM_JOB_ID % 20000 unless set (the rule cluster/ applies
//      too): the same on every node, and on every requeue of the job.
//   3. the job token: <job dir>/token, created once with umask 077 (mode 0600, the user's
//      only) and reused after a requeue; exported as DNALLM_JOB_TOKEN, which srun hands to
//      every node's dnallm-launch.
//   4. `srun --ntasks-per-node=1 dnallm-launch ...` in the background; the batch shell traps
//      USR1 and TERM (with B: Slurm signals the batch shell only) and forwards them to srun,
//      which forwards them to the dnallm-launch of every node, which forwards them to the
//      workers (Note [Preemption] in worker/train/preemption.hpp).
//   5. srun's exit code 75 (the workers saved a checkpoint and stopped): `scontrol requeue
//      $SLURM_JOB_ID`; the requeued job resumes from the checkpoint (checkpoint.resume =
//      "auto"). Any other code is the script's exit code.
#pragma once

#include <string>
#include <vector>

namespace dnallm::launcher {

struct SbatchOptions {
  std::string job_name = "dnallm";
  std::string output = "dnallm-%j.out";  // sbatch --output (%j = job id)
  int nodes = 1;
  int nproc_per_node = 1;   // workers per node
  bool gpus = false;        // workers are GPUs: --gpus-per-node=nproc_per_node
  int cpus_per_task = 0;    // 0: nproc_per_node (one core per worker at least)
  int signal_lead_s = 120;  // --signal=B:USR1@lead: seconds before the time limit
  std::string job_dir;      // token and state; "" = $SLURM_SUBMIT_DIR/dnallm-job-$SLURM_JOB_ID
  std::string chdir;        // #SBATCH --chdir (relative paths in the config); "" = none
  std::vector<std::string> extra_sbatch;  // more #SBATCH lines, e.g. "--time=04:00:00"
  // The dnallm-launch invocation run on every node by srun (absolute path first).
  std::vector<std::string> launch_argv;
};

// The sbatch file. Throws Error(kUsage) for values sbatch would refuse (nodes < 1, a
// negative lead, an extra line that is not an option).
std::string make_sbatch_script(const SbatchOptions& options);

// Quotes `s` for a POSIX shell when it has characters outside [A-Za-z0-9-_./=:,@%+].
std::string shell_quote(const std::string& s);

}  // namespace dnallm::launcher
