#include "worker/data/genome_dataset.hpp"

#include <array>
#include <cmath>
#include <set>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"

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

// Note [Genome weights]: three files of one base each (A, C, G), so a window's first base names
// the file it came from.
struct HomopolymerFiles {
  testing::TempDir dir;
  std::vector<std::string> files;
  HomopolymerFiles() {
    const std::array<std::pair<char, size_t>, 3> spec = {
        {{'A', 90'000}, {'C', 10'000}, {'G', 1'000}}};
    for (const auto& [base, length] : spec) {
      files.push_back(dir.file(std::string(1, base) + ".fa"));
      testing::write_text(files.back(),
                          ">" + std::string(1, base) + "\n" + std::string(length, base) + "\n");
    }
  }
};

// The share of 20,000 windows that came from each file.
std::array<double, 3> file_shares(const GenomeDataset& ds) {
  std::array<double, 3> n{};
  constexpr int kDraws = 20'000;
  for (uint64_t i = 0; i < kDraws; ++i) {
    SampleRng rng(5, 0, i);
    const char b = ds.get(i, rng).bases.at(0);
    n[b == 'A' ? 0 : b == 'C' ? 1 : 2] += 1;
  }
  for (double& share : n) share /= kDraws;
  return n;
}

TEST(GenomeDataset, WeightsAndTemperatureMixFilesAsAsked) {
  HomopolymerFiles h;
  GenomeOptions o;
  o.window_bases = 100;
  // By size (the default): the files' window starts, 89,901 : 9,901 : 901.
  auto by_size = file_shares(GenomeDataset(h.files, o));
  const double starts = 89'901 + 9'901 + 901;
  EXPECT_NEAR(by_size[0], 89'901 / starts, 0.01);
  EXPECT_NEAR(by_size[2], 901 / starts, 0.003);
  o.file_weights = {1, 1, 2};
  auto weighted = file_shares(GenomeDataset(h.files, o));
  EXPECT_NEAR(weighted[0], 0.25, 0.015);
  EXPECT_NEAR(weighted[1], 0.25, 0.015);
  EXPECT_NEAR(weighted[2], 0.50, 0.015);
  o.file_weights = {0, 3, 0};
  EXPECT_EQ(file_shares(GenomeDataset(h.files, o))[1], 1.0);
  // T = 2: bases^(1/2) = 300 : 100 : 31.6.
  o.file_weights.clear();
  o.temperature = 2;
  auto flat = file_shares(GenomeDataset(h.files, o));
  const double sum = 300 + 100 + std::sqrt(1000.0);
  EXPECT_NEAR(flat[0], 300 / sum, 0.015);
  EXPECT_NEAR(flat[1], 100 / sum, 0.015);
  EXPECT_NEAR(flat[2], std::sqrt(1000.0) / sum, 0.01);
  // The stream is the sample's: the same index and seed, the same window, in any dataset.
  GenomeDataset once(h.files, o), again(h.files, o);
  for (uint64_t i = 0; i < 200; ++i) {
    SampleRng a(5, 1, i), b(5, 1, i);
    EXPECT_EQ(once.get(i, a).bases, again.get(i, b).bases);
  }
  // Windows never cross a file's records, whatever the mix.
  o.temperature = 0.5;
  GenomeDataset sharp(h.files, o);
  for (uint64_t i = 0; i < 2000; ++i) {
    SampleRng rng(5, 0, i);
    const std::string w = sharp.get(i, rng).bases;
    EXPECT_EQ(w, std::string(w.size(), w[0]));
  }
}

TEST(GenomeDataset, BadWeightsAreOneUsageError) {
  HomopolymerFiles h;
  GenomeOptions o;
  o.window_bases = 100;
  o.file_weights = {1, 1};
  dnallm::testing::expect_error([&] { GenomeDataset ds(h.files, o); }, ExitCode::kUsage,
                                {"data.weights gives 2 weight(s)", "3 file(s)", "A.fa", "G.fa"});
  o.file_weights = {0, 0, 0};
  dnallm::testing::expect_error([&] { GenomeDataset ds(h.files, o); }, ExitCode::kUsage,
                                {"no weight to a file with windows"});
  o.file_weights = {1, 1, 1};
  o.sampling = cfg::Sampling::kTile;
  dnallm::testing::expect_error([&] { GenomeDataset ds(h.files, o); }, ExitCode::kUsage,
                                {"data.sampling = \"tile\""});
  // A file whose split holds no window is left out of the mix (the rest keep their ratio).
  o.sampling = cfg::Sampling::kRandom;
  o.file_weights = {1, 1, 1};
  GenomeRegions no_c;
  no_c.intervals["C"] = {Interval{0, 10'000}};
  no_c.first_line["C"] = 1;
  o.exclude = std::make_shared<const GenomeRegions>(no_c);
  auto shares = file_shares(GenomeDataset(h.files, o));
  EXPECT_EQ(shares[1], 0.0);
  EXPECT_NEAR(shares[0], 0.5, 0.015);
}

}  // namespace
}  // namespace dnallm::data
