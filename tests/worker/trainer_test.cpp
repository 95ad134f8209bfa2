// Trainer: accumulation equivalence, NaN stop, fp16 overflow skip, metrics and export.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "worker/train/train_setup.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {
namespace {

// Deterministic masked-LM rows: row r of the stream is a function of r only.
data::Batch make_rows(uint64_t first_row, int64_t rows, int64_t seq) {
  data::Batch b;
  b.rows = rows;
  b.seq_len = seq;
  for (int64_t r = 0; r < rows; ++r) {
    std::mt19937_64 rng(1000 + first_row + r);
    for (int64_t i = 0; i < seq; ++i) {
      const int64_t base = 5 + int64_t(rng() % 4);
      const bool masked = i > 0 && rng() % 100 < 30;
      b.input_ids.push_back(i == 0 ? 2 : (masked ? 4 : base));
      b.attention_mask.push_back(1);
      b.labels.push_back(masked ? base : data::kIgnoreIndex);
      b.num_label_tokens += masked;
      b.num_bases += i > 0;
    }
  }
  return b;
}

class SyntheticSource : public BatchSource {
 public:
  SyntheticSource(int64_t rows, int64_t seq) : rows_(rows), seq_(seq) {}
  data::Batch next() override {
    auto b = make_rows(cursor_, rows_, seq_);
    cursor_ += rows_;
    return b;
  }
  void rewind() override { cursor_ = 0; }

 private:
  int64_t rows_, seq_;
  uint64_t cursor_ = 0;
};

Config tiny_config() {
  Config c;
  c.model.hidden = 32;
  c.model.layers = 2;
  c.model.heads = 4;
  c.model.ffn = 64;
  c.model.max_seq_length = 16;
  c.training.max_steps = 3;
  c.training.lr = 1e-2;
  c.training.warmup_steps = 1;
  c.training.logging_steps = 1;
  c.training.device = cfg::Device::kCpu;
  c.checkpoint.save_final = false;
  return c;
}

// tiny_config() writing its checkpoints, final export and metrics into `dir` (emptied first).
Config run_config(const std::filesystem::path& dir) {
  std::filesystem::remove_all(dir);
  auto c = tiny_config();
  c.checkpoint.dir = dir.string();
  c.checkpoint.save_final = true;
  c.logging.metrics_file = (dir / "metrics.jsonl").string();
  return c;
}

TrainerOptions quiet() {
  TrainerOptions o;
  o.console_progress = false;
  return o;
}

// Note [Dropout randomness]: a pure function of (seed, step, micro-step, rank) that tells
// every coordinate apart, so ranks and micro-steps draw different masks.
TEST(TrainerTest, DropoutSeedDependsOnEveryCoordinate) {
  const uint64_t base = dropout_seed(7, 5, 0, 0);
  EXPECT_EQ(base, dropout_seed(7, 5, 0, 0));
  std::set<uint64_t> seen{base};
  seen.insert(dropout_seed(8, 5, 0, 0));
  seen.insert(dropout_seed(7, 6, 0, 0));
  seen.insert(dropout_seed(7, 5, 1, 0));
  seen.insert(dropout_seed(7, 5, 0, 1));
  EXPECT_EQ(seen.size(), 5u);
  // Swapping coordinates does not collide (step 1 rank 0 vs step 0 rank 1).
  EXPECT_NE(dropout_seed(7, 1, 0, 0), dropout_seed(7, 0, 0, 1));
}

TEST(TrainerTest, AccumulationEqualsOneBigBatch) {
  auto big_cfg = tiny_config();
  big_cfg.training.micro_batch_size = 4;
  big_cfg.training.grad_accum_steps = 1;
  auto acc_cfg = tiny_config();
  acc_cfg.training.micro_batch_size = 2;
  acc_cfg.training.grad_accum_steps = 2;
  Trainer big(big_cfg, build_model(big_cfg, 9), std::make_unique<SyntheticSource>(4, 16), nullptr,
              nullptr, quiet());
  Trainer acc(acc_cfg, build_model(acc_cfg, 9), std::make_unique<SyntheticSource>(2, 16), nullptr,
              nullptr, quiet());
  ASSERT_TRUE(torch::equal(big.flat().params(), acc.flat().params()));
  auto initial = big.flat().params().clone();
  for (int s = 0; s < 3; ++s) {
    auto a = big.train_step();
    auto b = acc.train_step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(a.loss));
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * a.grad_norm);
    // The gradients of the step (still in the flat buffers) agree to float rounding.
    EXPECT_TRUE(torch::allclose(big.flat().grads(), acc.flat().grads(), 1e-4, 1e-7))
        << "step " << s << " max |grad diff| "
        << (big.flat().grads() - acc.flat().grads()).abs().max().item<double>();
  }
  // Adam divides by sqrt(v): near-zero gradients amplify rounding, hence the looser atol.
  EXPECT_TRUE(torch::allclose(big.flat().params(), acc.flat().params(), 1e-5, 2e-5))
      << "max |diff| " << (big.flat().params() - acc.flat().params()).abs().max().item<double>();
  EXPECT_FALSE(torch::allclose(big.flat().params(), initial, 1e-5, 1e-6));
  // Per-micro-batch mean normalisation (the common mistake) would not match: the micro-batches
  // hold different numbers of label tokens. Check that premise so the test can fail.
  EXPECT_NE(make_rows(0, 2, 16).num_label_tokens, make_rows(2, 2, 16).num_label_tokens);
}

