// Resume: a run stopped (or killed) and resumed continues exactly as an uninterrupted one
// (same losses, bit-identical parameters), a damaged latest checkpoint falls back to the
// previous one, and a checkpoint saved at one world size / ZeRO stage resumes at another
// (2 -> 3 -> 1 ranks) with the same global batch, matching one rank within fp32 tolerance.
// Real processes: dnallm-train alone, or under dnallm-launch over Gloo on loopback.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "agent_process.hpp"  // free_port
#include "test_util.hpp"

namespace dnallm::testing {
namespace {

namespace fs = std::filesystem;

struct TrainRun {
  int rc = -1;
  std::string log;
  std::map<int64_t, double> losses;
  std::map<std::string, std::vector<float>> params;
};

// How a multi-rank run is started: under dnallm-launch (whose coordinator serves the commit
// registry), or static, torchrun-style: the processes started by hand, rank 0 hosting the
// process group's store (which then serves the commit registry).
enum class Starter { kLauncher, kStatic };

// `world` dnallm-train processes with `args`, started by hand on a free loopback port.
std::string static_group_command(int world, const std::string& env, const std::string& args) {
  const int port = elastic_testing::free_port();
  std::string cmd = fmt::format("cd {} && (pids=; ", kSrc);
  for (int r = world - 1; r >= 0; --r) {
    cmd += fmt::format(
        "{env} RANK={r} LOCAL_RANK={r} GROUP_RANK=0 WORLD_SIZE={w} LOCAL_WORLD_SIZE={w} "
        "MASTER_ADDR=127.0.0.1 MASTER_PORT={port} {bin}dnallm-train {args}{sep}",
        fmt::arg("env", env), fmt::arg("r", r), fmt::arg("w", world), fmt::arg("port", port),
        fmt::arg("bin", kBin), fmt::arg("args", args),
        fmt::arg("sep", r > 0 ? " & pids=\"$pids $!\"; " : "; rc=$?; "));
  }
  return cmd + "for p in $pids; do wait $p || rc=$((rc ? rc : $?)); done; exit $rc)";
}

// Tiny BERT, fp32, no dropout, constant LR (a run stopped at step 4 has the same schedule
// as one going to 8). Global batch 12 = micro × world. `ckpt` is the checkpoint root; the
// metrics go to <ckpt>/../<name>.jsonl.
// Every run here holds one intra-op thread (a test's own `env` comes after and wins): runs
// compared bit for bit, started at different times on a loaded 2-core machine, differed in the
// last bit with the default threads (BLAS kernel and thread choices), never when alone.
TrainRun train(const std::string& ckpt, const std::string& name, int world, int steps,
               int save_steps, const std::string& extra = "", const std::string& test_env = "",
               Starter starter = Starter::kLauncher) {
  const std::string env = "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 " + test_env;
  const std::string metrics = (fs::path(ckpt).parent_path() / (name + ".jsonl")).string();
  const std::string args = fmt::format(
      "--set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64 "
      "--set model.max_seq_length=64 --set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
      "--set training.max_steps={steps} --set training.micro_batch_size={micro} "
      "--set training.grad_accum_steps=1 --set training.lr=3e-3 "
      "--set training.lr_scheduler=constant --set training.warmup_steps=0 "
      "--set training.logging_steps=1 --set training.seed=7 "
      "--set data.dataloader_num_workers=1 --set parallel.backend=gloo "
      "--set parallel.bucket_cap_mb=0.02 --set parallel.first_bucket_mb=0.005 "
      "--set checkpoint.dir={ckpt} --set checkpoint.save_steps={save} --set checkpoint.keep_last=0 "
      "--metrics-file {metrics} {extra}",
      fmt::arg("steps", steps), fmt::arg("micro", 12 / world), fmt::arg("ckpt", ckpt),
      fmt::arg("save", save_steps), fmt::arg("metrics", metrics), fmt::arg("extra", extra));
  const std::string launcher =
      world > 1 ? fmt::format("{}dnallm-launch --nproc-per-node {} -- ", kBin, world) : "";
  const std::string cmd =
      starter == Starter::kStatic && world > 1
          ? static_group_command(world, env, args)
          : fmt::format("cd {} && {} {}{}dnallm-train {}", kSrc, env, launcher, kBin, args);
  TrainRun r;
  r.rc = run_command(cmd, &r.log);
  r.log = cmd + "\n" + r.log;
  if (fs::exists(metrics)) r.losses = read_step_losses(metrics);
  const std::string weights = ckpt + "/final/model.safetensors";
  if (r.rc == 0 && fs::exists(weights)) r.params = read_safetensors_f32(weights);
  return r;
}

void expect_bit_identical(const TrainRun& ref, const TrainRun& run, const std::string& what) {
  ASSERT_EQ(ref.params.size(), run.params.size()) << what;
  ASSERT_FALSE(ref.params.empty()) << what;
  for (const auto& [name, v] : ref.params) {
    const auto& w = run.params.at(name);
    ASSERT_EQ(v.size(), w.size()) << name;
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(v[i], w[i]) << what << ": " << name << "[" << i << "] differs";
    }
  }
}

// `dnallm-ckpt export` of <dir>/ckpt/step_000000004 writes `ref`'s weights, bit for bit.
void expect_checkpoint_exports(const std::string& dir, const TrainRun& ref,
                               const std::string& what) {
  ASSERT_EQ(run_command(fmt::format("{}dnallm-ckpt export {}/ckpt/step_000000004 --out {}/exported",
                                    kBin, dir, dir)),
            0)
      << what;
  TrainRun exported;
  exported.params = read_safetensors_f32(dir + "/exported/model.safetensors");
  expect_bit_identical(ref, exported, what);
}

double max_param_diff(const TrainRun& ref, const TrainRun& run) {
  double max_diff = 0;
  for (const auto& [name, v] : ref.params) {
    const auto& w = run.params.at(name);
    for (size_t i = 0; i < v.size(); ++i)
      max_diff = std::max(max_diff, double(std::abs(v[i] - w[i])));
  }
  return max_diff;
}

// A run stopped at step 4 and one resumed from its checkpoint to step 8 (same `extra`); the
// second must have resumed. Fatal failures end the calling test.
std::pair<TrainRun, TrainRun> stop_at_4_and_resume(const std::string& ckpt, int world,
                                                   int save_steps, const std::string& extra) {
  std::pair<TrainRun, TrainRun> runs{train(ckpt, "first", world, 4, save_steps, extra), {}};
  EXPECT_EQ(runs.first.rc, 0) << runs.first.log;
  if (runs.first.rc != 0) return runs;
  runs.second = train(ckpt, "second", world, 8, save_steps, extra);
  EXPECT_EQ(runs.second.rc, 0) << runs.second.log;
  EXPECT_NE(runs.second.log.find("resumed from"), std::string::npos) << runs.second.log;
  return runs;
}

class Resume : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = make_temp_dir("resume_ref");
    reference_ = new TrainRun(train(dir + "/ckpt", "ref", 1, 8, 0));
  }
  static void TearDownTestSuite() { delete reference_; }
  void SetUp() override {
    ASSERT_EQ(reference_->rc, 0) << reference_->log;
    ASSERT_EQ(reference_->losses.size(), 8u);
  }
  static TrainRun* reference_;
};
TrainRun* Resume::reference_ = nullptr;

