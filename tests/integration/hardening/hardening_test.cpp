// Issue 15 with real processes: checkpoint directory ownership and validation, stop signals
// at awkward moments (before the handlers exist, while blocked on a FIFO, elastic
// preemption), and bad data named as such. Tiny model, few steps; every wait is bounded.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hardening_util.hpp"
#include "test_util.hpp"

namespace dnallm::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

std::string train_command(const std::string& ckpt, const std::string& metrics, int steps,
                          int save_steps, const std::string& env = "") {
  return fmt::format("cd {} && exec env {} {}dnallm-train {}", kSrc, env, kBin,
                     tiny_settings(ckpt, metrics, steps, save_steps));
}

TEST(CheckpointDirOwnership, ASecondJobIsRefusedAndADeadJobsLockIsTakenOver) {
  const std::string dir = make_temp_dir("own_lock");
  Background a(
      train_command(dir + "/ckpt", dir + "/a.jsonl", 100000, 1000, "DNALLM_TEST_STEP_DELAY_MS=100"),
      dir + "/a.log");
  ASSERT_TRUE(wait_for_text(dir + "/a.jsonl", "\"step\":1,", 120s)) << a.log();
  std::string log;
  const int rc = run_command(train_command(dir + "/ckpt", dir + "/b.jsonl", 2, 1000), &log);
  EXPECT_EQ(rc, 2) << log;
  EXPECT_TRUE(contains(log, "in use by another job")) << log;
  EXPECT_TRUE(contains(log, fmt::format("pid {}", a.pid()))) << log;
  EXPECT_FALSE(fs::exists(dir + "/b.jsonl")) << "the refused job trained";
  // The holder dies without any cleanup: its lock is taken over.
  ::kill(a.pid(), SIGKILL);
  EXPECT_EQ(a.wait(30s), 128 + SIGKILL);
  const int rc2 = run_command(train_command(dir + "/ckpt", dir + "/c.jsonl", 2, 1000), &log);
  EXPECT_EQ(rc2, 0) << log;
  EXPECT_TRUE(contains(log, "took over the checkpoint directory lock")) << log;
}

TEST(CheckpointDirOwnership, AnUnusableDirectoryFailsBeforeAnyTraining) {
  const std::string dir = make_temp_dir("own_validate");
  std::ofstream(dir + "/a_file") << "x";
  struct Case {
    std::string value, needle;
  } cases[] = {{"\\\"\\\"", "checkpoint.dir is empty"},
               {dir + "/a_file", "not a directory"},
               {dir + "/" + std::string(300, 'd'), "characters long"}};
  for (const auto& c : cases) {
    std::string log;
    const int rc =
        run_command(fmt::format("cd {} && {}dnallm-train {} --set checkpoint.dir={}", kSrc, kBin,
                                tiny_settings("unused", dir + "/m.jsonl", 2, 1), c.value),
                    &log);
    EXPECT_EQ(rc, 2) << c.value << "\n" << log;
    EXPECT_TRUE(contains(log, c.needle)) << log;
    EXPECT_FALSE(fs::exists(dir + "/m.jsonl")) << "trained before failing: " << c.value;
  }
}

// Issue 22, Note [A failed save] (checkpoint/durable_io.hpp): a checkpoint that cannot be
// written mid-run (here: a 64 KiB file size limit, EFBIG; disk full is ENOSPC the same way)
// is exit 2 with the cause, which the launcher does not restart, not 1 "internal error".
TEST(CheckpointDirOwnership, ASaveThatFailsMidRunIsExit2WithTheCause) {
  const std::string dir = make_temp_dir("save_fails");
  for (const bool async : {true, false}) {
    std::string log;
    const int rc = run_command(
        fmt::format("cd {} && trap '' XFSZ && ulimit -f 64 && {}dnallm-train {} "
                    "--set checkpoint.async={}",
                    kSrc, kBin,
                    tiny_settings(fmt::format("{}/ckpt_{}", dir, async), dir + "/m.jsonl", 4, 2),
                    async),
        &log);
    EXPECT_EQ(rc, 2) << log;
    EXPECT_TRUE(contains(log, "File too large")) << log;
    EXPECT_TRUE(contains(log, "free disk space")) << log;
    EXPECT_FALSE(contains(log, "internal error")) << log;
  }
}

