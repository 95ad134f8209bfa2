#include "worker/data/genome_regions.hpp"

#include <random>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/data/genome_dataset.hpp"

namespace dnallm::data {
namespace {

std::shared_ptr<const GenomeRegions> bed_of(const testing::TempDir& dir, const std::string& name,
                                            const std::string& text) {
  testing::write_text(dir.file(name), text);
  return std::make_shared<const GenomeRegions>(read_bed(dir.file(name)));
}

TEST(GenomeRegions, BedIsSortedMergedAndSkipsHeadersInEveryCompression) {
  testing::TempDir dir;
  const std::string text =
      "track name=x\n# a comment\nbrowser position chr1\n\nchr2\t50\t60\tsplit\r\n"
      "chr1 300 400\nchr1\t100\t200\textra\tcolumns\nchr1\t150\t250\nchr1\t250\t260\n"
      "chr1\t500\t501\n";
  testing::write_text(dir.file("plain.bed"), text);
  testing::write_gzip(dir.file("gzip.bed.gz"), text);
  testing::write_bgzf(dir.file("bgzf.bed.gz"), text);
  for (const char* name : {"plain.bed", "gzip.bed.gz", "bgzf.bed.gz"}) {
    const GenomeRegions r = read_bed(dir.file(name));
    ASSERT_EQ(r.intervals.size(), 2u) << name;
    EXPECT_EQ(r.intervals.at("chr1"), (std::vector<Interval>{{100, 260}, {300, 400}, {500, 501}}))
        << name;
    EXPECT_EQ(r.intervals.at("chr2"), (std::vector<Interval>{{50, 60}})) << name;
    EXPECT_EQ(r.first_line.at("chr2"), 5) << name;
    EXPECT_EQ(r.first_line.at("chr1"), 6) << name;
  }
}

TEST(GenomeRegions, MalformedBedIsExit3NamingFileAndLine) {
  testing::TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"chr1\t1\t5\nchr1\t10\n", ":2: a BED line is `name start end`"},
      {"chr1\t-1\t5\n", ":1: a BED line"},
      {"chr1\t1\tfive\n", "found start '1' and end 'five'"},
      {"chr1\t1.5\t5\n", ":1: a BED line"},
      {"chr1\t1\t5\nchr1\t7\t7\n", ":2: interval chr1:7-7 is empty or reversed"},
      {"chr1\t9\t5\n", ":1: interval chr1:9-5"},
      {"# header only\n", "holds no interval"},
  };
  for (const auto& [text, expected] : cases) {
    testing::write_text(dir.file("bad.bed"), text);
    const std::string message =
        dnallm::testing::expect_bad_data([&] { read_bed(dir.file("bad.bed")); }, {});
    EXPECT_NE(message.find(dir.file("bad.bed")), std::string::npos) << message;
    EXPECT_NE(message.find(expected), std::string::npos) << text << " -> " << message;
  }
  const std::string missing =
      dnallm::testing::expect_bad_data([&] { read_bed(dir.file("none.bed")); }, {});
  EXPECT_NE(missing.find("cannot open BED file"), std::string::npos) << missing;
}

// intersect and subtract against a bitmap, on random sets.
TEST(GenomeRegions, IntersectAndSubtractEqualABitmap) {
  std::mt19937 rng(7);
  auto random_set = [&](int n) {
    std::vector<bool> bits(200, false);
    for (int i = 0; i < n; ++i) {
      const int b = static_cast<int>(rng() % 200), len = 1 + static_cast<int>(rng() % 30);
      for (int j = b; j < std::min(200, b + len); ++j) bits[j] = true;
    }
    std::vector<Interval> out;
    for (int i = 0; i < 200; ++i) {
      if (!bits[i]) continue;
      int j = i;
      while (j < 200 && bits[j]) ++j;
      out.push_back({i, j});
      i = j;
    }
    return std::make_pair(bits, out);
  };
  auto bitmap = [](const std::vector<Interval>& set) {
    std::vector<bool> bits(200, false);
    for (size_t k = 0; k < set.size(); ++k) {
      if (k > 0) {
        EXPECT_LT(set[k - 1].end, set[k].begin + 1);  // sorted, disjoint
      }
      EXPECT_LT(set[k].begin, set[k].end);
      for (int64_t j = set[k].begin; j < set[k].end; ++j) bits[j] = true;
    }
    return bits;
  };
  for (int trial = 0; trial < 300; ++trial) {
    const auto [a_bits, a] = random_set(1 + trial % 6);
    const auto [b_bits, b] = random_set(1 + trial % 5);
    std::vector<bool> both(200), less(200);
    for (int i = 0; i < 200; ++i) {
      both[i] = a_bits[i] && b_bits[i];
      less[i] = a_bits[i] && !b_bits[i];
    }
    EXPECT_EQ(bitmap(intersect(a, b)), both) << "trial " << trial;
    EXPECT_EQ(bitmap(subtract(a, b)), less) << "trial " << trial;
  }
}