TEST_F(Resume, StoppedAndResumedRunIsBitIdentical) {
  const std::string ckpt = make_temp_dir("resume_stop") + "/ckpt";
  TrainRun first = train(ckpt, "first", 1, 4, 4);
  ASSERT_EQ(first.rc, 0) << first.log;
  ASSERT_TRUE(fs::exists(ckpt + "/step_000000004/manifest.json"));
  TrainRun second = train(ckpt, "second", 1, 8, 4);
  ASSERT_EQ(second.rc, 0) << second.log;
  EXPECT_NE(second.log.find("resumed from"), std::string::npos) << second.log;
  ASSERT_EQ(second.losses.size(), 4u);
  for (int64_t step = 5; step <= 8; ++step) {
    EXPECT_EQ(second.losses.at(step), reference_->losses.at(step)) << "step " << step;
  }
  expect_bit_identical(*reference_, second, "resumed at step 4");
}

// Issue 24: the long-context families resume exactly too. HyenaDNA (causal LM) and Caduceus-PS
// (masked LM, RCPS) stopped at step 4 and resumed end bit-identical to their uninterrupted runs,
// every loss of steps 5-8 equal.
TEST_F(Resume, HyenaAndCaduceusStoppedAndResumedAreBitIdentical) {
  for (const std::string arch : {"hyena", "caduceus-ps"}) {
    SCOPED_TRACE(arch);
    const std::string model = "--set model.arch=" + arch;
    const std::string dir = make_temp_dir("resume_" + arch);
    TrainRun straight = train(dir + "/straight", "straight", 1, 8, 0, model);
    ASSERT_EQ(straight.rc, 0) << straight.log;
    ASSERT_EQ(straight.losses.size(), 8u);
    const std::string ckpt = dir + "/ckpt";
    TrainRun first = train(ckpt, "first", 1, 4, 4, model);
    ASSERT_EQ(first.rc, 0) << first.log;
    ASSERT_TRUE(fs::exists(ckpt + "/step_000000004/manifest.json"));
    TrainRun second = train(ckpt, "second", 1, 8, 4, model);
    ASSERT_EQ(second.rc, 0) << second.log;
    EXPECT_NE(second.log.find("resumed from"), std::string::npos) << second.log;
    ASSERT_EQ(second.losses.size(), 4u);
    for (int64_t step = 5; step <= 8; ++step) {
      EXPECT_EQ(second.losses.at(step), straight.losses.at(step)) << "step " << step;
    }
    expect_bit_identical(straight, second, arch + " resumed at step 4");
  }
}