// Issue 22, Note [Memory predicted] (worker/train/trainer.cpp): a model inside every allowed
// range whose training state cannot fit (hidden 65536, ffn 262144, 64 layers: 18.8 GB spent
// before) is refused before it is built, naming the figures and what to lower; so is a run
// over training.memory_limit_gb.
TEST(TrainingMemory, APredictedOverflowIsRefusedBeforeTheModelIsBuilt) {
  const std::string dir = make_temp_dir("memory_predicted");
  struct Case {
    std::string sets, needle;
  } cases[] = {
      {"--set model.hidden=65536 --set model.ffn=262144 --set model.layers=64 "
       "--set model.heads=64",
       "available to each of 1 rank(s) here"},
      {"--set training.memory_limit_gb=0.001", "more than training.memory_limit_gb = 0.001"},
  };
  for (const auto& c : cases) {
    std::string log;
    const int rc =
        run_command(fmt::format("cd {} && {}dnallm-train {} --set training.device=cpu {}", kSrc,
                                kBin, tiny_settings(dir + "/ckpt", dir + "/m.jsonl", 2, 0), c.sets),
                    &log);
    EXPECT_EQ(rc, 2) << log;
    EXPECT_TRUE(contains(log, "this run needs at least")) << log;
    EXPECT_TRUE(contains(log, c.needle)) << log;
    EXPECT_TRUE(contains(log, "lower model.hidden")) << log;
    EXPECT_FALSE(fs::exists(dir + "/m.jsonl")) << "trained before failing: " << c.sets;
  }
}

TEST(StopSignals, AWorkerBlockedOnAFifoEndsPromptlyOnSigterm) {
  const std::string dir = make_temp_dir("stop_fifo");
  const std::string fifo = dir + "/genome.fa";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  Background w(fmt::format("cd {} && exec env DNALLM_STOP_GRACE_MS=1000 {}dnallm-train {} "
                           "--set data.train_files=[\\\"{}\\\"]",
                           kSrc, kBin, tiny_settings(dir + "/ckpt", dir + "/m.jsonl", 5, 0), fifo),
               dir + "/w.log");
  std::this_thread::sleep_for(2s);  // LibTorch loads, then the reader blocks on the FIFO
  ASSERT_EQ(w.wait(0ms), -1) << "it ended before the signal:\n" << w.log();
  ::kill(w.pid(), SIGTERM);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(w.wait(20s), 75) << w.log();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_TRUE(contains(w.log(), "no training step ended within 1000 ms")) << w.log();
}

// Issue 22 (Note [What exit 75 says], launcher/main.cpp): the same worker under the launcher
// exits 75 without a checkpoint; the launcher says so instead of "the workers saved a
// checkpoint".
TEST(StopSignals, TheLauncherDoesNotClaimACheckpointThatWasNotCommitted) {
  const std::string dir = make_temp_dir("stop_fifo_launch");
  const std::string fifo = dir + "/genome.fa";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  Background launcher(
      fmt::format("cd {} && exec env DNALLM_STOP_GRACE_MS=1000 {}dnallm-launch "
                  "--nproc-per-node 1 --grace-period 30 {} --set data.train_files=[\\\"{}\\\"]",
                  kSrc, kBin, tiny_settings(dir + "/ckpt", dir + "/m.jsonl", 5, 0), fifo),
      dir + "/launch.log");
  std::this_thread::sleep_for(3s);  // the worker loads, then blocks on the FIFO
  ASSERT_EQ(launcher.wait(0ms), -1) << "it ended before the signal:\n" << launcher.log();
  ::kill(launcher.pid(), SIGTERM);
  EXPECT_EQ(launcher.wait(60s), 75) << launcher.log();
  EXPECT_FALSE(contains(launcher.log(), "saved a checkpoint")) << launcher.log();
  EXPECT_TRUE(contains(launcher.log(), "no committed checkpoint in " + dir + "/ckpt"))
      << launcher.log();
}

