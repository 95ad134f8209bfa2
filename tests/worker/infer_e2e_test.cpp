// dnallm-infer end to end with the real binaries: a tiny model trained and exported by
// dnallm-train; embed with 2 ranks under dnallm-launch equals 1 process (rows and ids, input
// order); generate with the KV cache equals without; predict writes one row per sequence;
// bad input fails with the documented exit codes; a QLoRA fine-tune (lora.quantize_base =
// "nf4") trains and exports through dnallm-train.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/support/process.hpp"
#include "worker/infer/embedding_writer.hpp"

namespace {

namespace fs = std::filesystem;
using dnallm::testing::kBin;
using dnallm::testing::kSrc;
using dnallm::testing::read_text;

// stdout, then stderr.
using dnallm::testing::run_shell;

const std::string kTinyRun =
    " --set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64"
    " --set model.max_seq_length=64 --set training.micro_batch_size=8"
    " --set training.logging_steps=5 --set checkpoint.save_steps=0 --set training.eval_steps=0";

class InferEndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = dnallm::testing::make_temp_dir("infer_e2e");
    // 23 sequences of varied lengths (some longer than 64 tokens: cut), uneven over 2 ranks.
    std::ofstream f(dir_ / "in.fa");
    uint32_t x = 99;
    for (int i = 0; i < 23; ++i) {
      f << ">s" << i << "\n";
      const int len = 8 + (i * 17) % 90;
      for (int j = 0; j < len; ++j) {
        x = x * 1103515245u + 12345u;
        f << "ACGT"[(x >> 16) & 3];
      }
      f << "\n";
    }
  }
  static std::string train(const std::string& name, const std::string& config,
                           const std::string& extra) {
    const auto ck = (dir_ / name).string();
    if (fs::exists(ck + "/final/model.safetensors")) return ck + "/final";
    auto r = run_shell("cd " + kSrc + " && " + kBin + "dnallm-train --config " + config + kTinyRun +
                       " --set checkpoint.dir=" + ck + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    return ck + "/final";
  }
  static fs::path dir_;
};
fs::path InferEndToEnd::dir_;

TEST_F(InferEndToEnd, TwoRanksUnderTheLauncherEqualOneProcess) {
  const auto model = train("mlm", "configs/quickstart.toml", " --set training.max_steps=3");
  const auto in = (dir_ / "in.fa").string();
  for (const std::string pooling : {"mean", "tokens"}) {
    const auto one = (dir_ / ("one_" + pooling + ".npy")).string();
    const auto two = (dir_ / ("two_" + pooling + ".npy")).string();
    const std::string args = " embed --device cpu --batch-size 4 --pooling " + pooling +
                             " --model " + model + " --input " + in;
    auto r1 = run_shell(kBin + "dnallm-infer" + args + " --out " + one);
    ASSERT_EQ(r1.code, 0) << r1.out;
    auto r2 = run_shell(kBin + "dnallm-launch --nproc-per-node 2 -- " + kBin + "dnallm-infer" +
                        args + " --out " + two);
    ASSERT_EQ(r2.code, 0) << r2.out;
    auto a = dnallm::infer::read_npy(one);
    auto b = dnallm::infer::read_npy(two);
    ASSERT_EQ(a.shape, b.shape);
    EXPECT_EQ(a.shape[1], 32);
    if (pooling == "mean") {
      EXPECT_EQ(a.shape[0], 23);
    }
    const float* fa = reinterpret_cast<const float*>(a.data.data());
    const float* fb = reinterpret_cast<const float*>(b.data.data());
    double worst = 0;
    for (size_t i = 0; i < a.data.size() / 4; ++i)
      worst = std::max(worst, double(std::fabs(fa[i] - fb[i])));
    EXPECT_LT(worst, 1e-4);
    EXPECT_EQ(read_text(dnallm::infer::ids_path(one)), read_text(dnallm::infer::ids_path(two)));
    std::string expected_ids;
    for (int i = 0; i < 23; ++i) expected_ids += "s" + std::to_string(i) + "\n";
    EXPECT_EQ(read_text(dnallm::infer::ids_path(two)), expected_ids);
    if (pooling == "tokens") {
      EXPECT_EQ(read_text(dnallm::infer::offsets_path(one)),
                read_text(dnallm::infer::offsets_path(two)));
    }
    for (const auto& e : fs::directory_iterator(dir_)) {
      EXPECT_EQ(e.path().string().find(".part"), std::string::npos) << e.path();
    }
  }
  // INT8 embeddings stay close to fp32 (cosine > 0.99 for every sequence).
  const auto q = (dir_ / "int8.npy").string();
  auto rq = run_shell(kBin + "dnallm-infer embed --device cpu --quantize int8 --model " + model +
                      " --input " + in + " --out " + q);
  ASSERT_EQ(rq.code, 0) << rq.out;
  auto a = dnallm::infer::read_npy((dir_ / "one_mean.npy").string());
  auto b = dnallm::infer::read_npy(q);
  const float* fa = reinterpret_cast<const float*>(a.data.data());
  const float* fb = reinterpret_cast<const float*>(b.data.data());
  for (int s = 0; s < 23; ++s) {
    double dot = 0, na = 0, nb = 0;
    for (int j = 0; j < 32; ++j) {
      dot += fa[s * 32 + j] * fb[s * 32 + j];
      na += fa[s * 32 + j] * fa[s * 32 + j];
      nb += fb[s * 32 + j] * fb[s * 32 + j];
    }
    EXPECT_GT(dot / std::sqrt(na * nb), 0.99) << "sequence " << s;
  }
}