// The sync-free step (Note [Sync-free step], the GPU default, forced on here) through the real
// binary: its losses match the host path's (the reference) within fp32 tolerance; stopped at
// step 4 and resumed, it saves and commits again (steps 6 and 8) and ends bit-identical to
// an uninterrupted sync-free run.
TEST_F(Resume, SyncFreeRunResumesSavesAgainAndMatchesTheHostPath) {
  const std::string sync_free = "--set training.sync_free=on";
  const std::string dir = make_temp_dir("resume_sync_free");
  TrainRun straight = train(dir + "/straight", "straight", 1, 8, 0, sync_free);
  ASSERT_EQ(straight.rc, 0) << straight.log;
  ASSERT_EQ(straight.losses.size(), 8u);
  for (int64_t step = 1; step <= 8; ++step) {
    EXPECT_NEAR(straight.losses.at(step), reference_->losses.at(step),
                1e-5 * std::abs(reference_->losses.at(step)))
        << "step " << step;
  }
  EXPECT_LT(max_param_diff(*reference_, straight), 1e-4);
  const std::string ckpt = dir + "/ckpt";
  const auto [first, second] = stop_at_4_and_resume(ckpt, 1, 2, sync_free);
  ASSERT_EQ(second.rc, 0);
  for (int step : {6, 8}) {
    EXPECT_TRUE(fs::exists(fmt::format("{}/step_{:09d}/manifest.json", ckpt, step)))
        << "the save of step " << step << " after the resume did not commit";
  }
  for (int64_t step = 5; step <= 8; ++step) {
    EXPECT_EQ(second.losses.at(step), straight.losses.at(step)) << "step " << step;
  }
  expect_bit_identical(straight, second, "sync-free, resumed at step 4");
}