// Windows come only from train_regions, less eval_regions and exclude_regions; the eval split
// is eval_regions less exclude_regions; the two never share a base.
TEST(GenomeRegions, WindowsStayInsideTheirRegionsInEverySampling) {
  testing::TempDir dir;
  const std::string g = testing::random_bases(3000, 11), h = testing::random_bases(800, 12);
  std::vector<SequenceRecord> recs = {{"chrA", g, 1}, {"chrB", h, 2}};
  GenomeOptions o;
  o.window_bases = 40;
  o.include = bed_of(dir, "train.bed", "chrA\t100\t700\nchrA\t900\t1600\nchrB\t0\t800\n");
  o.held_out = bed_of(dir, "eval.bed", "chrA\t1000\t1100\nchrB\t700\t800\n");
  o.exclude = bed_of(dir, "exclude.bed", "chrA\t300\t350\nchrA\t1050\t1060\n");
  // Allowed bases per record, by split.
  auto allowed = [&](Split split) {
    std::vector<std::vector<bool>> bits = {std::vector<bool>(g.size()),
                                           std::vector<bool>(h.size())};
    auto mark = [&](int rec, int64_t b, int64_t e, bool v) {
      for (int64_t i = b; i < e; ++i) bits[rec][i] = v;
    };
    if (split == Split::kEval) {
      mark(0, 1000, 1100, true);
      mark(1, 700, 800, true);
    } else {
      mark(0, 100, 700, true);
      mark(0, 900, 1600, true);
      mark(1, 0, 800, true);
      mark(0, 1000, 1100, false);
      mark(1, 700, 800, false);
    }
    mark(0, 300, 350, false);
    mark(0, 1050, 1060, false);
    return bits;
  };
  // Pieces left (the regions, each its own): chrA 100-300 350-700 900-1000 1100-1600, chrB
  // 0-700; eval chrA 1000-1050 1060-1100, chrB 700-800.
  const std::map<Split, uint64_t> tiles = {
      {Split::kTrain, (200 - 39) + (350 - 39) + (100 - 39) + (500 - 39) + (700 - 39)},
      {Split::kEval, (50 - 39) + (40 - 39) + (100 - 39)}};
  for (auto split : {Split::kTrain, Split::kEval, Split::kAll}) {
    for (auto sampling : {cfg::Sampling::kTile, cfg::Sampling::kRandom}) {
      o.split = split;
      o.sampling = sampling;
      o.window_stride = 1;
      GenomeDataset ds(recs, o, "mem");
      const auto bits = allowed(split == Split::kAll ? Split::kTrain : split);
      if (sampling == cfg::Sampling::kTile) {
        EXPECT_EQ(ds.size(), tiles.at(split == Split::kAll ? Split::kTrain : split));
      }
      const uint64_t n = sampling == cfg::Sampling::kTile ? ds.size() : 2000;
      for (uint64_t i = 0; i < n; ++i) {
        SampleRng rng(3, 0, i);
        const std::string w = ds.get(i, rng).bases;
        ASSERT_EQ(w.size(), 40u);
        // Random bases: a 40-base window occurs once; find which record and where.
        size_t pos = g.find(w);
        int rec = 0;
        if (pos == std::string::npos) {
          pos = h.find(w);
          rec = 1;
        }
        ASSERT_NE(pos, std::string::npos);
        for (size_t j = pos; j < pos + w.size(); ++j)
          ASSERT_TRUE(bits[rec][j])
              << "split " << static_cast<int>(split) << " " << cfg::spelling(sampling) << " window "
              << i << " at " << (rec == 0 ? "chrA:" : "chrB:") << pos;
      }
    }
  }
}

TEST(GenomeRegions, ABedOfAnotherGenomeIsExit3AtTheStart) {
  testing::TempDir dir;
  std::vector<SequenceRecord> recs = {{"chr1", testing::random_bases(500, 1), 1}};
  GenomeOptions o;
  o.window_bases = 50;
  o.include = bed_of(dir, "other.bed", "chr1\t0\t100\n1\t0\t100\n");
  std::string m =
      dnallm::testing::expect_bad_data([&] { GenomeDataset(recs, o, "genome.fa"); }, {});
  EXPECT_NE(m.find("other.bed:2: '1' is not a record of genome.fa (1 records: chr1)"),
            std::string::npos)
      << m;
  o.include = nullptr;
  o.exclude = bed_of(dir, "long.bed", "chr1\t400\t501\n");
  m = dnallm::testing::expect_bad_data([&] { GenomeDataset(recs, o, "genome.fa"); }, {});
  EXPECT_NE(m.find("interval chr1:400-501 ends past the record, which holds 500 bases"),
            std::string::npos)
      << m;
  o.exclude = bed_of(dir, "all.bed", "chr1\t0\t500\n");
  m = dnallm::testing::expect_bad_data([&] { GenomeDataset(recs, o, "genome.fa"); }, {});
  EXPECT_NE(m.find("no bases left in this split (the BED regions"), std::string::npos) << m;
  o.exclude = nullptr;
  o.held_out = bed_of(dir, "eval.bed", "chr1\t0\t100\n");
  o.eval_fraction = 0.1;
  dnallm::testing::expect_error([&] { GenomeDataset(recs, o, "genome.fa"); }, ExitCode::kUsage,
                                {"set one"});
}

}  // namespace
}  // namespace dnallm::data