TEST_F(InferEndToEnd, GenerateWithCacheEqualsWithoutAndBadInputExitCodes) {
  const auto gpt = train("gpt", "configs/gpt.toml", " --set training.max_steps=3");
  const std::string base = kBin + "dnallm-infer generate --device cpu --model " + gpt +
                           " --prompt ACGTACGTAA --prompt TTGACA --prompt GGGCCCAT"
                           " --max-new-tokens 20 --temperature 0.7 --top-k 3 --seed 5";
  auto cached = run_shell(base + " --log-level error");
  ASSERT_EQ(cached.code, 0) << cached.out;
  auto uncached = run_shell(base + " --no-cache --log-level error");
  ASSERT_EQ(uncached.code, 0) << uncached.out;
  EXPECT_EQ(cached.out, uncached.out);
  EXPECT_EQ(cached.out.rfind(">prompt1 generated\nACGTACGTAA", 0), 0u) << cached.out;
  EXPECT_NE(cached.out.find(">prompt3 generated\nGGGCCCAT"), std::string::npos);

  const auto mlm = train("mlm", "configs/quickstart.toml", " --set training.max_steps=3");
  // A masked LM cannot generate; predict needs a classifier: usage errors (2).
  EXPECT_EQ(run_shell(kBin + "dnallm-infer generate --model " + mlm + " --prompt ACGT").code, 2);
  EXPECT_EQ(run_shell(kBin + "dnallm-infer predict --model " + mlm + " --input " +
                      (dir_ / "in.fa").string())
                .code,
            2);
  EXPECT_EQ(run_shell(kBin + "dnallm-infer embed --model " + mlm + " --input " +
                      (dir_ / "in.fa").string() + " --out " + (dir_ / "x.txt").string())
                .code,
            2);
  EXPECT_EQ(run_shell(kBin + "dnallm-infer embed --model " + mlm + " --device cuda:7 --input " +
                      (dir_ / "in.fa").string() + " --out " + (dir_ / "x.npy").string())
                .code,
            2);
  EXPECT_EQ(run_shell(kBin + "dnallm-infer").code, 2);
  // Bad data (3): an invalid base, a missing file. A directory that is not a model is a usage
  // error (2, Note [One model loader]: one message naming what was looked at).
  std::ofstream(dir_ / "bad.fa") << ">x\nACGT12\n";
  auto bad = run_shell(kBin + "dnallm-infer embed --model " + mlm + " --input " +
                       (dir_ / "bad.fa").string() + " --out " + (dir_ / "bad.npy").string());
  EXPECT_EQ(bad.code, 3) << bad.out;
  EXPECT_FALSE(fs::exists(dir_ / "bad.npy"));
  EXPECT_EQ(run_shell(kBin + "dnallm-infer embed --model " + mlm +
                      " --input /nonexistent.fa --out " + (dir_ / "y.npy").string())
                .code,
            3);
  EXPECT_EQ(run_shell(kBin + "dnallm-infer embed --model " + dir_.string() + " --input " +
                      (dir_ / "in.fa").string() + " --out " + (dir_ / "y.npy").string())
                .code,
            2);
}

TEST_F(InferEndToEnd, QloraFineTuneExportsAndPredicts) {
  const auto mlm = train("mlm", "configs/quickstart.toml", " --set training.max_steps=3");
  // Labelled table: windows of E. coli (0) vs the same with every A turned into C (1).
  const auto csv = (dir_ / "cls.csv").string();
  dnallm::testing::write_composition_table(csv, dnallm::testing::bundled_genome(60000), 0, 48);
  const auto ck = (dir_ / "qlora").string();
  auto ft =
      run_shell("cd " + kSrc + " && " + kBin + "dnallm-train --config configs/quickstart.toml" +
                kTinyRun + " --set model.task=classification --set model.init_from=" + mlm +
                " --set lora.r=4 --set lora.quantize_base=nf4" +
                " --set 'lora.target_modules=[\"query\",\"value\",\"dense\"]'" +
                " --set 'data.train_files=[\"" + csv + "\"]' --set data.eval_fraction=0" +
                " --set training.max_steps=30 --set training.lr=1e-2 --set checkpoint.dir=" + ck);
  ASSERT_EQ(ft.code, 0) << ft.out;
  EXPECT_NE(ft.out.find("QLoRA: 12 base linears in nf4"), std::string::npos) << ft.out;
  const auto out = (dir_ / "pred.csv").string();
  auto pred = run_shell(kBin + "dnallm-infer predict --device cpu --model " + ck +
                        "/final --input " + csv + " --out " + out);
  ASSERT_EQ(pred.code, 0) << pred.out;
  std::ifstream f(out);
  std::string line;
  std::getline(f, line);
  EXPECT_EQ(line, "id,label,prob_0,prob_1");
  int rows = 0, correct = 0;
  while (std::getline(f, line)) {
    ++rows;
    const auto c1 = line.find(',');
    const int label = std::stoi(line.substr(c1 + 1));
    correct += label == (rows - 1) % 2;
    EXPECT_EQ(line.substr(0, c1), "row" + std::to_string(rows));
  }
  EXPECT_EQ(rows, 48);
  EXPECT_GE(correct, 40) << "a QLoRA classifier of A->C composition, trained on these rows";
}

}  // namespace