// Note [Optimizer offload]: moments kept in host memory are saved and restored as without
// offload. Saved with offload and resumed with it, or without it, the run ends bit-identical to
// the uninterrupted reference (on CPU offload is the same arithmetic); ZeRO-1 on 2 ranks
// stopped and resumed with offload equals its uninterrupted run without offload.
TEST_F(Resume, OffloadedOptimizerSavesAndResumesBitIdentical) {
  const std::string offload = "--set training.optimizer_offload=true";
  const std::string dir = make_temp_dir("resume_offload");
  {
    const auto [first, second] = stop_at_4_and_resume(dir + "/ckpt", 1, 4, offload);
    ASSERT_EQ(second.rc, 0);
    for (int64_t step = 5; step <= 8; ++step) {
      EXPECT_EQ(second.losses.at(step), reference_->losses.at(step)) << "step " << step;
    }
    expect_bit_identical(*reference_, second, "offload, resumed at step 4");
  }
  {
    // Saved with offload, resumed without it.
    const std::string ckpt = dir + "/mixed";
    TrainRun first = train(ckpt, "first", 1, 4, 4, offload);
    ASSERT_EQ(first.rc, 0) << first.log;
    TrainRun second = train(ckpt, "second", 1, 8, 4);
    ASSERT_EQ(second.rc, 0) << second.log;
    EXPECT_NE(second.log.find("resumed from"), std::string::npos) << second.log;
    expect_bit_identical(*reference_, second, "saved with offload, resumed without");
  }
  {
    const std::string z1 = "--set parallel.zero_stage=1";
    TrainRun straight = train(dir + "/z1_straight", "z1_straight", 2, 8, 0, z1);
    ASSERT_EQ(straight.rc, 0) << straight.log;
    const auto [first, second] = stop_at_4_and_resume(dir + "/z1", 2, 4, z1 + " " + offload);
    ASSERT_EQ(second.rc, 0);
    for (int64_t step = 5; step <= 8; ++step) {
      EXPECT_EQ(second.losses.at(step), straight.losses.at(step)) << "step " << step;
    }
    expect_bit_identical(straight, second, "ZeRO-1 2 ranks with offload, resumed at step 4");
  }
}

TEST_F(Resume, KilledRunResumesToTheSameParameters) {
  const std::string ckpt = make_temp_dir("resume_kill") + "/ckpt";
  // SIGKILL right after step 6's save was handed to the writer (step 4 is committed).
  TrainRun killed = train(ckpt, "killed", 1, 8, 2, "", "DNALLM_TEST_KILL_AFTER_SAVE_STEP=6");
  ASSERT_EQ(killed.rc, 128 + 9) << killed.log;
  ASSERT_FALSE(fs::exists(ckpt + "/final")) << "the killed run must not have finished";
  ASSERT_TRUE(fs::exists(ckpt + "/step_000000004/manifest.json"));
  TrainRun resumed = train(ckpt, "resumed", 1, 8, 2);
  ASSERT_EQ(resumed.rc, 0) << resumed.log;
  ASSERT_FALSE(resumed.losses.empty());
  for (const auto& [step, loss] : resumed.losses) {
    EXPECT_GE(step, 5);
    EXPECT_EQ(loss, reference_->losses.at(step)) << "step " << step;
  }
  expect_bit_identical(*reference_, resumed, "killed after step 6, resumed");
}

// Note [Dropout randomness]: with dropout the masks of a step depend only on (seed, step,
// micro-step, rank), so 2 ranks stopped at step 4 and resumed draw the same masks as an
// uninterrupted run: same losses, bit-identical parameters.
TEST_F(Resume, DropoutRunResumesBitIdentical) {
  const std::string dir = make_temp_dir("resume_dropout");
  const std::string dropout = "--set model.dropout=0.1";
  TrainRun ref = train(dir + "/ref", "ref", 2, 8, 0, dropout);
  ASSERT_EQ(ref.rc, 0) << ref.log;
  ASSERT_EQ(ref.losses.size(), 8u);
  // Dropout is on: the losses differ from the dropout-free reference (else this test could
  // not tell a restored generator from an unused one).
  EXPECT_NE(ref.losses.at(2), reference_->losses.at(2));
  const auto [first, second] = stop_at_4_and_resume(dir + "/ckpt", 2, 4, dropout);
  ASSERT_EQ(second.rc, 0);
  ASSERT_EQ(second.losses.size(), 4u);
  for (int64_t step = 5; step <= 8; ++step) {
    EXPECT_EQ(second.losses.at(step), ref.losses.at(step)) << "step " << step;
  }
  expect_bit_identical(ref, second, "2 ranks with dropout, resumed at step 4");
}

