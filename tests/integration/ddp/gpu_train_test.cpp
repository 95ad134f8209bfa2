// GPU training through the real binaries (label "gpu"): NCCL at world size 1 through
// dnallm-train (DDP and ZeRO-3), two ranks sharing one GPU over the staged gloo backend against one
// rank, and more ranks than GPUs exiting 2. Each case skips itself, with the reason, where no GPU
// is visible or dnallm-train was built without CUDA.
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cluster/gpu_placement.hpp"
#include "test_util.hpp"

namespace dnallm::testing {
namespace {

int visible_gpus() {
  return cluster::visible_gpu_count(cluster::current_env(), cluster::count_host_gpus());
}

// Why GPU training cannot run here, or "" when it can (or fails for another reason, which
// the tests then show).
std::string gpu_skip_reason() {
  static const std::string reason = [] {
    if (visible_gpus() == 0)
      return std::string("no visible NVIDIA GPU (/dev/nvidia*, CUDA_VISIBLE_DEVICES)");
    std::string log;
    const int rc =
        run_command(tiny_train_command("", make_temp_dir("gpu_probe"), 2, 1,
                                       "--set training.device=cuda --set training.max_steps=1 "
                                       "--set checkpoint.save_final=false"),
                    &log);
    if (rc != 0 && (log.find("sees no CUDA device") != std::string::npos ||
                    log.find("but this build has none") != std::string::npos))
      return std::string("dnallm-train was built against a LibTorch without CUDA");
    return std::string();
  }();
  return reason;
}

struct TrainResult {
  int rc = -1;
  std::string log;
  std::map<int64_t, double> losses;
};

// tiny_train_command on the GPU (5 steps, fp32); global batch 8 in these tests.
TrainResult train(const std::string& name, const std::string& starter, int micro, int accum,
                  const std::string& extra) {
  const std::string dir = make_temp_dir(name);
  const std::string cmd =
      tiny_train_command(starter, dir, micro, accum,
                         "--set training.device=cuda --set checkpoint.save_final=false " + extra);
  TrainResult r;
  r.rc = run_command(cmd + " 2>&1", &r.log);
  r.log = cmd + "\n" + r.log;
  if (r.rc == 0) r.losses = read_step_losses(dir + "/metrics.jsonl");
  return r;
}

void expect_same_losses(const TrainResult& a, const TrainResult& b, double rel,
                        const std::string& what) {
  ASSERT_EQ(a.losses.size(), 5u) << what << "\n" << a.log;
  ASSERT_EQ(b.losses.size(), 5u) << what << "\n" << b.log;
  for (const auto& [step, loss] : a.losses) {
    EXPECT_NEAR(b.losses.at(step), loss, rel * std::abs(loss)) << what << " step " << step;
  }
}

// One process (global batch 8) with `extra` against the same run without it: both succeed, the
// run's log has each of `log_lines`, and every step's loss is within 1e-5 (CUDA's run-to-run
// noise) of the plain run's. `name`: the run's folder, "<name>_plain" the plain run's.
void expect_one_process_like_plain(const std::string& name, const std::string& extra,
                                   const std::vector<std::string>& log_lines,
                                   const std::string& what) {
  const TrainResult plain = train(name + "_plain", "", 8, 1, "");
  ASSERT_EQ(plain.rc, 0) << plain.log;
  const TrainResult run = train(name, "", 8, 1, extra);
  ASSERT_EQ(run.rc, 0) << run.log;
  for (const std::string& line : log_lines) {
    EXPECT_NE(run.log.find(line), std::string::npos) << line << "\n" << run.log;
  }
  expect_same_losses(plain, run, 1e-5, what);
}

TEST(GpuTraining, NcclAtWorldSizeOneThroughTheTrainer) {
  if (auto why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  // An all-reduce over one rank changes nothing: the same losses as without a communicator,
  // up to CUDA's run-to-run noise (atomic adds in the embedding backward, another flat
  // layout order for the gradient norm).
  expect_one_process_like_plain("gpu_nccl1", "--set parallel.backend=nccl",
                                {"nccl backend on cuda:0"}, "nccl world size 1 vs no communicator");
}

// Note [Fully sharded stream order]: ZeRO-3 over NCCL at world size 1 runs every gather and
// reduction as a real collective on the communicator's stream, ordered by stream waits only
// (the host never waits for a unit). fp32 gathers and a sum over one rank change no value, so
// a gather or reduction read before it completed, or a buffer reused too early, shows as a
// loss apart from the run without a communicator.
TEST(GpuTraining, Zero3OverNcclAtWorldSizeOneMatchesOneProcess) {
  if (auto why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  // Up to CUDA's run-to-run noise, as DDP's above (the gradient norm sums the unit layout).
  expect_one_process_like_plain("gpu_z3_nccl1",
                                "--set parallel.backend=nccl --set parallel.zero_stage=3",
                                {"ZeRO-3: ", "nccl backend on cuda:0"},
                                "ZeRO-3 over nccl at world size 1 vs no communicator");
}

TEST(GpuTraining, TwoRanksSharingTheGpuOverStagedGlooMatchOneRank) {
  if (auto why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const TrainResult one = train("gpu_one", "", 8, 1, "");
  ASSERT_EQ(one.rc, 0) << one.log;
  const std::string two = fmt::format("{}dnallm-launch --nproc-per-node 2 --", kBin);
  const TrainResult ddp = train("gpu_shared_ddp", two, 4, 1, "--set parallel.share_gpus=true");
  ASSERT_EQ(ddp.rc, 0) << ddp.log;
  EXPECT_NE(ddp.log.find("staged through pinned host memory"), std::string::npos) << ddp.log;
  // GPU kernels sum in another order for another batch split: close, not bit-equal.
  expect_same_losses(one, ddp, 2e-4, "2 ranks sharing the GPU (DDP) vs 1 rank");
  const TrainResult zero = train("gpu_shared_z1", two, 2, 2,
                                 "--set parallel.share_gpus=true --set parallel.zero_stage=1");
  ASSERT_EQ(zero.rc, 0) << zero.log;
  expect_same_losses(one, zero, 2e-4, "2 ranks sharing the GPU (ZeRO-1, 2 micro-steps) vs 1");
}

TEST(GpuTraining, MoreRanksThanGpusExitsTwoNamingBoth) {
  if (auto why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const int gpus = visible_gpus();
  const TrainResult r =
      train("gpu_too_many", fmt::format("{}dnallm-launch --nproc-per-node {} --", kBin, gpus + 1),
            4, 1, "");
  EXPECT_EQ(r.rc, 2) << r.log;
  EXPECT_NE(r.log.find(fmt::format("{} ranks on this node", gpus + 1)), std::string::npos) << r.log;
  EXPECT_NE(r.log.find(fmt::format("only {} visible GPU(s)", gpus)), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("parallel.share_gpus"), std::string::npos) << r.log;
}

}  // namespace
}  // namespace dnallm::testing