// A stop signal to the launcher before its workers installed their handlers: held, not a
// kill; they train a step, commit it and exit 75, and so does the launcher.
class EarlyStopSignal : public ::testing::TestWithParam<int> {};

TEST_P(EarlyStopSignal, EndsWithACommittedCheckpointAndExit75) {
  const int sig = GetParam();
  const std::string dir = make_temp_dir(fmt::format("early_{}", sig));
  Background launcher(
      fmt::format("cd {} && exec env DNALLM_TEST_STEP_DELAY_MS=50 "
                  "{}dnallm-launch --nproc-per-node 2 --grace-period 60 {}",
                  kSrc, kBin, tiny_settings(dir + "/ckpt", dir + "/m.jsonl", 100000, 0)),
      dir + "/launch.log");
  std::this_thread::sleep_for(150ms);  // the workers exist but are still loading
  ::kill(launcher.pid(), sig);
  const int rc = launcher.wait(120s);
  EXPECT_EQ(rc, 75) << launcher.log();
  EXPECT_FALSE(contains(launcher.log(), "killed by signal")) << launcher.log();
  int64_t step = -1;
  std::ifstream in(dir + "/m.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "preempted") step = j["step"].get<int64_t>();
  }
  ASSERT_GE(step, 1) << launcher.log();
  EXPECT_TRUE(fs::exists(fmt::format("{}/ckpt/step_{:09d}/manifest.json", dir, step)));
}

INSTANTIATE_TEST_SUITE_P(UsrAndTerm, EarlyStopSignal, ::testing::Values(SIGUSR1, SIGTERM));

