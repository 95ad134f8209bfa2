// Real Slurm (tests/integration/fixtures/slurm.sh: munged, slurmctld, slurmd on this machine):
// sbatch the script `dnallm-launch --sbatch-script` prints for a tiny config, signal the
// batch shell with USR1 mid-run as Slurm's --signal=B:USR1@T would, and check the chain:
// the batch shell forwards it to srun, srun to dnallm-launch, the launcher to the 2
// dnallm-train workers; they checkpoint and exit 75; the script requeues the job; the
// requeued run resumes from that checkpoint and finishes to max_steps with exit code 0.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace dnallm::testing {
namespace {

namespace fs = std::filesystem;

const std::string kFixture = kSrc + "/tests/integration/fixtures/slurm.sh";

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool have(const char* program) {
  return run_command(fmt::format("command -v {} >/dev/null", program)) == 0;
}

// Starts the fixture's cluster and stops it at scope exit, also when the test fails: every
// job of the cluster is cancelled first so no job step (launcher, workers) outlives it.
class SlurmCluster {
 public:
  explicit SlurmCluster(std::string dir) : dir_(std::move(dir)) {
    std::string log;
    started_ = run_command(fmt::format("bash {} start {}", kFixture, dir_), &log) == 0;
    start_log_ = log;
    conf_ = dir_ + "/slurm.conf";
    ::setenv("SLURM_CONF", conf_.c_str(), 1);
  }
  ~SlurmCluster() {
    run_command(
        "scancel --full --signal=KILL --user=$(id -un) 2>/dev/null; "
        "for i in $(seq 100); do [ -z \"$(squeue -h -t R,CG 2>/dev/null)\" ] && break; "
        "sleep 0.1; done");
    run_command(fmt::format("bash {} stop {}", kFixture, dir_));
    ::unsetenv("SLURM_CONF");
  }
  bool started() const { return started_; }
  const std::string& start_log() const { return start_log_; }
  const std::string& dir() const { return dir_; }

  // One field of `scontrol show job`, e.g. "JobState" -> "RUNNING"; "" when absent.
  std::string job_field(const std::string& job, const std::string& field) const {
    std::string out;
    run_command(fmt::format("scontrol show job {}", job), &out);
    std::smatch m;
    if (std::regex_search(out, m, std::regex(field + "=([^ \n]*)"))) return m[1];
    return "";
  }

 private:
  std::string dir_, conf_, start_log_;
  bool started_ = false;
};

// Polls `done` every 100 ms up to `limit`; the limit only bounds a hung test.
template <typename F>
bool wait_for(F done, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return done();
}

int64_t last_logged_step(const std::string& metrics) {
  std::ifstream in(metrics);
  std::string line;
  int64_t step = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && !j.contains("event") && j.contains("step")) step = j["step"];
  }
  return step;
}

