// data.seq_len_warmup through dnallm-train (Note [Sequence-length warm-up]): a tiny HyenaDNA on
// the bundled genome, 64 tokens, stages of 16 (steps 1-3) and 32 (steps 4-5), then 64. The
// logged batch shapes are the stages' with constant tokens per step; a run stopped in the middle
// of the first stage and resumed ends bit-identical to the uninterrupted one; 2 ranks train like
// 1 rank; bad schedules are exit 2 naming the key.
#include <cmath>
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

const std::string kWarmup =
    "--set 'data.seq_len_warmup=[{steps = 3, seq_len = 16}, {steps = 2, seq_len = 32}]'";

struct WarmupRun {
  int rc = -1;
  std::string log;
  std::vector<nlohmann::json> steps;  // the metrics' step lines
  std::map<std::string, std::vector<float>> params;
};

// Global batch 12 windows = micro x accum x world; one intra-op thread (runs compared bit for
// bit, see resume_test.cpp); constant LR, so a run stopped early has the schedule of a long one.
WarmupRun train_warmup(const std::string& ckpt, const std::string& name, int world, int steps,
                       int save_steps, int accum = 1, const std::string& extra = kWarmup) {
  const std::string metrics = (fs::path(ckpt).parent_path() / (name + ".jsonl")).string();
  const std::string launcher =
      world > 1 ? fmt::format("{}dnallm-launch --nproc-per-node {} -- ", kBin, world) : "";
  const std::string cmd = fmt::format(
      "cd {src} && OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 {launcher}{bin}dnallm-train "
      "--set model.arch=hyena --set model.hidden=32 --set model.layers=2 --set model.ffn=64 "
      "--set model.max_seq_length=64 --set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
      "--set training.max_steps={steps} --set training.micro_batch_size={micro} "
      "--set training.grad_accum_steps={accum} "
      "--set training.lr=3e-3 --set training.lr_scheduler=constant --set training.warmup_steps=0 "
      "--set training.logging_steps=1 --set training.seed=7 --set parallel.backend=gloo "
      "--set checkpoint.dir={ckpt} --set checkpoint.save_steps={save} --set checkpoint.keep_last=0 "
      "--metrics-file {metrics} {extra}",
      fmt::arg("src", kSrc), fmt::arg("launcher", launcher), fmt::arg("bin", kBin),
      fmt::arg("steps", steps), fmt::arg("micro", 12 / world / accum), fmt::arg("accum", accum),
      fmt::arg("ckpt", ckpt), fmt::arg("save", save_steps), fmt::arg("metrics", metrics),
      fmt::arg("extra", extra));
  WarmupRun r;
  r.rc = run_command(cmd, &r.log);
  r.log = cmd + "\n" + r.log;
  if (fs::exists(metrics)) {
    std::ifstream f(metrics);
    for (std::string line; std::getline(f, line);) {
      auto j = nlohmann::json::parse(line);
      if (!j.contains("event")) r.steps.push_back(j);
    }
  }
  const std::string weights = ckpt + "/final/model.safetensors";
  if (r.rc == 0 && fs::exists(weights)) r.params = read_safetensors_f32(weights);
  return r;
}

double loss_at(const WarmupRun& r, int64_t step) {
  for (const auto& j : r.steps)
    if (j.at("step").get<int64_t>() == step) return j.at("loss").get<double>();
  ADD_FAILURE() << "no step " << step;
  return std::nan("");
}

class SeqLenWarmup : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    reference_ = new WarmupRun(train_warmup(make_temp_dir("warmup_ref") + "/ckpt", "ref", 1, 8, 0));
  }
  static void TearDownTestSuite() { delete reference_; }
  void SetUp() override {
    ASSERT_EQ(reference_->rc, 0) << reference_->log;
    ASSERT_EQ(reference_->steps.size(), 8u) << reference_->log;
  }
  static WarmupRun* reference_;
};
WarmupRun* SeqLenWarmup::reference_ = nullptr;

TEST_F(SeqLenWarmup, StepsHaveTheStagesShapesAndConstantTokens) {
  for (const auto& j : reference_->steps) {
    const auto step = j.at("step").get<int64_t>();
    const int64_t len = step <= 3 ? 16 : step <= 5 ? 32 : 64;
    EXPECT_EQ(j.at("seq_len").get<int64_t>(), len) << "step " << step;
    EXPECT_EQ(j.at("rows").get<int64_t>(), 12 * 64 / len) << "step " << step;
    EXPECT_TRUE(std::isfinite(j.at("loss").get<double>())) << "step " << step;
  }
  // The progress log shows the length while the warm-up changes it.
  EXPECT_NE(reference_->log.find("seq_len 16 x 48 rows"), std::string::npos) << reference_->log;
  EXPECT_NE(reference_->log.find("seq_len 64 x 12 rows"), std::string::npos) << reference_->log;
}

