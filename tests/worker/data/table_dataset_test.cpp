#include "worker/data/table_dataset.hpp"

#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "core/config.hpp"
#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/data/pipeline.hpp"

namespace dnallm::data {
namespace {

using dnallm::testing::expect_error;

using dnallm::testing::expect_bad_data;

TableOptions classification(const std::string& cache_dir = "") {
  TableOptions o;
  o.task = cfg::Task::kClassification;
  o.num_labels = 3;
  o.cache_dir = cache_dir;
  return o;
}

Sample get(const Dataset& ds, uint64_t i) {
  SampleRng rng(1);
  return ds.get(i, rng);
}

TEST(TableDataset, CsvWithQuotesLabelsAndIndexReuse) {
  testing::TempDir dir;
  testing::write_text(dir.file("t.csv"),
                      "id,sequence,label\n1,ACGT,0\n\"2,x\",\"ggcc\",2\n\n3,TTTT,1\r\n4,NNAC,0");
  TableDataset ds({dir.file("t.csv")}, classification());
  ASSERT_EQ(ds.size(), 4u);
  EXPECT_EQ(get(ds, 0).bases, "ACGT");
  EXPECT_EQ(get(ds, 1).bases, "GGCC");
  EXPECT_EQ(get(ds, 1).label, 2);
  EXPECT_EQ(get(ds, 2).bases, "TTTT");
  EXPECT_EQ(get(ds, 3).label, 0);
  ASSERT_EQ(ds.index_paths().size(), 1u);
  EXPECT_EQ(ds.index_paths()[0], dir.file("t.csv.dnaidx"));
  EXPECT_EQ(std::filesystem::file_size(dir.file("t.csv.dnaidx")), 64u + 4 * 8);
  auto before = std::filesystem::last_write_time(dir.file("t.csv.dnaidx"));
  TableDataset again({dir.file("t.csv")}, classification());
  EXPECT_EQ(std::filesystem::last_write_time(dir.file("t.csv.dnaidx")), before);
  EXPECT_EQ(get(again, 2).bases, "TTTT");
}

TEST(TableDataset, StaleIndexIsRebuilt) {
  testing::TempDir dir;
  testing::write_text(dir.file("t.tsv"), "sequence\tlabel\nACGT\t1\n");
  TableOptions o;
  EXPECT_EQ(TableDataset({dir.file("t.tsv")}, o).size(), 1u);
  testing::write_text(dir.file("t.tsv"), "sequence\tlabel\nACGT\t1\nCCCCCC\t0\nGG\t1\n");
  TableDataset ds({dir.file("t.tsv")}, o);
  EXPECT_EQ(ds.size(), 3u);
  EXPECT_EQ(get(ds, 1).bases, "CCCCCC");
}

TEST(TableDataset, JsonlRegressionAndCacheDir) {
  testing::TempDir dir;
  std::filesystem::create_directory(dir.path() / "cache");
  testing::write_text(
      dir.file("t.jsonl"),
      "{\"sequence\": \"ACGTAC\", \"label\": 0.5}\n{\"label\": -2, \"sequence\": \"tt\"}\n");
  TableOptions o;
  o.task = cfg::Task::kRegression;
  o.cache_dir = (dir.path() / "cache").string();
  TableDataset ds({dir.file("t.jsonl")}, o);
  ASSERT_EQ(ds.size(), 2u);
  EXPECT_FLOAT_EQ(get(ds, 0).target, 0.5F);
  EXPECT_FLOAT_EQ(get(ds, 1).target, -2.0F);
  EXPECT_EQ(get(ds, 1).bases, "TT");
  EXPECT_EQ(std::filesystem::path(ds.index_paths()[0]).parent_path(), dir.path() / "cache");
  EXPECT_FALSE(std::filesystem::exists(dir.file("t.jsonl.dnaidx")));
}

TEST(TableDataset, Utf8BomHeader) {
  testing::TempDir dir;
  testing::write_text(dir.file("bom.csv"), "\xEF\xBB\xBFsequence,label\nACGT,1\n");
  TableDataset ds({dir.file("bom.csv")}, classification());
  EXPECT_EQ(get(ds, 0).label, 1);
}

TEST(TableDataset, MultipleFiles) {
  testing::TempDir dir;
  testing::write_text(dir.file("a.csv"), "sequence\nAAAA\nCCCC\n");
  testing::write_text(dir.file("b.csv"), "sequence\nGGGG\n");
  TableDataset ds({dir.file("a.csv"), dir.file("b.csv")}, TableOptions{});
  ASSERT_EQ(ds.size(), 3u);
  EXPECT_EQ(get(ds, 2).bases, "GGGG");
}

TEST(TableDataset, BadRecordsNameFileLineAndRecord) {
  testing::TempDir dir;
  struct Bad {
    const char* file;
    const char* text;
    TableOptions options;
    std::vector<std::string> parts;
  };
  const std::vector<Bad> cases = {
      {"missing.csv",
       "seq,label\nACGT,1\n",
       classification(),
       {"missing.csv:1", "missing column \"sequence\""}},
      {"nolabel.csv", "sequence\nACGT\n", classification(), {"nolabel.csv:1", "label"}},
      {"chars.csv",
       "sequence,label\nACGT,1\nAC*T,0\n",
       classification(),
       {"chars.csv:3", "record 2", "'*'", "position 3"}},
      {"label.csv",
       "sequence,label\nACGT,1\nACGT,7\n",
       classification(),
       {"label.csv:3", "record 2", "bad label \"7\""}},
      {"empty.tsv",
       "sequence\tlabel\nACGT\t1\n\t1\n",
       classification(),
       {"empty.tsv:3", "empty sequence"}},
      {"short.csv",
       "label,sequence\n1,ACGT\n1\n",
       classification(),
       {"short.csv:3", "missing column"}},
      {"bad.jsonl",
       "{\"sequence\": \"AC\"}\n{oops\n",
       TableOptions{},
       {"bad.jsonl:2", "not a JSON object"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    testing::write_text(dir.file(c.file), c.text);
    expect_bad_data([&] { TableDataset({dir.file(c.file)}, c.options); }, c.parts);
  }
  testing::write_text(dir.file("reg.csv"), "sequence,label\nACGT,abc\n");
  TableOptions reg;
  reg.task = cfg::Task::kRegression;
  expect_bad_data([&] { TableDataset({dir.file("reg.csv")}, reg); },
                  {"reg.csv:2", "finite number"});
}

TEST(TableDataset, SkipPolicyCountsBadRecords) {
  testing::TempDir dir;
  testing::write_text(dir.file("mixed.csv"), "sequence,label\nACGT,1\nAC*T,0\nGG,9\nTTTT,0\n");
  auto o = classification();
  o.on_bad_record = BadRecordPolicy::kSkip;
  TableDataset ds({dir.file("mixed.csv")}, o);
  EXPECT_EQ(ds.size(), 2u);
  EXPECT_EQ(ds.skipped_records(), 2);
  EXPECT_EQ(get(ds, 1).bases, "TTTT");
  TableDataset cached({dir.file("mixed.csv")}, o);  // from the index: the count persists
  EXPECT_EQ(cached.skipped_records(), 2);
}

TEST(TableDataset, ReverseComplementAugmentationKeepsTheLabel) {
  testing::TempDir dir;
  testing::write_text(dir.file("t.csv"), "sequence,label\nAACGTN,1\nGGGT,0\n");
  auto o = classification();
  o.reverse_complement = 1.0;
  TableDataset always({dir.file("t.csv")}, o);
  EXPECT_EQ(get(always, 0).bases, "NACGTT");
  EXPECT_EQ(get(always, 0).label, 1);
  EXPECT_EQ(get(always, 1).bases, "ACCC");
  o.reverse_complement = 0.5;
  TableDataset half({dir.file("t.csv")}, o);
  int flipped = 0;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    SampleRng rng(seed, 0, 0);
    const auto s = half.get(0, rng);
    flipped += s.bases == "NACGTT";
    SampleRng again(seed, 0, 0);
    EXPECT_EQ(half.get(0, again).bases, s.bases);  // the sample's draw: resume is exact
  }
  EXPECT_GT(flipped, 60);
  EXPECT_LT(flipped, 140);
  // `rc_augment` (the name the long-context recipes use) sets it.
  Config c = parse_config("", "run.toml", {"rc_augment=1"});
  EXPECT_DOUBLE_EQ(c.data.reverse_complement, 1.0);
}

TEST(TableDataset, ClassificationLoaderFromConfig) {
  testing::TempDir dir;
  std::string csv = "sequence,label\n";
  for (int i = 0; i < 40; ++i)
    csv += testing::random_bases(10 + i, i) + "," + std::to_string(i % 2) + "\n";
  testing::write_text(dir.file("cls.csv"), csv);
  Config c;
  c.data.train_files = {dir.file("cls.csv")};
  c.model.task = cfg::Task::kClassification;
  c.model.max_seq_length = 32;
  c.training.micro_batch_size = 4;
  c.data.group_by_length = true;
  auto loader = make_train_loader(c, make_char_tokenizer(), 0, 1);
  Batch b = loader->next();
  EXPECT_EQ(b.rows, 4);
  ASSERT_EQ(b.labels.size(), 4u);
  for (int64_t r = 0; r < 4; ++r) {
    // Record i has 10 + i bases and label i % 2: recover i from the row's real tokens.
    int64_t real = 0;
    for (int64_t k = 0; k < b.seq_len; ++k) real += b.attention_mask[r * b.seq_len + k];
    if (real < 32) {
      EXPECT_EQ(b.labels[r], (real - 12) % 2) << "row " << r;
    }
  }
  EXPECT_LE(b.seq_len, 32);
  EXPECT_EQ(loader->skipped_records(), 0);
}

TEST(TableDataset, ConcurrentFirstOpensAgree) {
  // Ranks opening a new table at once each build the index; all must read the same records.
  testing::TempDir dir;
  std::string csv = "sequence\n";
  for (int i = 0; i < 3000; ++i) csv += testing::random_bases(20 + i % 50, i) + "\n";
  testing::write_text(dir.file("c.csv"), csv);
  std::vector<std::thread> threads;
  std::vector<std::string> last(4);
  std::vector<uint64_t> sizes(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      TableDataset ds({dir.file("c.csv")}, TableOptions{});
      sizes[t] = ds.size();
      last[t] = get(ds, ds.size() - 1).bases;
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(sizes[t], 3000u);
    EXPECT_EQ(last[t], testing::random_bases(20 + 2999 % 50, 2999));
  }
  TableDataset after({dir.file("c.csv")}, TableOptions{});
  EXPECT_EQ(after.size(), 3000u);
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

TEST(TableDataset, CompressedTablesRefused) {
  testing::TempDir dir;
  testing::write_gzip(dir.file("t.csv.gz"), "sequence\nACGT\n");
  TableOptions o;
  o.format = cfg::DataFormat::kCsv;
  expect_error([&] { TableDataset ds({dir.file("t.csv.gz")}, o); }, ExitCode::kUsage,
               {"decompress"});
}

}  // namespace
}  // namespace dnallm::data
