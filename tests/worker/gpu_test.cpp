// GPU-only tests of the training step and checkpoints (issue 13, items 3-5). They compile in
// every build and skip themselves with a reason where there is no CUDA device. The CUDA plugin
// is loaded before any test runs (Note [Lazy CUDA] in core/cuda_plugin.hpp).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/error.hpp"
#include "lm_batches.hpp"
#include "worker/train/checkpointing.hpp"
#include "worker/train/device_stats.hpp"
#include "worker/train/train_setup.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {
namespace {

namespace fs = std::filesystem;

// At start, before anything asks LibTorch about CUDA: loads the plugin where a GPU shows.
const bool kCuda = cuda_usable("auto", "the GPU tests");

#define DNALLM_REQUIRE_GPU()                                \
  if (!kCuda)                                               \
  GTEST_SKIP() << "GPU-only test: no CUDA device visible (" \
               << (cuda_build() ? "the CUDA plugin is built" : "a build without CUDA") << ")"

using testing::LmRows;
using testing::LmSource;

// The rows of these tests; `padded`: some rows end in padding.
LmRows rows_of(bool padded) { return LmRows{900, 15, padded ? 4 : 0}; }
Config gpu_config(const std::string& arch, const std::string& precision) {
  Config c = testing::small_lm_config(arch, 128, 64, 8, 1e-3);
  c.training.lr_scheduler = cfg::LrScheduler::kConstant;
  c.training.logging_steps = 3;
  c.training.precision =
      parse_config("", "test", {"training.precision=" + precision}).training.precision;
  c.training.device = cfg::Device::kCuda;
  return c;
}

TEST(GpuTest, SyncFreeStepsRunUnderCudaSyncDebugError) {
  DNALLM_REQUIRE_GPU();
  for (const std::string arch : {"bert", "gpt"}) {
    for (const bool padded : {false, true}) {
      SCOPED_TRACE(arch + (padded ? " padded" : " full"));
      auto cfg = gpu_config(arch, "bf16");
      Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<LmSource>(8, 64, rows_of(padded)),
                      nullptr, nullptr, testing::quiet_options(true));
      trainer.train_step(true);  // warm-up: allocator, cuBLAS handles, pinned blocks
      trainer.train_step(false);
      std::string error;
      ASSERT_TRUE(set_cuda_sync_debug_error(true)) << "the CUDA plugin cannot set it";
      try {
        for (int i = 0; i < 3; ++i) trainer.train_step(false);
      } catch (const std::exception& e) {
        error = e.what();
      }
      set_cuda_sync_debug_error(false);
      EXPECT_TRUE(error.empty()) << "a non-logging step synchronised with the host: " << error;
      const auto r = trainer.train_step(true);
      EXPECT_TRUE(std::isfinite(r.loss));
    }
  }
}

TEST(GpuTest, SyncFreeStepMatchesTheHostPathOnTheGpu) {
  DNALLM_REQUIRE_GPU();
  auto cfg = gpu_config("bert", "fp32");
  Trainer host(cfg, build_model(cfg, 9), std::make_unique<LmSource>(8, 64, rows_of(true)), nullptr,
               nullptr, testing::quiet_options(false));
  Trainer free(cfg, build_model(cfg, 9), std::make_unique<LmSource>(8, 64, rows_of(true)), nullptr,
               nullptr, testing::quiet_options(true));
  std::printf("sync-free AdamW: %s\n", free.optimizer().fused() ? "fused" : "flat");
  for (int s = 0; s < 4; ++s) {
    const auto h = host.train_step();
    const auto f = free.train_step(true);
    EXPECT_NEAR(f.loss, h.loss, 1e-4 * std::abs(h.loss)) << "step " << h.step;
  }
  // Updates are ~lr = 1e-3 a step: a wrong clip or scale differs by far more than lr / 10.
  EXPECT_TRUE(torch::allclose(free.flat().params(), host.flat().params(), 1e-3, 1e-4));
}