TEST(TrainerTest, NanLossStopsWithAClearError) {
  auto cfg = tiny_config();
  cfg.training.micro_batch_size = 2;
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<SyntheticSource>(2, 16), nullptr,
                  nullptr, quiet());
  trainer.flat().params().narrow(0, 0, 1000).fill_(std::nan(""));
  try {
    trainer.train_step();
    FAIL() << "NaN loss accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss is nan"), std::string::npos) << e.what();
  }
}

TEST(TrainerTest, Fp16OverflowSkipsTheStep) {
  auto cfg = tiny_config();
  cfg.training.micro_batch_size = 2;
  cfg.training.precision = cfg::Precision::kFp16;
  auto options = quiet();
  options.initial_loss_scale = 1e38;  // scaled gradients overflow fp32
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<SyntheticSource>(2, 16), nullptr,
                  nullptr, options);
  auto before = trainer.flat().params().clone();
  auto r = trainer.train_step();
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(trainer.loss_scaler().skipped_steps(), 1);
  EXPECT_TRUE(torch::equal(before, trainer.flat().params()));
  EXPECT_EQ(trainer.loss_scaler().scale(), 5e37);
}

TEST(TrainerTest, Bf16TrainsWithFp32MasterWeights) {
  auto cfg = tiny_config();
  cfg.training.micro_batch_size = 2;
  cfg.training.precision = cfg::Precision::kBf16;
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<SyntheticSource>(2, 16), nullptr,
                  nullptr, quiet());
  auto r = trainer.train_step();
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_EQ(trainer.flat().params().scalar_type(), torch::kFloat32);
}

TEST(TrainerTest, GptWithRotaryAndCheckpointingLearns) {
  auto cfg = tiny_config();
  cfg.model.arch = cfg::Arch::kGpt;
  cfg.model.position = cfg::Position::kRotary;
  cfg.model.gradient_checkpointing = true;
  cfg.training.micro_batch_size = 2;
  cfg.training.lr_scheduler = cfg::LrScheduler::kConstant;
  // Causal rows: labels = input ids (the model shifts), position 0 not scored.
  class CausalSource : public BatchSource {
   public:
    data::Batch next() override {
      auto b = make_rows(0, 2, 16);  // the same rows every step: must be memorised
      for (int64_t i = 0; i < b.rows * b.seq_len; ++i) {
        b.input_ids[i] = 5 + (i * 7 % 11) % 4;
        b.labels[i] = i % b.seq_len == 0 ? data::kIgnoreIndex : b.input_ids[i];
      }
      b.num_label_tokens = b.rows * (b.seq_len - 1);
      return b;
    }
  };
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<CausalSource>(), nullptr, nullptr,
                  quiet());
  double first = 0, last = 0;
  for (int s = 0; s < 30; ++s) {
    auto r = trainer.train_step();
    if (s == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, 0.5 * first);
}

