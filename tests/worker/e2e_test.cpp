// End to end with the real binaries: dnallm-train on the bundled genome, dnallm-eval on the
// export; a LoRA classifier fine-tuned from that export and scored on a labelled table.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/support/process.hpp"

namespace {

namespace fs = std::filesystem;
using dnallm::testing::kBin;
using dnallm::testing::kSrc;

// stdout only: dnallm-eval's JSON object is parsed from it.
dnallm::testing::CommandResult run(const std::string& cmd) {
  return dnallm::testing::run_shell(cmd, dnallm::testing::Streams::kStdoutOnly);
}

std::string tiny_sets() {
  return " --set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64"
         " --set model.max_seq_length=64 --set training.micro_batch_size=8"
         " --set training.logging_steps=5 --set checkpoint.save_steps=0";
}

class EndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = dnallm::testing::make_temp_dir("e2e_model"); }
  static fs::path dir_;
};
fs::path EndToEnd::dir_;

TEST_F(EndToEnd, TrainExportEvalAndFineTune) {
  const auto ck = (dir_ / "mlm").string();
  auto train = run("cd " + kSrc + " && " + kBin + "dnallm-train --config configs/quickstart.toml" +
                   tiny_sets() + " --set training.max_steps=30 --set training.lr=3e-3" +
                   " --set training.eval_steps=30 --set checkpoint.dir=" + ck + " --metrics-file " +
                   ck + "/metrics.jsonl");
  ASSERT_EQ(train.code, 0) << train.out;
  ASSERT_TRUE(fs::exists(ck + "/final/model.safetensors"));
  ASSERT_TRUE(fs::exists(ck + "/final/tokenizer.json"));
  ASSERT_TRUE(fs::exists(ck + "/final/config.json"));

  auto eval = run(kBin + "dnallm-eval --model " + ck + "/final --fasta " + kSrc +
                  "/data/ecoli_k12_mg1655.fa.gz --max-bases 20000");
  ASSERT_EQ(eval.code, 0) << eval.out;
  auto j = nlohmann::json::parse(eval.out);
  const double bpb = j.at("bits_per_base").get<double>();
  EXPECT_GT(bpb, 1.0);
  EXPECT_LT(bpb, 2.6);  // 30 steps learn at least the base composition (uniform = 2 bits)
  EXPECT_NEAR(j.at("order0_bits_per_base").get<double>(), 2.0, 0.01);  // E. coli ~50% GC
  EXPECT_GT(j.at("tokens").get<int64_t>(), 1000);
  EXPECT_TRUE(j.contains("device"));  // --device auto: cuda:LOCAL_RANK with a GPU, else cpu
  // --device as dnallm-infer's: the CPU asked for by name scores the same; a bad name is 2.
  auto on_cpu = run(kBin + "dnallm-eval --model " + ck + "/final --fasta " + kSrc +
                    "/data/ecoli_k12_mg1655.fa.gz --max-bases 20000 --device cpu --batch-size 5");
  ASSERT_EQ(on_cpu.code, 0) << on_cpu.out;
  auto jc = nlohmann::json::parse(on_cpu.out);
  EXPECT_EQ(jc.at("device").get<std::string>(), "cpu");
  EXPECT_EQ(jc.at("tokens").get<int64_t>(), j.at("tokens").get<int64_t>());
  EXPECT_NEAR(jc.at("bits_per_base").get<double>(), bpb, 1e-4);
  const auto bad_device = run(kBin + "dnallm-eval --model " + ck + "/final --fasta " + kSrc +
                              "/data/ecoli_k12_mg1655.fa.gz --device tpu");
  EXPECT_EQ(bad_device.code, 2);

  // Bad input: exit 3 with a message.
  const auto bad = (dir_ / "bad.fa").string();
  std::ofstream(bad) << ">x\nACGT12\n";
  EXPECT_EQ(run(kBin + "dnallm-eval --model " + ck + "/final --fasta " + bad).code, 3);
  EXPECT_EQ(run(kBin + "dnallm-eval --model " + ck + "/final").code, 2);
  // --logits on our export: framed as dnallm-infer frames ([CLS] .. [SEP], max_seq_length 64);
  // a sequence that does not fit is refused (exit 3), not cut.
  const auto seqs = (dir_ / "seqs.txt").string();
  std::ofstream(seqs) << "ACGTACGTAC\nGGCCA\n";
  const auto logits = run(kBin + "dnallm-eval --model " + ck + "/final --logits " + seqs +
                          " --out " + (dir_ / "logits.safetensors").string());
  ASSERT_EQ(logits.code, 0) << logits.out;
  EXPECT_EQ(nlohmann::json::parse(logits.out).at("rows").get<int64_t>(), 2);
  for (const auto& [bases, code] : {std::pair<size_t, int>{62, 0}, {63, 3}}) {  // char tokens
    std::ofstream(seqs) << std::string(bases, 'A') << "\n";
    EXPECT_EQ(run(kBin + "dnallm-eval --model " + ck + "/final --logits " + seqs + " --out " +
                  (dir_ / "long.safetensors").string())
                  .code,
              code)
        << bases << " bases";
  }

  // Classification table: windows of the genome (label 0) vs the same windows with every A
  // turned into C (label 1): a composition difference a classifier must pick up.
  const std::string genome = dnallm::testing::bundled_genome(200000);
  dnallm::testing::write_composition_table((dir_ / "train.csv").string(), genome, 0, 64);
  dnallm::testing::write_composition_table((dir_ / "eval.csv").string(), genome, 100000, 64);
  const auto ft = (dir_ / "ft").string();
  auto finetune =
      run("cd " + kSrc + " && " + kBin + "dnallm-train --config configs/quickstart.toml" +
          tiny_sets() + " --set model.task=classification --set model.init_from=" + ck + "/final" +
          " --set lora.r=4 --set 'lora.target_modules=[\"query\",\"value\",\"dense\"]'" +
          " --set 'data.train_files=[\"" + (dir_ / "train.csv").string() + "\"]'" +
          " --set 'data.eval_files=[\"" + (dir_ / "eval.csv").string() + "\"]'" +
          " --set data.eval_fraction=0 --set training.max_steps=40 --set training.lr=1e-2"
          " --set training.eval_steps=0" +
          " --set checkpoint.dir=" + ft + " --metrics-file " + ft + "/metrics.jsonl");
  ASSERT_EQ(finetune.code, 0) << finetune.out;
  // A fine-tune whose [tokenizer] differs from its base model's is a usage error (exit 2),
  // not a run with silently untrained or reinterpreted embeddings.
  auto mismatch =
      run("cd " + kSrc + " && " + kBin + "dnallm-train --config configs/quickstart.toml" +
          tiny_sets() + " --set model.task=classification --set model.init_from=" + ck + "/final" +
          " --set tokenizer.kind=kmer --set tokenizer.k=3 --set lora.r=4" +
          " --set 'data.train_files=[\"" + (dir_ / "train.csv").string() + "\"]'" +
          " --set data.eval_fraction=0 --set training.max_steps=1 --set checkpoint.dir=" + ft +
          "_mismatch");
  EXPECT_EQ(mismatch.code, 2) << mismatch.out;
  auto scored =
      run(kBin + "dnallm-eval --model " + ft + "/final --table " + (dir_ / "eval.csv").string());
  ASSERT_EQ(scored.code, 0) << scored.out;
  auto c = nlohmann::json::parse(scored.out);
  EXPECT_EQ(c.at("rows").get<int64_t>(), 64);
  EXPECT_GE(c.at("accuracy").get<double>(), 0.8) << scored.out;
  EXPECT_TRUE(c.contains("mcc"));
}