TEST_F(Resume, DamagedLatestCheckpointFallsBackToThePreviousOne) {
  const std::string ckpt = make_temp_dir("resume_damaged") + "/ckpt";
  TrainRun first = train(ckpt, "first", 1, 4, 2);
  ASSERT_EQ(first.rc, 0) << first.log;
  const std::string shard = ckpt + "/step_000000004/shard_00000.dnc";
  ASSERT_TRUE(fs::exists(shard));
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(100);
    f.write(&c, 1);
  }
  TrainRun resumed = train(ckpt, "resumed", 1, 8, 0);
  ASSERT_EQ(resumed.rc, 0) << resumed.log;
  EXPECT_NE(resumed.log.find("shard_00000.dnc"), std::string::npos) << resumed.log;
  EXPECT_NE(resumed.log.find("step_000000002 at step 2"), std::string::npos) << resumed.log;
  ASSERT_EQ(resumed.losses.size(), 6u);
  expect_bit_identical(*reference_, resumed, "resumed from step 2 after step 4 was damaged");
}

TEST_F(Resume, RetentionKeepsTheNewestAndMetricsReportEveryCheckpoint) {
  const std::string dir = make_temp_dir("resume_retention");
  const std::string ckpt = dir + "/ckpt";
  TrainRun run = train(ckpt, "run", 1, 4, 1, "--set checkpoint.keep_last=2");
  ASSERT_EQ(run.rc, 0) << run.log;
  EXPECT_FALSE(fs::exists(ckpt + "/step_000000001/manifest.json"));
  EXPECT_FALSE(fs::exists(ckpt + "/step_000000002/manifest.json"));
  EXPECT_TRUE(fs::exists(ckpt + "/step_000000003/manifest.json"));
  EXPECT_TRUE(fs::exists(ckpt + "/step_000000004/manifest.json"));
  std::ifstream in(dir + "/run.jsonl");
  std::string line;
  std::vector<int64_t> steps;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") != "checkpoint") continue;
    steps.push_back(j.at("step").get<int64_t>());
    EXPECT_GT(j.at("bytes").get<int64_t>(), 0);
    EXPECT_GE(j.at("stall_s").get<double>(), 0.0);
    EXPECT_GT(j.at("write_s").get<double>(), 0.0);
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4}));
}

// A checkpoint's committed steps (manifest present) and the "checkpoint" metrics lines.
std::vector<int64_t> checkpoint_events(const std::string& metrics) {
  std::ifstream in(metrics);
  std::string line;
  std::vector<int64_t> steps;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "checkpoint") steps.push_back(j.at("step").get<int64_t>());
  }
  return steps;
}

// A static 2-rank Gloo run (no launcher, no coordinator): the shards are committed through
// the commit registry that rank 0's store server serves (ops 37-38), and retention deletes
// the same steps as the one-rank run above (keep_last = 2 of steps 1-4: 1 and 2).
TEST(StaticCommit, TwoRanksCommitThroughRank0StoreAndRetentionMatchesOneRank) {
  const std::string dir = make_temp_dir("static_commit");
  const std::string ckpt = dir + "/ckpt";
  TrainRun run = train(ckpt, "run", 2, 4, 1, "--set checkpoint.keep_last=2", "OMP_NUM_THREADS=1",
                       Starter::kStatic);
  ASSERT_EQ(run.rc, 0) << run.log;
  EXPECT_EQ(run.log.find("dnallm-launch"), std::string::npos) << run.log;
  // Rank 0's store served the ops: its registry logged every commit, and the retention
  // decision came back over TCP.
  EXPECT_NE(run.log.find("commit registry: step 4 committed under " + ckpt), std::string::npos)
      << run.log;
  EXPECT_NE(run.log.find("retention (decided by the coordinator): deleted"), std::string::npos)
      << run.log;
  EXPECT_FALSE(fs::exists(ckpt + "/step_000000001"));
  EXPECT_FALSE(fs::exists(ckpt + "/step_000000002"));
  for (const char* step : {"/step_000000003", "/step_000000004"}) {
    EXPECT_TRUE(fs::exists(ckpt + step + "/manifest.json")) << step;
    EXPECT_TRUE(fs::exists(ckpt + step + "/shard_00001.dnc")) << step;
  }
  EXPECT_EQ(checkpoint_events(dir + "/run.jsonl"), (std::vector<int64_t>{1, 2, 3, 4}));
}