TEST(StopSignals, ElasticPreemptionExitsPromptlyAndHonestly) {
  const std::string dir = make_temp_dir("elastic_preempt");
  Background launcher(standalone_command(dir + "/ckpt", dir + "/m.jsonl", 100000, 50,
                                         "--grace-period 60 --heartbeat-timeout 10"),
                      dir + "/launch.log");
  ASSERT_TRUE(wait_for_text(dir + "/m.jsonl", "\"step\":3,", 120s)) << launcher.log();
  ::kill(launcher.pid(), SIGUSR1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(launcher.wait(60s), 75) << launcher.log();
  // Before: 10 s (a heartbeat timeout), "node dead" and a generation 2 nobody ran.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s) << launcher.log();
  EXPECT_FALSE(contains(launcher.log(), "generation 2")) << launcher.log();
  EXPECT_FALSE(contains(launcher.log(), "no heartbeat")) << launcher.log();
  EXPECT_TRUE(contains(launcher.log(), "preempted")) << launcher.log();
}

// The worker of `rank` among the dnallm-train children of `launcher` (from its environment).
pid_t worker_of_rank(pid_t launcher, int rank) {
  for (pid_t pid : workers_of(launcher)) {
    std::ifstream env("/proc/" + std::to_string(pid) + "/environ");
    // NUL-separated KEY=VALUE entries; a leading NUL makes every entry "\0KEY=VALUE\0".
    const std::string e =
        std::string(1, '\0') + std::string(std::istreambuf_iterator<char>(env), {}) + '\0';
    if (e.find(std::string("\0RANK=", 6) + std::to_string(rank) + '\0') != std::string::npos)
      return pid;
  }
  return -1;
}

// Note [Hang culprit]: a SIGSTOPped rank of an elastic job is named, whichever it is (not
// rank 0, the first of those that wait for it in the collective).
TEST(Diagnosis, AStoppedRankIsNamedNotTheFirstOneWaiting) {
  const std::string dir = make_temp_dir("hang_culprit");
  Background launcher(
      standalone_command(
          dir + "/ckpt", dir + "/m.jsonl", 100000, 50,
          "--grace-period 2 --hang-timeout 3 --max-restarts 0 --monitor-interval 0.2"),
      dir + "/launch.log");
  ASSERT_TRUE(wait_for_text(dir + "/m.jsonl", "\"step\":3,", 120s)) << launcher.log();
  const pid_t victim = worker_of_rank(launcher.pid(), 1);
  ASSERT_GT(victim, 0) << launcher.log();
  ::kill(victim, SIGSTOP);
  const int rc = launcher.wait(60s);
  ::kill(victim, SIGCONT);
  EXPECT_EQ(rc, 4) << launcher.log();
  EXPECT_TRUE(contains(launcher.log(), "rank 1 on")) << launcher.log();
  EXPECT_TRUE(contains(launcher.log(), "process is stopped")) << launcher.log();
}

TEST(CheckpointDirOwnership, ARunStartingBelowTheNewestStepSetsTheNewerOnesAside) {
  const std::string dir = make_temp_dir("own_aside");
  std::string log;
  // One intra-op thread: the losses are compared bit for bit, and two threads have been seen to
  // differ in the last bit under a loaded ctest -j2 (as in DdpEquivalence's offload test).
  const std::string one_thread = "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1";
  ASSERT_EQ(run_command(train_command(dir + "/ckpt", dir + "/a.jsonl", 4, 2, one_thread), &log), 0)
      << log;
  // Again from step 2 (an explicit step path): step 4 would be saved over in place.
  const int rc =
      run_command(train_command(dir + "/ckpt", dir + "/b.jsonl", 4, 2, one_thread) +
                      fmt::format(" --set checkpoint.resume={}/ckpt/step_000000002", dir),
                  &log);
  ASSERT_EQ(rc, 0) << log;
  EXPECT_TRUE(contains(log, "moved aside")) << log;
  int aside = 0;
  for (const auto& e : fs::directory_iterator(dir + "/ckpt"))
    aside += e.path().filename().string().rfind("step_000000004.superseded-", 0) == 0 ? 1 : 0;
  EXPECT_EQ(aside, 1);
  EXPECT_TRUE(fs::exists(dir + "/ckpt/step_000000004/manifest.json"));
  // The rerun of steps 3-4 equals the first run's.
  const auto a = read_step_losses(dir + "/a.jsonl");
  const auto b = read_step_losses(dir + "/b.jsonl");
  for (int64_t step : {3, 4}) EXPECT_EQ(b.at(step), a.at(step)) << "step " << step;
}

TEST(Diagnosis, AnAllocationThatCannotSucceedIsExit2WithWhatToLower) {
  const std::string dir = make_temp_dir("oom");
  std::string log;
  // Inside every allowed range, but ~360 GB of activations.
  const int rc = run_command(
      train_command(dir + "/ckpt", dir + "/m.jsonl", 1, 0) +
          " --set model.layers=1 --set model.ffn=1048576 --set training.micro_batch_size=4096",
      &log);
  EXPECT_EQ(rc, 2) << log;
  EXPECT_TRUE(contains(log, "out of memory")) << log;
  EXPECT_TRUE(contains(log, "lower training.micro_batch_size")) << log;
  EXPECT_FALSE(contains(log, "frame #")) << log;
  EXPECT_FALSE(contains(log, "internal error")) << log;
}

TEST(BadData, AnAllNFastaIsNamedAsSuch) {
  const std::string dir = make_temp_dir("all_n");
  {
    std::ofstream fa(dir + "/n.fa");
    fa << ">chrN\n";
    for (int i = 0; i < 50; ++i) fa << std::string(80, 'N') << "\n";
  }
  std::string log;
  const int rc = run_command(
      fmt::format("cd {} && {}dnallm-train {} --set data.train_files=[\\\"{}\\\"]", kSrc, kBin,
                  tiny_settings(dir + "/ckpt", dir + "/m.jsonl", 2, 0), dir + "/n.fa"),
      &log);
  EXPECT_EQ(rc, 3) << log;
  EXPECT_TRUE(contains(log, "no A, C, G or T")) << log;
  EXPECT_FALSE(contains(log, "mlm_probability")) << log;
}

}  // namespace
}  // namespace dnallm::testing
