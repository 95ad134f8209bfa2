#include "worker/data/genome_dataset.hpp"

#include <set>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"

namespace dnallm::data {
namespace {

std::vector<SequenceRecord> records(std::vector<std::string> seqs) {
  std::vector<SequenceRecord> out;
  for (size_t i = 0; i < seqs.size(); ++i) out.push_back({"r" + std::to_string(i), seqs[i], 1});
  return out;
}

TEST(GenomeDataset, RandomWindowsAreSeededAndInBounds) {
  std::string g = testing::random_bases(10000, 1);
  GenomeOptions o;
  o.window_bases = 100;
  GenomeDataset ds(records({g}), o, "mem");
  EXPECT_EQ(ds.size(), 100u);
  std::set<std::string> distinct;
  for (uint64_t i = 0; i < 50; ++i) {
    SampleRng a(42, 0, i), b(42, 0, i);
    auto s1 = ds.get(i, a), s2 = ds.get(i, b);
    EXPECT_EQ(s1.bases, s2.bases);
    ASSERT_EQ(s1.bases.size(), 100u);
    EXPECT_NE(g.find(s1.bases), std::string::npos);
    distinct.insert(s1.bases);
  }
  EXPECT_GT(distinct.size(), 45u);
}

TEST(GenomeDataset, TilingCoversRecordsAndSkipsN) {
  std::string a = testing::random_bases(300, 2);
  std::string b =
      testing::random_bases(100, 3) + std::string(100, 'N') + testing::random_bases(100, 4);
  GenomeOptions o;
  o.window_bases = 100;
  o.sampling = cfg::Sampling::kTile;
  GenomeDataset ds(records({a, b}), o, "mem");
  EXPECT_EQ(ds.size(), 5u);  // 3 + 3 tiles minus the all-N one
  SampleRng rng(1);
  for (uint64_t i = 0; i < ds.size(); ++i)
    EXPECT_EQ(ds.get(i, rng).bases.find('N'), std::string::npos);
  o.n_policy = cfg::NPolicy::kMask;
  GenomeDataset masked(records({a, b}), o, "mem");
  EXPECT_EQ(masked.size(), 6u);
}

TEST(GenomeDataset, RandomSkipAvoidsNRuns) {
  std::string g =
      testing::random_bases(500, 5) + std::string(2000, 'N') + testing::random_bases(500, 6);
  GenomeOptions o;
  o.window_bases = 50;
  GenomeDataset ds(records({g}), o, "mem");
  for (uint64_t i = 0; i < 200; ++i) {
    SampleRng rng(7, 0, i);
    EXPECT_EQ(ds.get(i, rng).bases.find('N'), std::string::npos);
  }
}

TEST(GenomeDataset, EvalSplitHoldsOutTail) {
  std::string g = testing::random_bases(1000, 8);
  GenomeOptions o;
  o.window_bases = 100;
  o.sampling = cfg::Sampling::kTile;
  o.eval_fraction = 0.2;
  o.split = Split::kTrain;
  GenomeDataset train(records({g}), o, "mem");
  o.split = Split::kEval;
  GenomeDataset eval(records({g}), o, "mem");
  EXPECT_EQ(train.size(), 8u);
  EXPECT_EQ(eval.size(), 2u);
  SampleRng rng(1);
  EXPECT_EQ(eval.get(0, rng).bases, g.substr(800, 100));
  // Random windows of the train split never reach the tail.
  o.sampling = cfg::Sampling::kRandom;
  o.split = Split::kTrain;
  GenomeDataset rtrain(records({g}), o, "mem");
  for (uint64_t i = 0; i < 300; ++i) {
    SampleRng r(3, 0, i);
    auto pos = g.find(rtrain.get(i, r).bases);
    EXPECT_LE(pos + 100, 800u);
  }
}

TEST(GenomeDataset, ReverseComplementAugmentation) {
  std::string g = testing::random_bases(2000, 11);
  GenomeOptions o;
  o.window_bases = 64;
  o.reverse_complement = 1.0;
  GenomeDataset ds(records({g}), o, "mem");
  SampleRng rng(5, 0, 0);
  auto s = ds.get(0, rng);
  EXPECT_NE(g.find(reverse_complement(s.bases)), std::string::npos);
}

TEST(GenomeDataset, BadOptions) {
  GenomeOptions o;
  o.window_bases = 10;
  o.n_policy = cfg::NPolicy::kSkip;
  GenomeOptions all_n = o;
  all_n.sampling = cfg::Sampling::kTile;
  EXPECT_THROW(GenomeDataset(records({std::string(40, 'N')}), all_n, "mem"), Error);
}

}  // namespace
}  // namespace dnallm::data
