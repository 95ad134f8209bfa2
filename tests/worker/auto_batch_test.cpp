// training.batch_size = "auto" with the real probe: a trial forward/backward of a tiny model on
// CPU, measured against a memory budget, and the resolution that rewrites the batch settings.
// (The search policy itself is tested with a fake probe in batch_search_test.cpp.)
#include "worker/train/auto_batch.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/train/train_setup.hpp"

namespace dnallm::train {
namespace {

using dnallm::testing::expect_error;

Config probe_config(const std::string& task = "pretrain") {
  Config c = parse_config("", "test", {"model.task=" + task});
  c.model.hidden = 32;
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.ffn = 64;
  c.model.max_seq_length = 32;
  c.training.micro_batch_size = 4;
  c.training.grad_accum_steps = 2;
  c.training.device = cfg::Device::kCpu;
  return c;
}

constexpr double kHuge = 1e15;  // bytes: everything fits

// resolve_auto_batch for one process training the model `config` describes.
void resolve_on_one_process(Config& config) {
  auto model = build_model(config, 10);
  SingleProcessSync sync;
  resolve_auto_batch(config, model, sync, 1);
}

TEST(AutoBatchProbe, TrialFitsWithinAGenerousBudgetAndLeavesNoGradients) {
  for (const char* task : {"pretrain", "classification", "regression"}) {
    auto config = probe_config(task);
    auto model = build_model(config, 10);
    auto trial = probe_micro_batch(model, config, 3, torch::kCPU, kHuge);
    EXPECT_TRUE(trial.fits) << task << ": " << trial.why;
    // Resident memory plus 8 bytes of AdamW state per trainable parameter.
    int64_t trainable = 0;
    for (const auto& p : model->parameters()) trainable += p.requires_grad() ? p.numel() : 0;
    EXPECT_GT(trial.peak_bytes, 8.0 * double(trainable)) << task;
    for (const auto& p : model->parameters()) {
      EXPECT_FALSE(p.grad().defined()) << task << ": the probe left a gradient behind";
    }
  }
}

TEST(AutoBatchProbe, TrialOverTheBudgetDoesNotFitAndSaysWhy) {
  auto config = probe_config();
  auto model = build_model(config, 10);
  auto trial = probe_micro_batch(model, config, 2, torch::kCPU, 1024.0);
  EXPECT_FALSE(trial.fits);
  EXPECT_NE(trial.why.find("budget"), std::string::npos) << trial.why;
}

TEST(AutoBatchResolve, KeepsTheGlobalBatchAndTakesTheLargestFittingMicroBatch) {
  auto config = probe_config();
  config.training.batch_size = cfg::BatchSize::kAuto;
  config.training.auto_batch_memory_mb = kHuge / 1048576.0;
  resolve_on_one_process(config);
  // Everything fits: the whole per-rank batch (4 x 2) in one micro-step.
  EXPECT_EQ(config.training.micro_batch_size, 8);
  EXPECT_EQ(config.training.grad_accum_steps, 1);
}

TEST(AutoBatchResolve, WithoutAutoNothingChanges) {
  auto config = probe_config();
  resolve_on_one_process(config);
  EXPECT_EQ(config.training.micro_batch_size, 4);
  EXPECT_EQ(config.training.grad_accum_steps, 2);
}

TEST(AutoBatchResolve, NothingFitsIsAUsageError) {
  auto config = probe_config();
  config.training.batch_size = cfg::BatchSize::kAuto;
  config.training.auto_batch_memory_mb = 0.001;  // about 1 KiB: not even one sequence
  expect_error([&] { resolve_on_one_process(config); }, ExitCode::kUsage, {"auto_batch_memory_mb"});
  EXPECT_EQ(config.training.micro_batch_size, 4);  // untouched
}

}  // namespace
}  // namespace dnallm::train