// A causal model scores every base once: the loader wraps around to fill the last batch,
// and those repeated windows must not be scored again (17 windows, batches of 8 -> 24 rows).
TEST_F(EndToEnd, CausalEvalScoresEachBaseAtMostOnce) {
  const auto ck = (dir_ / "gpt").string();
  auto train = run("cd " + kSrc + " && " + kBin + "dnallm-train --config configs/gpt.toml" +
                   tiny_sets() + " --set training.max_steps=3 --set training.eval_steps=0" +
                   " --set checkpoint.dir=" + ck + " --metrics-file " + ck + "/metrics.jsonl");
  ASSERT_EQ(train.code, 0) << train.out;
  const auto fasta = (dir_ / "small.fa").string();
  {
    std::ofstream out(fasta);
    out << ">small\n";
    const char* acgt = "ACGT";
    uint32_t x = 12345;
    for (int i = 0; i < 17 * 62 + 30; ++i) {
      x = x * 1103515245u + 12345u;
      out << acgt[(x >> 16) & 3];
    }
    out << "\n";
  }
  auto eval = run(kBin + "dnallm-eval --model " + ck + "/final --fasta " + fasta);
  ASSERT_EQ(eval.code, 0) << eval.out;
  auto j = nlohmann::json::parse(eval.out);
  EXPECT_GT(j.at("bases").get<int64_t>(), 15 * 62) << eval.out;
  EXPECT_LE(j.at("bases").get<int64_t>(), 17 * 62 + 30) << eval.out;
}

