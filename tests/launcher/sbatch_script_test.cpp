// dnallm-launch --sbatch-script: the script's content (make_sbatch_script), that bash parses
// it, and the CLI's choices (absolute paths, GPUs from the config, refused options).
#include "launcher/sbatch_script.hpp"

#include <cstdio>
#include <fstream>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "launch_runner.hpp"
#include "tests/support/process.hpp"

namespace dnallm::launcher {
namespace {

using testing::LaunchResult;
using testing::run_launch;
using testing::TempDir;

using dnallm::testing::contains;

SbatchOptions two_nodes() {
  SbatchOptions o;
  o.nodes = 2;
  o.nproc_per_node = 4;
  o.launch_argv = {"/opt/dnallm/bin/dnallm-launch",
                   "--nproc-per-node",
                   "4",
                   "--config",
                   "/home/me/run.toml",
                   "--set",
                   "training.lr=1e-3"};
  return o;
}

// bash -n on the text: the script must at least parse.
int bash_syntax_check(const std::string& script) {
  TempDir dir;
  const std::string path = dir.path() + "/job.sbatch";
  { std::ofstream(path) << script; }
  return std::system(("bash -n " + path + " 2>&1").c_str());
}

TEST(SbatchScript, HeaderRequestsOneLauncherPerNodeRequeueAndTheSignal) {
  const std::string s = make_sbatch_script(two_nodes());
  EXPECT_EQ(s.rfind("#!/bin/bash\n", 0), 0u) << s;
  for (const char* line :
       {"#SBATCH --job-name=dnallm\n", "#SBATCH --output=dnallm-%j.out\n",
        "#SBATCH --open-mode=append\n", "#SBATCH --nodes=2\n", "#SBATCH --ntasks-per-node=1\n",
        "#SBATCH --cpus-per-task=4\n", "#SBATCH --requeue\n", "#SBATCH --signal=B:USR1@120\n"}) {
    EXPECT_TRUE(contains(s, line)) << line << "\n" << s;
  }
  EXPECT_FALSE(contains(s, "--gpus-per-node")) << "CPU workers: no GPUs requested\n" << s;
  EXPECT_FALSE(contains(s, "--chdir")) << s;
  EXPECT_EQ(bash_syntax_check(s), 0) << s;
}

TEST(SbatchScript, GpusLeadCpusChdirAndExtraLines) {
  SbatchOptions o = two_nodes();
  o.gpus = true;
  o.cpus_per_task = 32;
  o.signal_lead_s = 300;
  o.job_name = "dna bert";
  o.chdir = "/scratch/me/run";
  o.extra_sbatch = {"--time=04:00:00", "--partition=gpu"};
  const std::string s = make_sbatch_script(o);
  EXPECT_TRUE(contains(s, "#SBATCH --gpus-per-node=4\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --cpus-per-task=32\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --signal=B:USR1@300\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --job-name='dna bert'\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --chdir=/scratch/me/run\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --time=04:00:00\n#SBATCH --partition=gpu\n")) << s;
  // Every #SBATCH line comes before the first command (sbatch stops reading them there).
  const auto last_directive = s.rfind("#SBATCH");
  EXPECT_LT(last_directive, s.find("set -u")) << s;
  EXPECT_EQ(bash_syntax_check(s), 0) << s;
}

TEST(SbatchScript, BodyRunsSrunForwardsUsr1AndRequeuesOn75) {
  const std::string s = make_sbatch_script(two_nodes());
  // The launch on every node, in the background so that the traps run while it does.
  EXPECT_TRUE(contains(s,
                       "srun --ntasks-per-node=1 --kill-on-bad-exit=0 "
                       "/opt/dnallm/bin/dnallm-launch --nproc-per-node 4 --config "
                       "/home/me/run.toml --set training.lr=1e-3 &\n"))
      << s;
  EXPECT_TRUE(contains(s, "trap 'forward USR1' USR1\n")) << s;
  EXPECT_TRUE(contains(s, "trap 'forward TERM' TERM\n")) << s;
  EXPECT_TRUE(contains(s, "kill -s \"$1\" \"$srun_pid\"")) << s;
  EXPECT_TRUE(contains(s, "if [ \"$rc\" -eq 75 ]; then")) << s;
  EXPECT_TRUE(contains(s, "scontrol requeue \"$SLURM_JOB_ID\"")) << s;
  // Port from the job id, the same rule as cluster/ uses.
  EXPECT_TRUE(contains(s, "export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"))
      << s;
  // Token: the user's only (umask 077), kept across requeues, exported to srun.
  EXPECT_TRUE(contains(s, "umask 077")) << s;
  EXPECT_TRUE(contains(s, "dnallm-job-$SLURM_JOB_ID")) << s;
  EXPECT_TRUE(contains(s, "export DNALLM_JOB_TOKEN")) << s;
}

TEST(SbatchScript, RefusesWhatSbatchWouldRefuse) {
  SbatchOptions o = two_nodes();
  o.nodes = 0;
  EXPECT_THROW(make_sbatch_script(o), Error);
  o = two_nodes();
  o.signal_lead_s = -1;
  EXPECT_THROW(make_sbatch_script(o), Error);
  o = two_nodes();
  o.extra_sbatch = {"time=1:00"};
  try {
    make_sbatch_script(o);
    FAIL() << "accepted an extra line that is not an option";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_TRUE(contains(e.what(), "--sbatch-arg 'time=1:00'")) << e.what();
  }
}

TEST(SbatchScript, ShellQuote) {
  EXPECT_EQ(shell_quote("a/b-c_d.toml"), "a/b-c_d.toml");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote(""), "''");
}

TEST(SbatchScriptCli, PrintsAbsolutePathsAndTakesGpusFromTheConfig) {
  TempDir dir;
  const std::string config = dir.path() + "/run.toml";
  { std::ofstream(config) << "[training]\ndevice = \"cuda\"\n"; }
  LaunchResult r =
      run_launch({"--sbatch-script", "--nnodes", "3", "--nproc-per-node", "2", "--config", config,
                  "--set", "training.max_steps=5", "--metrics-file", "m.jsonl", "--signal-lead",
                  "60", "--sbatch-arg=--time=01:00:00"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string& s = r.out;
  EXPECT_TRUE(contains(s, "#SBATCH --nodes=3\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --gpus-per-node=2\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --signal=B:USR1@60\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --time=01:00:00\n")) << s;
  EXPECT_TRUE(contains(s, "#SBATCH --chdir=/")) << s;
  EXPECT_TRUE(contains(s, "/bin/dnallm-launch --nproc-per-node 2 --config " + config +
                              " --set training.max_steps=5 --metrics-file /"))
      << s;
  EXPECT_EQ(bash_syntax_check(s), 0) << s;
}

TEST(SbatchScriptCli, CpuConfigRequestsNoGpusUnlessAsked) {
  LaunchResult cpu = run_launch({"--sbatch-script", "--nproc-per-node", "2"});
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_FALSE(contains(cpu.out, "--gpus-per-node")) << cpu.out;
  LaunchResult gpu = run_launch({"--sbatch-script", "--nproc-per-node", "2", "--sbatch-gpus"});
  ASSERT_EQ(gpu.exit_code, 0) << gpu.err;
  EXPECT_TRUE(contains(gpu.out, "#SBATCH --gpus-per-node=2\n")) << gpu.out;
}

TEST(SbatchScriptCli, RefusesAutoNprocAndElasticOptionsWithUsageExit) {
  LaunchResult a = run_launch({"--sbatch-script", "--nproc-per-node", "auto"});
  EXPECT_EQ(a.exit_code, 2);
  EXPECT_TRUE(contains(a.err, "needs --nproc-per-node as a number")) << a.err;
  LaunchResult b = run_launch({"--sbatch-script", "--standalone"});
  EXPECT_EQ(b.exit_code, 2);
  EXPECT_TRUE(contains(b.err, "static Slurm job")) << b.err;
  LaunchResult c = run_launch({"--sbatch-script", "--max-restarts", "2"});
  EXPECT_EQ(c.exit_code, 2);
  EXPECT_TRUE(contains(c.err, "requeued by Slurm")) << c.err;
}

}  // namespace
}  // namespace dnallm::launcher