TEST_F(SeqLenWarmup, StoppedInTheFirstStageAndResumedIsBitIdentical) {
  const std::string ckpt = make_temp_dir("warmup_resume") + "/ckpt";
  const WarmupRun first = train_warmup(ckpt, "first", 1, 2, 2);
  ASSERT_EQ(first.rc, 0) << first.log;
  const WarmupRun second = train_warmup(ckpt, "second", 1, 8, 0);
  ASSERT_EQ(second.rc, 0) << second.log;
  EXPECT_NE(second.log.find("resumed from"), std::string::npos) << second.log;
  ASSERT_EQ(second.steps.size(), 6u);
  for (int64_t step = 3; step <= 8; ++step) {
    EXPECT_EQ(loss_at(second, step), loss_at(*reference_, step)) << "step " << step;
  }
  ASSERT_EQ(second.params.size(), reference_->params.size());
  ASSERT_FALSE(second.params.empty());
  for (const auto& [name, v] : reference_->params) {
    const auto& w = second.params.at(name);
    ASSERT_EQ(v.size(), w.size()) << name;
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], w[i]) << name << "[" << i << "]";
  }
}

// One rank with the two ranks' micro-batches as its two micro-steps: the same global batch in
// the same micro-batch shapes. (Against one micro-batch of 12 windows, 48 rows of 16 tokens, the
// losses differ by up to 2e-4 relative at step 8: LibTorch's kernels sum in another order for
// another batch size, and this tiny model at lr 3e-3 amplifies that; 1 rank with 2 micro-steps
// of 6 differs from 1 micro-step of 12 just as much.)
TEST_F(SeqLenWarmup, TwoRanksTrainLikeOneRank) {
  const WarmupRun one = train_warmup(make_temp_dir("warmup_accum") + "/ckpt", "accum", 1, 8, 0, 2);
  ASSERT_EQ(one.rc, 0) << one.log;
  const WarmupRun two = train_warmup(make_temp_dir("warmup_two") + "/ckpt", "two", 2, 8, 0);
  ASSERT_EQ(two.rc, 0) << two.log;
  ASSERT_EQ(two.steps.size(), 8u);
  for (const auto& j : two.steps) {
    const auto step = j.at("step").get<int64_t>();
    const int64_t len = step <= 3 ? 16 : step <= 5 ? 32 : 64;
    EXPECT_EQ(j.at("seq_len").get<int64_t>(), len) << "step " << step;
    EXPECT_EQ(j.at("rows").get<int64_t>(), 6 * 64 / len) << "rank 0's rows, step " << step;
    const double expected = loss_at(one, step);
    EXPECT_NEAR(j.at("loss").get<double>(), expected, 2e-5 * std::abs(expected)) << "step " << step;
  }
  double max_diff = 0;
  for (const auto& [name, v] : one.params) {
    const auto& w = two.params.at(name);
    for (size_t i = 0; i < v.size(); ++i)
      max_diff = std::max(max_diff, double(std::abs(v[i] - w[i])));
  }
  EXPECT_LT(max_diff, 2e-4);
}

TEST(SeqLenWarmupSchedule, BadSchedulesAreExit2NamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[{steps = 2, seq_len = 32}, {steps = 2, seq_len = 16}]", "must be longer than the stage"},
      {"[{steps = 2, seq_len = 24}]", "must divide model.max_seq_length = 64"},
      {"[{steps = 2, seq_len = 64}]", "must be shorter than model.max_seq_length = 64"},
      {"[{steps = 2, seq_len = 128}]", "must be shorter than model.max_seq_length = 64"},
      {"[{steps = 0, seq_len = 16}]", "steps is 0"},
      {"[{steps = 2, length = 16}]", "unknown key 'length'"},
      {"[16, 32]", "data.seq_len_warmup' must be a list of {steps = N, seq_len = N} tables"},
  };
  for (const auto& [value, message] : cases) {
    const std::string cmd = fmt::format(
        "cd {} && {}dnallm-train --print-config --set model.arch=hyena "
        "--set model.max_seq_length=64 --set 'data.seq_len_warmup={}'",
        kSrc, kBin, value);
    std::string log;
    EXPECT_EQ(run_command(cmd, &log), 2) << cmd << "\n" << log;
    EXPECT_NE(log.find("data.seq_len_warmup"), std::string::npos) << log;
    EXPECT_NE(log.find(message), std::string::npos) << value << ": " << log;
  }
  // Fine-tuning cuts no labelled records.
  std::string log;
  EXPECT_EQ(run_command(fmt::format("cd {} && {}dnallm-train --print-config --set "
                                    "model.task=classification --set "
                                    "'data.seq_len_warmup=[{{steps = 2, seq_len = 16}}]'",
                                    kSrc, kBin),
                        &log),
            2)
      << log;
  EXPECT_NE(log.find("data.seq_len_warmup is for pre-training"), std::string::npos) << log;
}

}  // namespace
}  // namespace dnallm::testing