// --profile START:END writes a Kineto trace, or (a LibTorch without Kineto, as Debian's)
// exits 2 naming Kineto before training; logging.peak_tflops puts MFU into the step lines and
// the summary; sync-free steps still log loss and grad norm on logging steps.
TEST_F(EndToEnd, ProfileTraceAndMfu) {
  const auto ck = (dir_ / "profile").string();
  const std::string base = "cd " + kSrc + " && " + kBin +
                           "dnallm-train --config configs/quickstart.toml" + tiny_sets() +
                           " --set training.max_steps=4 --set training.logging_steps=2" +
                           " --set training.sync_free=on --set checkpoint.dir=" + ck;
  auto profiled = run("{ " + base + " --profile 2:3 2>&1 ; }");
  const std::string trace = ck + "/trace_steps_2-3_rank_0.json";
  if (profiled.code == 2) {
    EXPECT_NE(profiled.out.find("Kineto"), std::string::npos) << profiled.out;
    EXPECT_FALSE(fs::exists(trace));
  } else {
    ASSERT_EQ(profiled.code, 0) << profiled.out;
    std::ifstream in(trace);
    ASSERT_TRUE(in.good()) << "no trace at " << trace << "\n" << profiled.out;
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_NE(text.str().find("traceEvents"), std::string::npos);
    EXPECT_NE(profiled.out.find(trace), std::string::npos) << "the log does not say where";
  }
  auto bad = run("{ " + base + " --profile 3:2 2>&1 ; }");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("START:END"), std::string::npos) << bad.out;

  const std::string metrics = ck + "/metrics.jsonl";
  auto train =
      run("{ " + base + " --set logging.peak_tflops=0.5 --metrics-file " + metrics + " 2>&1 ; }");
  ASSERT_EQ(train.code, 0) << train.out;
  EXPECT_NE(train.out.find("MFU"), std::string::npos) << train.out;
  std::ifstream in(metrics);
  std::string line;
  int steps = 0;
  bool summary = false;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("step") && !j.contains("event")) {
      ++steps;
      EXPECT_GT(j.at("mfu").get<double>(), 0.0) << line;
      EXPECT_GT(j.at("loss").get<double>(), 0.0) << line;
      EXPECT_GT(j.at("grad_norm").get<double>(), 0.0) << line;
    }
    if (j.value("event", "") == "summary") {
      summary = true;
      EXPECT_GT(j.at("mfu").get<double>(), 0.0) << line;
      EXPECT_FALSE(j.contains("peak_gpu_mb")) << "CPU run reports GPU memory: " << line;
    }
  }
  EXPECT_EQ(steps, 3);  // steps 1, 2 and 4
  EXPECT_TRUE(summary);
}

TEST(TrainCli, HelpUsageAndWorldSize) {
  auto help = run(kBin + "dnallm-train --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--set"), std::string::npos);
  EXPECT_EQ(run(kBin + "dnallm-train --no-such-flag").code, 2);
  EXPECT_EQ(run(kBin + "dnallm-train --set model.arch=rnn").code, 2);
  // An inconsistent rank environment is refused before anything connects.
  auto bad_rank = run("WORLD_SIZE=2 RANK=2 " + kBin + "dnallm-train");
  EXPECT_EQ(bad_rank.code, 2);
  EXPECT_EQ(run(kBin + "dnallm-eval --help").code, 0);
}

}  // namespace
