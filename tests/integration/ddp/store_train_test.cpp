// Training from a packed genome store (Note [Genome storage]) through the binaries: the bundled
// E. coli genome packed by dnallm-data trains with the same losses (steps and evaluation) as
// the FASTA it was packed from on one rank, and 2 ranks over the store train like 1 rank over
// the FASTA. A damaged store stops dnallm-train with exit 5 naming the file, before any step.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace dnallm::testing {
namespace {

namespace fs = std::filesystem;

struct StoreRun {
  int rc = -1;
  std::string log;
  std::map<int64_t, double> losses;
  std::map<int64_t, double> eval_losses;
};

// Global batch 12 = micro x world, one intra-op thread (the 1-rank runs are compared exactly).
StoreRun store_train(const std::string& name, const std::string& train_files, int world,
                     const std::string& extra = "") {
  const std::string dir = make_temp_dir(name);
  const std::string starter =
      world > 1
          ? fmt::format("OMP_NUM_THREADS=1 {}dnallm-launch --nproc-per-node {} --", kBin, world)
          : "OMP_NUM_THREADS=1";
  const std::string cmd = tiny_train_command(
      starter, dir, 12 / world, 1,
      fmt::format("--set parallel.backend=gloo --set data.train_files=[\\\"{}\\\"] "
                  "--set data.eval_fraction=0.02 --set training.eval_steps=5 "
                  "--set training.eval_batches=2 --set checkpoint.save_final=false {}",
                  train_files, extra));
  StoreRun r;
  r.rc = run_command(cmd, &r.log);
  r.log = cmd + "\n" + r.log;
  if (r.rc != 0) return r;
  r.losses = read_step_losses(dir + "/metrics.jsonl");
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "eval") r.eval_losses[j.at("step").get<int64_t>()] = j.at("loss");
  }
  return r;
}

class StoreTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    store_ = new std::string(make_temp_dir("store_pack") + "/ecoli.store");
    pack_log_ = new std::string;
    pack_rc_ = run_command(fmt::format("cd {} && {}dnallm-data pack {} data/ecoli_k12_mg1655.fa.gz",
                                       kSrc, kBin, *store_),
                           pack_log_);
    fasta_ = new StoreRun(store_train("store_fasta_ref", "data/ecoli_k12_mg1655.fa.gz", 1));
  }
  static void TearDownTestSuite() {
    delete store_;
    delete pack_log_;
    delete fasta_;
  }
  void SetUp() override {
    ASSERT_EQ(pack_rc_, 0) << *pack_log_;
    ASSERT_EQ(fasta_->rc, 0) << fasta_->log;
    ASSERT_EQ(fasta_->losses.size(), 5u) << fasta_->log;
    ASSERT_EQ(fasta_->eval_losses.size(), 1u) << fasta_->log;
  }
  static std::string* store_;
  static std::string* pack_log_;
  static int pack_rc_;
  static StoreRun* fasta_;
};
std::string* StoreTraining::store_ = nullptr;
std::string* StoreTraining::pack_log_ = nullptr;
int StoreTraining::pack_rc_ = -1;
StoreRun* StoreTraining::fasta_ = nullptr;

TEST_F(StoreTraining, OneRankFromTheStoreHasTheFastasLosses) {
  const StoreRun s = store_train("store_one", *store_, 1);
  ASSERT_EQ(s.rc, 0) << s.log;
  EXPECT_NE(s.log.find("genome " + *store_), std::string::npos) << s.log;
  EXPECT_EQ(s.losses, fasta_->losses) << s.log;
  EXPECT_EQ(s.eval_losses, fasta_->eval_losses) << s.log;
}

TEST_F(StoreTraining, TwoRanksFromTheStoreTrainLikeOneFromTheFasta) {
  const StoreRun s = store_train("store_two", *store_, 2);
  ASSERT_EQ(s.rc, 0) << s.log;
  ASSERT_EQ(s.losses.size(), fasta_->losses.size()) << s.log;
  for (const auto& [step, loss] : fasta_->losses)
    EXPECT_NEAR(s.losses.at(step), loss, 2e-5 * std::abs(loss)) << "step " << step;
  ASSERT_EQ(s.eval_losses.size(), 1u) << s.log;
  for (const auto& [step, loss] : fasta_->eval_losses)
    EXPECT_NEAR(s.eval_losses.at(step), loss, 2e-5 * std::abs(loss)) << "eval at " << step;
}

TEST_F(StoreTraining, ADamagedStoreStopsTrainingWithExit5) {
  const std::string damaged = make_temp_dir("store_damaged") + "/ecoli.store";
  fs::copy(*store_, damaged);
  fs::resize_file(damaged + "/bases.2bit", fs::file_size(damaged + "/bases.2bit") / 2);
  const StoreRun s = store_train("store_damaged_run", damaged, 1);
  EXPECT_EQ(s.rc, 5) << s.log;
  EXPECT_NE(s.log.find(damaged + "/bases.2bit"), std::string::npos) << s.log;
  EXPECT_NE(s.log.find("pack it again"), std::string::npos) << s.log;
}

// Issue 52's corpus of many files in CI form: 300 FASTA files in a directory, over
// data.pack_threshold_bases, packed once into data.cache_dir by the ranks of the first run (one
// packs, the other waits: Note [Genome cache]) and reused by the next, mixed by temperature (Note
// [Genome weights]): 2 ranks train like 1 rank.
TEST(StoreCorpus, ThreeHundredFilesPackedOnceAndMixedTrainAlikeOnTwoRanksAndOne) {
  const std::string corpus = make_temp_dir("corpus300");
  uint64_t x = 52;
  for (int i = 0; i < 300; ++i) {
    std::ofstream out(fmt::format("{}/species_{:03}.fa", corpus, i));
    out << ">contig_" << i << "\n";
    const int length = 2000 + (i * 37) % 7000;
    for (int b = 0; b < length; ++b) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      out << (b % 997 == 996 ? 'N' : "ACGT"[(x >> 33) & 3]);
      if (b % 80 == 79) out << "\n";
    }
    out << "\n";
  }
  const std::string cache = make_temp_dir("corpus300_cache");
  const std::string extra = fmt::format(
      "--set data.pack_threshold_bases=100000 --set data.cache_dir=\\\"{}\\\" "
      "--set data.sampling_temperature=2",
      cache);
  const StoreRun two = store_train("corpus300_two", corpus, 2, extra);
  ASSERT_EQ(two.rc, 0) << two.log;
  EXPECT_NE(two.log.find("in 300 file(s), over data.pack_threshold_bases"), std::string::npos)
      << two.log;
  EXPECT_NE(two.log.find("windows drawn from 300 file(s) by data.sampling_temperature"),
            std::string::npos)
      << two.log;
  const StoreRun one = store_train("corpus300_one", corpus, 1, extra);
  ASSERT_EQ(one.rc, 0) << one.log;
  EXPECT_NE(one.log.find("reading the genome store"), std::string::npos) << one.log;
  EXPECT_EQ(one.log.find("packing them once"), std::string::npos) << one.log;
  ASSERT_EQ(two.losses.size(), 5u) << two.log;
  ASSERT_EQ(one.losses.size(), 5u) << one.log;
  for (const auto& [step, loss] : one.losses)
    EXPECT_NEAR(two.losses.at(step), loss, 2e-5 * std::abs(loss)) << "step " << step;
  for (const auto& [step, loss] : one.eval_losses)
    EXPECT_NEAR(two.eval_losses.at(step), loss, 2e-5 * std::abs(loss)) << "eval at " << step;
}

}  // namespace
}  // namespace dnallm::testing