TEST(GpuTest, SaveResumeSaveOnTheGpu) {
  DNALLM_REQUIRE_GPU();
  const auto root = fs::temp_directory_path() / ("dnallm-gpu-test-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto cfg = gpu_config("bert", "bf16");
  cfg.checkpoint.save_steps = 2;
  cfg.checkpoint.keep_last = 0;
  cfg.checkpoint.dir = root.string();
  const uint64_t rows_per_step = 8 * 2;
  torch::Tensor at_step_2;  // the parameters right after step 2, for the snapshot check
  std::vector<double> fresh_s, resumed_s;  // step times (printed: resumed ~ fresh expected)
  {
    auto first = cfg;
    first.training.max_steps = 4;
    Checkpointer ck(first, CheckpointerOptions{});
    TrainerOptions o = testing::quiet_options(true);
    ck.install(o);
    o.after_step.insert(o.after_step.begin(), [&](Trainer& t, const StepResult& r) {
      if (r.step == 2) at_step_2 = t.flat().params().to(torch::kCPU);
      fresh_s.push_back(r.step_s);
      return StepAction::kContinue;
    });
    Trainer t(first, build_model(first, 9), std::make_unique<LmSource>(8, 64, rows_of(true)),
              nullptr, nullptr, o);
    t.run();
  }
  // The side-stream snapshot holds step 2's parameters, not a later update's.
  {
    auto step2 = checkpoint::CheckpointReader::open(root / checkpoint::step_dir_name(2));
    std::vector<float> saved(static_cast<size_t>(at_step_2.numel()));
    step2.read_range(kFlatParamsTensor, 0, saved.size(), saved.data());
    EXPECT_TRUE(torch::equal(torch::from_blob(saved.data(), {at_step_2.numel()}), at_step_2));
  }
  // The save after a resume (step 6) must commit.
  testing::resume_to_end(
      cfg, 4, std::make_unique<LmSource>(8, 64, rows_of(true), 4 * rows_per_step),
      [](Trainer& t) {
        EXPECT_NO_THROW(check_on_device(t));
        EXPECT_TRUE(t.optimizer().exp_avg().is_cuda());
      },
      [&](const StepResult& r) { resumed_s.push_back(r.step_s); });
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  std::printf("median step: fresh %.4f s, resumed %.4f s\n", median(fresh_s), median(resumed_s));
  auto latest = open_resume(cfg, nlohmann::json());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step(), 6);
  fs::remove_all(root);
}

// Note [Optimizer offload]: with training.optimizer_offload the moments live in pinned host
// memory, the device's peak drops by at least the 8 bytes per parameter they took there, and
// the host AdamW trains like the device's (fused on 2.x: close, not bit-equal).
TEST(GpuTest, OptimizerOffloadKeepsTheMomentsOffTheDevice) {
  DNALLM_REQUIRE_GPU();
  struct Measured {
    double peak_mb = 0;
    double loss = 0;
    int64_t parameters = 0;
  };
  auto measure = [](bool offload) {
    auto cfg = gpu_config("bert", "fp32");
    cfg.training.optimizer_offload = offload;
    Measured m;
    torch::cuda::synchronize();
    reset_device_memory_peaks(torch::Device(torch::kCUDA, 0));
    Trainer t(cfg, build_model(cfg, 9), std::make_unique<LmSource>(8, 64, rows_of(true)), nullptr,
              nullptr, testing::quiet_options(true));
    if (offload) {
      EXPECT_TRUE(t.offloaded());
      EXPECT_TRUE(t.optimizer().exp_avg().is_cpu());
      EXPECT_TRUE(t.optimizer().exp_avg().is_pinned());
    } else {
      EXPECT_TRUE(t.optimizer().exp_avg().is_cuda());
    }
    for (int i = 0; i < 3; ++i) m.loss = t.train_step(true).loss;
    torch::cuda::synchronize();
    m.peak_mb = device_memory_stats(t.device()).peak_allocated_mb;
    m.parameters = t.flat().numel();
    return m;
  };
  const Measured plain = measure(false);
  const Measured off = measure(true);
  const double moments_mb = 8.0 * double(plain.parameters) / 1048576.0;
  std::printf(
      "optimizer offload: %lld parameters, peak device memory %.2f MiB -> %.2f MiB "
      "(moments %.2f MiB)\n",
      static_cast<long long>(plain.parameters), plain.peak_mb, off.peak_mb, moments_mb);
  EXPECT_LE(off.peak_mb, plain.peak_mb - 0.9 * moments_mb);
  EXPECT_NEAR(off.loss, plain.loss, 1e-4 * std::abs(plain.loss));
}

TEST(GpuTest, PeakMemoryAndDeviceName) {
  DNALLM_REQUIRE_GPU();
  const torch::Device gpu(torch::kCUDA, 0);
  reset_device_memory_peaks(gpu);
  auto x = torch::empty({64, 1024, 1024}, torch::TensorOptions().device(gpu));  // 256 MiB
  const auto stats = device_memory_stats(gpu);
  ASSERT_TRUE(stats.available);
  EXPECT_GE(stats.peak_allocated_mb, 256.0);
  EXPECT_GE(stats.peak_reserved_mb, stats.peak_allocated_mb);
  EXPECT_NE(device_name(gpu), gpu.str());
  std::printf("device: %s\n", device_name(gpu).c_str());
}

}  // namespace
}  // namespace dnallm::train
