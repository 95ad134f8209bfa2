#include "worker/data/pipeline.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::data {
namespace {

using dnallm::testing::expect_error;

Config small_config() {
  Config c;
  c.data.train_files = {std::string(DNALLM_SOURCE_DIR) + "/data/ecoli_k12_mg1655.fa.gz"};
  c.model.max_seq_length = 64;
  c.training.micro_batch_size = 4;
  c.training.grad_accum_steps = 2;
  c.data.eval_fraction = 0.01;
  return c;
}

TEST(Pipeline, TrainAndEvalLoadersFromConfig) {
  Config c = small_config();
  auto tok = make_tokenizer(c);
  EXPECT_EQ(window_bases(c, *tok), 62);
  auto train = make_train_loader(c, tok, 0, 1);
  Batch b = train->next();
  EXPECT_EQ(b.rows, 4);
  EXPECT_EQ(b.seq_len, 64);
  EXPECT_EQ(b.num_bases, 4 * 62);
  EXPECT_EQ(train->global_batch_size(), 8u);
  auto eval = make_eval_loader(c, tok, 0, 1);
  ASSERT_NE(eval, nullptr);
  // Eval tiles the last 1% in order: 46396 bases / 62.
  EXPECT_EQ(eval->dataset_size(), 46396u / 62);
  Batch e = eval->next();
  EXPECT_EQ(e.sample_ids, (std::vector<uint64_t>{0, 1, 2, 3}));
  c.data.eval_fraction = 0;
  EXPECT_EQ(make_eval_loader(c, tok, 0, 1), nullptr);
}

TEST(Pipeline, EvalMasksEverySelectedPositionTrainingUses801010) {
  Config c = small_config();
  c.data.mlm_probability = 0.5;  // many scored positions, so 80/10/10 is visible in training
  auto tok = make_tokenizer(c);
  auto count = [](const Batch& b) {
    int64_t scored = 0, masked = 0;
    for (size_t i = 0; i < b.labels.size(); ++i) {
      if (b.labels[i] == kIgnoreIndex) continue;
      ++scored;
      masked += b.input_ids[i] == kMaskId;
    }
    return std::make_pair(scored, masked);
  };
  auto eval = make_eval_loader(c, tok, 0, 1);
  ASSERT_NE(eval, nullptr);
  auto [eval_scored, eval_masked] = count(eval->next());
  ASSERT_GT(eval_scored, 20);
  EXPECT_EQ(eval_masked, eval_scored) << "a scored eval position shows a base";
  auto train = make_train_loader(c, tok, 0, 1);
  auto [train_scored, train_masked] = count(train->next());
  ASSERT_GT(train_scored, 20);
  EXPECT_LT(train_masked, train_scored) << "training keeps BERT's 10% random / 10% unchanged";
}

TEST(Pipeline, KmerWindowAndCausal) {
  Config c = small_config();
  c.tokenizer.kind = cfg::TokenizerKind::kKmer;
  c.tokenizer.k = 6;
  c.tokenizer.stride = 1;
  c.model.arch = cfg::Arch::kGpt;
  auto tok = make_tokenizer(c);
  EXPECT_EQ(tok->vocab_size(), 4101);
  EXPECT_EQ(window_bases(c, *tok), 63 + 5);
  auto train = make_train_loader(c, tok, 1, 2);
  Batch b = train->next();
  EXPECT_EQ(b.seq_len, 64);
  EXPECT_EQ(b.input_ids[0], kClsId);
  EXPECT_EQ(b.labels[1], b.input_ids[1]);
}

// An unknown tokenizer or bad-record policy never reaches the pipeline: the schema refuses it
// (Note [Config choices]).
TEST(Pipeline, BadOptionsAreUsageErrors) {
  for (const char* bad : {"tokenizer.kind=words", "data.on_bad_record=ignore"}) {
    SCOPED_TRACE(bad);
    expect_error([&] { parse_config("", "test", {bad}); }, ExitCode::kUsage);
  }
}

TEST(Pipeline, FastqReadsAndEvalFilesAndRewind) {
  testing::TempDir dir;
  std::string fq;
  for (int i = 0; i < 30; ++i) {
    std::string s = testing::random_bases(40 + i, i);
    fq += "@read" + std::to_string(i) + "\n" + s + "\n+\n" + std::string(s.size(), 'I') + "\n";
  }
  testing::write_gzip(dir.file("reads.fastq.gz"), fq);
  Config c = small_config();
  c.data.train_files = {dir.file("reads.fastq.gz")};
  c.data.eval_files = {dir.file("reads.fastq.gz")};
  c.data.eval_fraction = 0;
  c.model.max_seq_length = 32;  // reads are longer than a window: windows inside reads
  auto tok = make_tokenizer(c);
  auto train = make_train_loader(c, tok, 0, 1);
  Batch b = train->next();
  EXPECT_EQ(b.seq_len, 32);
  auto eval = make_eval_loader(c, tok, 0, 1);
  ASSERT_NE(eval, nullptr);
  Batch e0 = eval->next();
  eval->next();
  eval->rewind();
  EXPECT_EQ(eval->next().input_ids, e0.input_ids);
  // Labelled tasks need tables.
  c.model.task = cfg::Task::kClassification;
  try {
    make_train_loader(c, tok, 0, 1);
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(err.what()).find("reads.fastq.gz"), std::string::npos);
  }
}

TEST(Pipeline, BpeTrainedFromConfigAndSaved) {
  testing::TempDir dir;
  std::string fa = ">x\n";
  for (int i = 0; i < 100; ++i) fa += testing::random_bases(80, i % 9) + "\n";
  testing::write_text(dir.file("g.fa"), fa);
  Config c = small_config();
  c.data.train_files = {dir.file("g.fa")};
  c.tokenizer.kind = cfg::TokenizerKind::kBpe;
  c.tokenizer.vocab_size = 48;
  c.tokenizer.path = dir.file("bpe.model");
  auto tok = make_tokenizer(c);
  auto again = make_tokenizer(c);  // loads the saved model
  EXPECT_TRUE(*tok == *again);
  auto loader = make_train_loader(c, tok, 0, 1);
  Batch b = loader->next();
  EXPECT_LE(b.seq_len, 64);
  for (auto id : b.input_ids) EXPECT_LT(id, tok->vocab_size());
}

}  // namespace
}  // namespace dnallm::data
