// Preemption (Note [Preemption] in launcher/worker_group.hpp and worker/train_main.cpp):
// dnallm-launch with 2 real dnallm-train workers over Gloo is signalled mid-run; the workers
// agree on a step, commit a checkpoint of it, exit 75, and the launcher exits 75. A rerun
// with checkpoint.resume=auto resumes from that step and its losses equal, bit for bit, those
// of an uninterrupted run (CPU fp32, the deterministic settings of resume_test.cpp).
#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace dnallm::testing {
namespace {

namespace fs = std::filesystem;

// The launcher command for a tiny BERT on 2 workers (global batch 12, constant LR, so runs
// with different max_steps share their first steps).
std::string launch_command(const std::string& ckpt, const std::string& metrics, int steps) {
  return fmt::format(
      "{bin}dnallm-launch --nproc-per-node 2 --grace-period 60 "
      "--set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64 "
      "--set model.max_seq_length=64 --set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
      "--set training.max_steps={steps} --set training.micro_batch_size=6 "
      "--set training.grad_accum_steps=1 --set training.lr=3e-3 "
      "--set training.lr_scheduler=constant --set training.warmup_steps=0 "
      "--set training.logging_steps=1 --set training.seed=7 "
      "--set data.dataloader_num_workers=1 --set parallel.backend=gloo "
      "--set checkpoint.dir={ckpt} --set checkpoint.save_steps=0 --set checkpoint.keep_last=0 "
      "--set checkpoint.save_final=false --metrics-file {metrics}",
      fmt::arg("bin", kBin), fmt::arg("steps", steps), fmt::arg("ckpt", ckpt),
      fmt::arg("metrics", metrics));
}

// Runs launch_command(ckpt, metrics, steps) from the source folder to its end: its exit code,
// its output in `log`.
int run_launch(const std::string& ckpt, const std::string& metrics, int64_t steps,
               std::string* log) {
  return run_command(
      fmt::format("cd {} && {}", kSrc, launch_command(ckpt, metrics, static_cast<int>(steps))),
      log);
}

struct Preempted {
  int rc = -1;
  std::string log;
  int64_t step = -1;  // from the "preempted" metrics line
};

// Starts the launcher in the background, waits until rank 0 logged step 3, sends `sig` to
// the launcher and waits for it. The run is long (max_steps 100000, 50 ms of test delay
// after each step) so it is still running whatever the machine's speed.
Preempted run_and_signal(const std::string& dir, int sig) {
  const std::string metrics = dir + "/preempted.jsonl";
  const std::string cmd = fmt::format(
      "{{ cd {src} && {{ DNALLM_TEST_STEP_DELAY_MS=50 {launch} & }} ; pid=$! ; "
      "for i in $(seq 1200); do grep -q '\"step\":3,' {metrics} 2>/dev/null && break; "
      "sleep 0.1; done ; kill -{sig} $pid ; "
      // A launcher that ignored the signal would train for hours: SIGKILL it after 60 s (its
      // workers die with it) so the test fails with 137 instead of hanging.
      "for i in $(seq 600); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done ; "
      "kill -KILL $pid 2>/dev/null ; wait $pid ; }}",
      fmt::arg("src", kSrc), fmt::arg("launch", launch_command(dir + "/ckpt", metrics, 100000)),
      fmt::arg("metrics", metrics), fmt::arg("sig", sig));
  Preempted p;
  p.rc = run_command(cmd, &p.log);
  p.log = cmd + "\n" + p.log;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "preempted") p.step = j["step"].get<int64_t>();
  }
  return p;
}

std::string step_dir(const std::string& ckpt, int64_t step) {
  return fmt::format("{}/step_{:09d}", ckpt, step);
}

TEST(Preemption, Sigusr1CheckpointsExits75AndResumesBitIdentical) {
  const std::string dir = make_temp_dir("preempt_usr1");
  Preempted p = run_and_signal(dir, SIGUSR1);
  ASSERT_EQ(p.rc, 75) << p.log;
  ASSERT_GE(p.step, 3) << "no preempted metrics line\n" << p.log;
  EXPECT_NE(p.log.find("received SIGUSR1 (preemption notice)"), std::string::npos) << p.log;
  EXPECT_NE(p.log.find("exiting with code 75"), std::string::npos) << p.log;
  // The checkpoint of the step they stopped at is committed and is the newest.
  EXPECT_TRUE(fs::exists(step_dir(dir + "/ckpt", p.step) + "/manifest.json")) << p.log;
  EXPECT_TRUE(fs::exists(step_dir(dir + "/ckpt", p.step) + "/shard_00001.dnc")) << p.log;
  EXPECT_FALSE(fs::exists(step_dir(dir + "/ckpt", p.step + 1))) << "stopped past the step";
  std::ifstream latest(dir + "/ckpt/LATEST");
  std::string latest_name;
  std::getline(latest, latest_name);
  EXPECT_NE(latest_name.find(fmt::format("step_{:09d}", p.step)), std::string::npos) << latest_name;

  // Resume to 3 steps past the preemption, and an uninterrupted run to the same step.
  const int64_t last = p.step + 3;
  std::string resumed_log;
  const int resumed_rc = run_launch(dir + "/ckpt", dir + "/resumed.jsonl", last, &resumed_log);
  ASSERT_EQ(resumed_rc, 0) << resumed_log;
  EXPECT_NE(resumed_log.find("resumed from"), std::string::npos) << resumed_log;
  std::string ref_log;
  const int ref_rc = run_launch(dir + "/ref_ckpt", dir + "/ref.jsonl", last, &ref_log);
  ASSERT_EQ(ref_rc, 0) << ref_log;

  const auto resumed = read_step_losses(dir + "/resumed.jsonl");
  const auto ref = read_step_losses(dir + "/ref.jsonl");
  ASSERT_EQ(resumed.size(), 3u) << resumed_log;
  ASSERT_EQ(ref.size(), static_cast<size_t>(last));
  for (int64_t step = p.step + 1; step <= last; ++step) {
    ASSERT_EQ(resumed.count(step), 1u) << "step " << step;
    EXPECT_EQ(resumed.at(step), ref.at(step)) << "step " << step;
  }
  // The preempted run's own losses up to its last step match the reference too.
  const auto before = read_step_losses(dir + "/preempted.jsonl");
  for (int64_t step = 1; step <= p.step; ++step) {
    EXPECT_EQ(before.at(step), ref.at(step)) << "step " << step;
  }
}

TEST(Preemption, SigtermToTheLauncherAlsoCheckpointsAndExits75) {
  const std::string dir = make_temp_dir("preempt_term");
  Preempted p = run_and_signal(dir, SIGTERM);
  ASSERT_EQ(p.rc, 75) << p.log;
  ASSERT_GE(p.step, 3) << p.log;
  EXPECT_TRUE(fs::exists(step_dir(dir + "/ckpt", p.step) + "/manifest.json")) << p.log;
}

}  // namespace
}  // namespace dnallm::testing