TEST(SlurmRequeue, Usr1CheckpointsRequeuesAndTheRequeuedRunResumesToTheEnd) {
  for (const char* p :
       {"sbatch", "srun", "scontrol", "scancel", "squeue", "slurmctld", "slurmd", "munged"}) {
    if (!have(p)) {
      GTEST_SKIP() << "Slurm is not installed (" << p
                   << " not found): install slurm-wlm and munge (scripts/install-deps.sh) to run "
                      "the real-Slurm test";
    }
  }
  if (::geteuid() != 0) {
    GTEST_SKIP() << "the Slurm fixture starts munged, slurmctld and slurmd as root; run as root";
  }
  const std::string dir = make_temp_dir("slurm_requeue");
  SlurmCluster cluster(dir + "/cluster");
  ASSERT_TRUE(cluster.started()) << cluster.start_log();

  const int kMaxSteps = 30;
  const std::string ckpt = dir + "/ckpt";
  const std::string metrics = dir + "/metrics.jsonl";
  const std::string output = dir + "/job.out";
  const std::string script = dir + "/job.sbatch";
  std::string gen_log;
  const std::string gen = fmt::format(
      "cd {src} && {bin}dnallm-launch --sbatch-script --nproc-per-node 2 --job-name dnallm-test "
      "--sbatch-output {out} --job-dir {dir}/job --signal-lead 120 "
      "--set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64 "
      "--set model.max_seq_length=64 --set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
      "--set training.max_steps={steps} --set training.micro_batch_size=6 "
      "--set training.lr=3e-3 --set training.lr_scheduler=constant --set training.warmup_steps=0 "
      "--set training.logging_steps=1 --set training.seed=7 --set parallel.backend=gloo "
      "--set data.dataloader_num_workers=1 "
      "--set checkpoint.dir={ckpt} --set checkpoint.save_steps=0 --set checkpoint.save_final=false "
      "--metrics-file {metrics} > {script}",
      fmt::arg("src", kSrc), fmt::arg("bin", kBin), fmt::arg("out", output), fmt::arg("dir", dir),
      fmt::arg("steps", kMaxSteps), fmt::arg("ckpt", ckpt), fmt::arg("metrics", metrics),
      fmt::arg("script", script));
  ASSERT_EQ(run_command(gen, &gen_log), 0) << gen << "\n" << gen_log;

  // The test delay keeps the tiny model's run going long enough to be signalled; sbatch
  // exports this environment to the job, srun and the launcher hand it to the workers.
  std::string job;
  ASSERT_EQ(run_command(fmt::format("DNALLM_TEST_STEP_DELAY_MS=150 OMP_NUM_THREADS=1 "
                                    "sbatch --parsable {}",
                                    script),
                        &job),
            0)
      << job;
  while (!job.empty() && (job.back() == '\n' || job.back() == ' ')) job.pop_back();
  auto context = [&] {
    return fmt::format("job {}\n--- script ---\n{}\n--- output ---\n{}\n--- scontrol ---\n{}", job,
                       read_all(script), read_all(output), [&] {
                         std::string s;
                         run_command("scontrol show job " + job, &s);
                         return s;
                       }());
  };

  // A few steps, then the preemption notice to the batch shell (what --signal=B:USR1 does).
  ASSERT_TRUE(wait_for([&] { return last_logged_step(metrics) >= 3; }, std::chrono::seconds(60)))
      << context();
  ASSERT_EQ(run_command("scancel --signal=USR1 --batch " + job), 0) << context();

  // The script requeues the job once the workers exited 75. Slurm holds a requeued job
  // for about two minutes (Reason=BeginTime); let it start now.
  ASSERT_TRUE(
      wait_for([&] { return cluster.job_field(job, "Restarts") == "1"; }, std::chrono::seconds(60)))
      << context();
  wait_for([&] { return cluster.job_field(job, "JobState") == "PENDING"; },
           std::chrono::seconds(30));
  // slurmd refuses a credential that is not newer, in whole seconds, than the revocation of
  // the job's previous run ("Job credential revoked"): a restart within the same second as
  // the requeue fails the job. Slurm's own hold (BeginTime) avoids that; skipping it must too.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  run_command(fmt::format("scontrol update JobId={} StartTime=now", job));
  ASSERT_TRUE(wait_for([&] { return cluster.job_field(job, "JobState") == "COMPLETED"; },
                       std::chrono::seconds(90)))
      << context();
  EXPECT_EQ(cluster.job_field(job, "ExitCode"), "0:0") << context();
  EXPECT_EQ(cluster.job_field(job, "Restarts"), "1") << context();

  // The first run: the chain of forwards, the checkpoint, exit 75 and the requeue.
  const std::string out = read_all(output);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m,
                                std::regex("preemption \\(received SIGUSR1\\): saving "
                                           "step ([0-9]+) and stopping")))
      << context();
  const int64_t stopped = std::stoll(m[1]);
  EXPECT_GE(stopped, 3);
  EXPECT_LT(stopped, kMaxSteps);
  for (const std::string& line : std::vector<std::string>{
           "dnallm: received SIGUSR1: forwarding it to the job step",
           "received SIGUSR1 (preemption notice): forwarding it to 2 worker(s)",
           "exiting with code 75 so that the job is requeued",
           "dnallm: the workers saved a checkpoint and stopped (exit 75): requeueing job " + job,
           "dnallm: job " + job + " (restart 1)"}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << context();
  }
  EXPECT_TRUE(fs::exists(fmt::format("{}/step_{:09d}/manifest.json", ckpt, stopped))) << context();
  // The requeued run resumed from that checkpoint and trained on to max_steps.
  EXPECT_TRUE(std::regex_search(
      out, std::regex(fmt::format("resumed from [^ ]*step_{:09d} at step {} ", stopped, stopped))))
      << context();
  EXPECT_NE(out.find("dnallm: srun exited with code 0"), std::string::npos) << context();
  // The resumed run appends to the metrics file: every step of both runs is there, and
  // the second run's lines start after the first run's at step stopped + 1.
  const auto losses = read_step_losses(metrics);
  ASSERT_FALSE(losses.empty()) << context();
  EXPECT_EQ(losses.begin()->first, 1) << context();
  EXPECT_EQ(losses.rbegin()->first, kMaxSteps) << context();
  EXPECT_EQ(losses.size(), static_cast<size_t>(kMaxSteps)) << context();
  {
    std::ifstream in(metrics);
    std::string line;
    std::vector<int64_t> steps;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      if (!j.contains("event") && j.contains("step")) steps.push_back(j["step"].get<int64_t>());
    }
    const auto restart = std::find(steps.begin(), steps.end(), stopped + 1);
    ASSERT_NE(restart, steps.end()) << context();
    EXPECT_TRUE(std::is_sorted(steps.begin(), restart)) << context();
    EXPECT_TRUE(std::is_sorted(restart, steps.end())) << context();
  }
  // The token file is the user's only.
  const auto perms = fs::status(dir + "/job/token").permissions();
  EXPECT_EQ(perms & (fs::perms::group_all | fs::perms::others_all), fs::perms::none);
}

}  // namespace
}  // namespace dnallm::testing