// 2 ranks save at step 3, 3 ranks resume to step 6, 1 rank resumes to step 8; each run with
// its own parallel settings (`parallel` for all three when the others are empty).
void reshard_chain(const TrainRun& reference, const std::string& name, const std::string& parallel,
                   std::string parallel3 = "", std::string parallel1 = "") {
  if (parallel3.empty()) parallel3 = parallel;
  if (parallel1.empty()) parallel1 = parallel;
  const std::string ckpt = make_temp_dir(name) + "/ckpt";
  TrainRun two = train(ckpt, "two", 2, 3, 3, parallel);
  ASSERT_EQ(two.rc, 0) << two.log;
  ASSERT_TRUE(fs::exists(ckpt + "/step_000000003/shard_00001.dnc")) << two.log;
  TrainRun three = train(ckpt, "three", 3, 6, 3, parallel3);
  ASSERT_EQ(three.rc, 0) << three.log;
  EXPECT_NE(three.log.find("at step 3 (world size 2 -> 3)"), std::string::npos) << three.log;
  ASSERT_TRUE(fs::exists(ckpt + "/step_000000006/shard_00002.dnc")) << three.log;
  TrainRun one = train(ckpt, "one", 1, 8, 0, parallel1);
  ASSERT_EQ(one.rc, 0) << one.log;
  EXPECT_NE(one.log.find("at step 6 (world size 3 -> 1)"), std::string::npos) << one.log;
  std::map<int64_t, double> losses = two.losses;
  losses.insert(three.losses.begin(), three.losses.end());
  losses.insert(one.losses.begin(), one.losses.end());
  ASSERT_EQ(losses.size(), 8u);
  for (const auto& [step, loss] : reference.losses) {
    EXPECT_NEAR(losses.at(step), loss, 2e-5 * std::abs(loss)) << name << " step " << step;
  }
  ASSERT_EQ(one.params.size(), reference.params.size());
  // As in ddp_equivalence_test: summation-order differences stay far below the updates.
  const double diff = max_param_diff(reference, one);
  EXPECT_LT(diff, 2e-4) << name << ": largest parameter difference " << diff;
}

// training.keep_global_batch: the same configuration (micro 6, accum 1) saved by 2 ranks
// (global 12) and resumed by 1 rank trains with accum 2, so its steps equal the 1-rank
// reference (micro 12) within fp32 tolerance instead of halving the global batch.
TEST_F(Resume, ResumeAtAnotherWorldSizeKeepsTheGlobalBatch) {
  const std::string ckpt = make_temp_dir("resume_keep_batch") + "/ckpt";
  const std::string micro6 = "--set training.micro_batch_size=6";
  TrainRun two = train(ckpt, "two", 2, 4, 4, micro6);
  ASSERT_EQ(two.rc, 0) << two.log;
  TrainRun one = train(ckpt, "one", 1, 8, 0, micro6);
  ASSERT_EQ(one.rc, 0) << one.log;
  EXPECT_NE(one.log.find("keeping the global batch of 12: grad_accum_steps 1 -> 2 at world size 1"),
            std::string::npos)
      << one.log;
  ASSERT_EQ(one.losses.size(), 4u);
  for (const auto& [step, loss] : one.losses) {
    EXPECT_NEAR(loss, reference_->losses.at(step), 2e-5 * std::abs(loss)) << "step " << step;
  }
  const double diff = max_param_diff(*reference_, one);
  EXPECT_LT(diff, 2e-4) << "largest parameter difference " << diff;
  // Switched off, the resumed run halves the global batch and drifts from the reference.
  const std::string ckpt_off = make_temp_dir("resume_keep_batch_off") + "/ckpt";
  ASSERT_EQ(train(ckpt_off, "two", 2, 4, 4, micro6).rc, 0);
  TrainRun off =
      train(ckpt_off, "off", 1, 8, 0, micro6 + " --set training.keep_global_batch=false");
  ASSERT_EQ(off.rc, 0) << off.log;
  EXPECT_GT(std::abs(off.losses.at(5) - reference_->losses.at(5)),
            1e-4 * std::abs(off.losses.at(5)));
}

