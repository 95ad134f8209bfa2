// GPU training through the real binaries (label "gpu"): NCCL at world size 1 through
// dnallm-train, two ranks sharing one GPU over the staged gloo backend against one rank,
// and more ranks than GPUs exiting 2. Each case skips itself, with the reason, where no GPU
// is visible or dnallm-train was built without CUDA.
#include <cmath>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cluster/gpu_placement.hpp"
#include "test_util.hpp"

namespace dnallm::testing {
namespace {

const std::string kBin = std::string(DNALLM_BINARY_DIR) + "/bin/";
const std::string kSrc = DNALLM_SOURCE_DIR;

int visible_gpus() {
  return cluster::visible_gpu_count(cluster::current_env(), cluster::count_host_gpus());
}

// Why GPU training cannot run here, or "" when it can.
std::string gpu_skip_reason() {
  static const std::string reason = [] {
    if (visible_gpus() == 0)
      return std::string("no visible NVIDIA GPU (/dev/nvidia*, CUDA_VISIBLE_DEVICES)");
    std::string log;
    const int rc = run_command(fmt::format("{}dnallm-train --config {}/configs/quickstart.toml "
                                           "--set training.device=cuda --set training.max_steps=0 "
                                           "--print-config >/dev/null && {}dnallm-train --help",
                                           kBin, kSrc, kBin),
                               &log);
    if (rc != 0) return "dnallm-train does not run: " + log;
    return std::string();
  }();
  return reason;
}

struct Run {
  int rc = -1;
  std::string log;
  std::map<int64_t, double> losses;
};

// Tiny BERT on the bundled genome, 6 steps, global batch 8 x 64 tokens, fp32 (equivalence)
// unless `extra` says otherwise.
Run train(const std::string& name, const std::string& starter, int micro, int accum,
          const std::string& extra) {
  const std::string dir = make_temp_dir(name);
  const std::string cmd = fmt::format(
      "cd {src} && {starter} {bin}dnallm-train "
      "--set model.hidden=64 --set model.layers=2 --set model.heads=2 --set model.ffn=128 "
      "--set model.max_seq_length=64 --set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
      "--set training.max_steps=6 --set training.micro_batch_size={micro} "
      "--set training.grad_accum_steps={accum} --set training.lr=3e-3 "
      "--set training.warmup_steps=0 --set training.logging_steps=1 --set training.seed=7 "
      "--set training.device=cuda --set data.dataloader_num_workers=1 "
      "--set parallel.bucket_cap_mb=0.05 --set parallel.first_bucket_mb=0.01 "
      "--set checkpoint.dir={dir}/ckpt --set checkpoint.resume=none "
      "--set checkpoint.save_final=false --metrics-file {dir}/metrics.jsonl {extra}",
      fmt::arg("src", kSrc), fmt::arg("bin", kBin), fmt::arg("starter", starter),
      fmt::arg("micro", micro), fmt::arg("accum", accum), fmt::arg("dir", dir),
      fmt::arg("extra", extra));
  Run r;
  r.rc = run_command(cmd + " 2>&1", &r.log);
  r.log = cmd + "\n" + r.log;
  if (r.rc == 0) r.losses = read_step_losses(dir + "/metrics.jsonl");
  return r;
}

void expect_same_losses(const Run& a, const Run& b, double rel, const std::string& what) {
  ASSERT_EQ(a.losses.size(), 6u) << what << "\n" << a.log;
  ASSERT_EQ(b.losses.size(), 6u) << what << "\n" << b.log;
  for (const auto& [step, loss] : a.losses) {
    EXPECT_NEAR(b.losses.at(step), loss, rel * std::abs(loss)) << what << " step " << step;
  }
}

TEST(GpuTraining, NcclAtWorldSizeOneThroughTheTrainer) {
  if (auto why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const Run plain = train("gpu_plain", "", 8, 1, "");
  ASSERT_EQ(plain.rc, 0) << plain.log;
  const Run nccl = train("gpu_nccl1", "", 8, 1, "--set parallel.backend=nccl");
  ASSERT_EQ(nccl.rc, 0) << nccl.log;
  EXPECT_NE(nccl.log.find("nccl backend on cuda:0"), std::string::npos) << nccl.log;
  // An all-reduce over one rank changes nothing: the same losses as without a communicator.
  expect_same_losses(plain, nccl, 1e-6, "nccl world size 1 vs no communicator");
}

TEST(GpuTraining, TwoRanksSharingTheGpuOverStagedGlooMatchOneRank) {
  if (auto why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const Run one = train("gpu_one", "", 8, 1, "");
  ASSERT_EQ(one.rc, 0) << one.log;
  const std::string two = fmt::format("{}dnallm-launch --nproc-per-node 2 --", kBin);
  const Run ddp = train("gpu_shared_ddp", two, 4, 1, "--set parallel.share_gpus=true");
  ASSERT_EQ(ddp.rc, 0) << ddp.log;
  EXPECT_NE(ddp.log.find("staged through pinned host memory"), std::string::npos) << ddp.log;
  // GPU kernels sum in another order for another batch split: close, not bit-equal.
  expect_same_losses(one, ddp, 2e-4, "2 ranks sharing the GPU (DDP) vs 1 rank");
  const Run zero = train("gpu_shared_z1", two, 2, 2,
                         "--set parallel.share_gpus=true --set parallel.zero_stage=1");
  ASSERT_EQ(zero.rc, 0) << zero.log;
  expect_same_losses(one, zero, 2e-4, "2 ranks sharing the GPU (ZeRO-1, 2 micro-steps) vs 1");
}

TEST(GpuTraining, MoreRanksThanGpusExitsTwoNamingBoth) {
  if (auto why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const int gpus = visible_gpus();
  const Run r =
      train("gpu_too_many", fmt::format("{}dnallm-launch --nproc-per-node {} --", kBin, gpus + 1),
            4, 1, "");
  EXPECT_EQ(r.rc, 2) << r.log;
  EXPECT_NE(r.log.find(fmt::format("{} ranks on this node", gpus + 1)), std::string::npos) << r.log;
  EXPECT_NE(r.log.find(fmt::format("only {} visible GPU(s)", gpus)), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("parallel.share_gpus"), std::string::npos) << r.log;
}

}  // namespace
}  // namespace dnallm::testing