// Note [Step hooks]: hooks run in list order after every step; the first kStop ends run() at
// once, skipping the hooks after it, at_end, the export and the summary.
TEST(TrainerTest, StepHooksRunInOrderAndAStopEndsTheRun) {
  auto cfg = run_config(std::filesystem::temp_directory_path() / "dnallm_trainer_hooks_test");
  cfg.training.micro_batch_size = 2;
  cfg.training.max_steps = 6;
  std::vector<std::string> calls;
  auto options = quiet();
  options.before_step.push_back(
      [&](Trainer&, int64_t step) { calls.push_back("before " + std::to_string(step)); });
  options.after_step.push_back([&](Trainer& t, const StepResult& r) {
    EXPECT_EQ(t.step(), r.step);
    calls.push_back("a " + std::to_string(r.step));
    return StepAction::kContinue;
  });
  options.after_step.push_back([&](Trainer&, const StepResult& r) {
    calls.push_back("b " + std::to_string(r.step));
    return r.step == 3 ? StepAction::kStop : StepAction::kContinue;
  });
  options.after_step.push_back([&](Trainer&, const StepResult& r) {
    calls.push_back("c " + std::to_string(r.step));
    return StepAction::kContinue;
  });
  options.at_end.push_back([&](Trainer&) { calls.push_back("end"); });
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<SyntheticSource>(2, 16), nullptr,
                  nullptr, options);
  EXPECT_EQ(trainer.run(), RunEnd::kStopped);
  EXPECT_EQ(trainer.step(), 3);
  const std::vector<std::string> expected = {
      "before 1", "a 1", "b 1", "c 1", "before 2", "a 2", "b 2", "c 2", "before 3", "a 3", "b 3"};
  EXPECT_EQ(calls, expected);
  EXPECT_FALSE(std::filesystem::exists(trainer.export_dir()));
  std::ifstream f(cfg.logging.metrics_file);
  std::string line;
  while (std::getline(f, line)) EXPECT_EQ(line.find("summary"), std::string::npos) << line;

  // Without a stop: every hook every step, at_end once, RunEnd::kCompleted.
  calls.clear();
  options.after_step.erase(options.after_step.begin() + 1);
  cfg.training.max_steps = 2;
  cfg.checkpoint.save_final = false;
  Trainer again(cfg, build_model(cfg, 9), std::make_unique<SyntheticSource>(2, 16), nullptr,
                nullptr, options);
  EXPECT_EQ(again.run(), RunEnd::kCompleted);
  const std::vector<std::string> all = {"before 1", "a 1", "c 1", "before 2", "a 2", "c 2", "end"};
  EXPECT_EQ(calls, all);
}

TEST(TrainerTest, RunWritesMetricsAndExports) {
  const auto dir = std::filesystem::temp_directory_path() / "dnallm_trainer_run_test";
  auto cfg = run_config(dir);
  cfg.training.micro_batch_size = 2;
  cfg.training.max_steps = 4;
  cfg.training.eval_steps = 2;
  cfg.training.eval_batches = 2;
  auto options = quiet();
  options.write_tokenizer = [](const std::string& d, const models::ParameterUnits&, bool write) {
    if (write) std::ofstream(d + "/tokenizer.json") << "{}\n";
  };
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<SyntheticSource>(2, 16),
                  std::make_unique<SyntheticSource>(2, 16), nullptr, options);
  trainer.run();
  std::ifstream f(cfg.logging.metrics_file);
  std::string line;
  int steps = 0, evals = 0, summaries = 0;
  nlohmann::json last;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("event")) {
      ++steps;
      for (auto key : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_s",
                       "comm_exposed_s", "data_wait_s"}) {
        EXPECT_TRUE(j.at(key).is_number()) << key;
      }
    } else if (j["event"] == "eval") {
      ++evals;
      EXPECT_GT(j.at("bits_per_base").get<double>(), 0.0);
    } else if (j["event"] == "summary") {
      ++summaries;
      last = j;
    }
  }
  EXPECT_EQ(steps, 4);
  EXPECT_EQ(evals, 2);
  ASSERT_EQ(summaries, 1);
  EXPECT_EQ(last["steps"], 4);
  EXPECT_EQ(last["tokens"], 4 * 2 * 16);
  EXPECT_EQ(last["world_size"], 1);
  EXPECT_GT(last["peak_rss_mb"].get<double>(), 0.0);
  auto final_dir = dir / "final";
  EXPECT_TRUE(std::filesystem::exists(final_dir / "tokenizer.json"));
  auto loaded = models::load_exported_model(final_dir.string());
  // The exported model scores like the trained one.
  SyntheticSource eval_source(2, 16);
  auto a = evaluate(trainer.model(), eval_source, 2, torch::kCPU);
  auto b = evaluate(loaded, eval_source, 2, torch::kCPU);
  EXPECT_NEAR(a.loss, b.loss, 1e-5);
  EXPECT_NEAR(a.bits_per_base, a.loss / std::log(2.0), 1e-9);  // char tokens: 1 base each
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dnallm::train