TEST_F(Resume, ReshardDdpTwoThreeOne) {
  reshard_chain(*reference_, "reshard_ddp", "--set parallel.zero_stage=0");
}

TEST_F(Resume, ReshardZero1TwoThreeOne) {
  reshard_chain(*reference_, "reshard_z1", "--set parallel.zero_stage=1");
}

TEST_F(Resume, ReshardZero2TwoThreeOne) {
  reshard_chain(*reference_, "reshard_z2", "--set parallel.zero_stage=2");
}

// Note [Fully sharded]: each ZeRO-3 rank writes its piece of every unit (Note [Pieces of a
// tensor]); a checkpoint maps by parameter name, so any stage resumes any other.
TEST_F(Resume, ReshardZero3TwoThreeOne) {
  reshard_chain(*reference_, "reshard_z3", "--set parallel.zero_stage=3");
}

TEST_F(Resume, ResumeAcrossZeroStages) {
  reshard_chain(*reference_, "stages_3_2_0", "--set parallel.zero_stage=3",
                "--set parallel.zero_stage=2", "--set parallel.zero_stage=0");
  reshard_chain(*reference_, "stages_0_3_1", "--set parallel.zero_stage=0",
                "--set parallel.zero_stage=3", "--set parallel.zero_stage=1");
}

TEST_F(Resume, Zero3StoppedAndResumedIsBitIdentical) {
  const std::string z3 = "--set parallel.zero_stage=3";
  const std::string dir = make_temp_dir("resume_z3");
  TrainRun straight = train(dir + "/straight", "straight", 2, 8, 0, z3);
  ASSERT_EQ(straight.rc, 0) << straight.log;
  const auto [first, second] = stop_at_4_and_resume(dir + "/ckpt", 2, 4, z3);
  ASSERT_EQ(second.rc, 0);
  // Two ranks, two pieces (root and blocks) of each flat tensor per shard.
  const auto manifest = nlohmann::json::parse(
      std::ifstream(dir + "/ckpt/step_000000004/manifest.json"), nullptr, false);
  ASSERT_FALSE(manifest.is_discarded());
  EXPECT_EQ(manifest.at("zero_stage").get<int>(), 3);
  EXPECT_GT(manifest.at("shards").at(0).at("ranges").size(), 3u);
  for (int64_t step = 5; step <= 8; ++step) {
    EXPECT_EQ(second.losses.at(step), straight.losses.at(step)) << "step " << step;
  }
  expect_bit_identical(straight, second, "ZeRO-3 2 ranks, resumed at step 4");
  // dnallm-ckpt export assembles the model from the ranks' pieces, a tensor at a time: the
  // same weights the first run exported at step 4.
  expect_checkpoint_exports(dir, first, "dnallm-ckpt export of the ZeRO-3 checkpoint at step 4");
}

// Note [Fully sharded mixed precision]: under bf16 gathers (and a bf16 reduce-scatter) the
// checkpoint holds the fp32 master shard, so the resumed run gathers the same bf16 values and
// continues bit for bit; the run's export at step 4 (each unit gathered in fp32) is the
// checkpoint's master weights, bit for bit.
TEST_F(Resume, Zero3Bf16GathersStoppedAndResumedIsBitIdentical) {
  const std::string z3 =
      "--set parallel.zero_stage=3 --set training.precision=bf16 "
      "--set parallel.grad_reduce_dtype=bf16";
  const std::string dir = make_temp_dir("resume_z3_bf16");
  TrainRun straight = train(dir + "/straight", "straight", 2, 8, 0, z3);
  ASSERT_EQ(straight.rc, 0) << straight.log;
  const auto [first, second] = stop_at_4_and_resume(dir + "/ckpt", 2, 4, z3);
  ASSERT_EQ(second.rc, 0);
  for (int64_t step = 5; step <= 8; ++step) {
    EXPECT_EQ(second.losses.at(step), straight.losses.at(step)) << "step " << step;
  }
  expect_bit_identical(straight, second, "ZeRO-3 bf16 gathers, 2 ranks, resumed at step 4");
  expect_checkpoint_exports(dir, first, "dnallm-ckpt export of the bf16 ZeRO-3 checkpoint");
}

}  // namespace
}  // namespace dnallm::testing
