// Note [Data file lists]: data.train_files entries as files, globs, directories, @LIST files and
// a genome store; the pipeline trains from a store as from its FASTA, and N ranks (resumed at
// other world sizes) see the windows one rank sees.
#include "worker/data/data_files.hpp"

#include <filesystem>
#include <map>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/data/data_loader.hpp"
#include "worker/data/genome_store.hpp"
#include "worker/data/pipeline.hpp"
#include "worker/data/store_packer.hpp"

namespace dnallm::data {
namespace {

namespace fs = std::filesystem;
using dnallm::testing::expect_error;

struct Tree {
  testing::TempDir d;
  std::string p(const std::string& rel) const { return d.file(rel); }
  Tree() {
    fs::create_directories(d.path() / "corpus" / "plants");
    fs::create_directories(d.path() / "corpus" / ".hidden");
    for (const char* f : {"corpus/b.fa.gz", "corpus/a.fasta", "corpus/plants/z.fq",
                          "corpus/plants/y.fna", "corpus/.hidden/x.fa", "corpus/.dot.fa",
                          "corpus/notes.txt", "corpus/a.fasta.fai", "top.fa"})
      testing::write_text(p(f), ">r\nACGT\n");
  }
};

TEST(DataFiles, GlobsDirectoriesAndListsExpandSorted) {
  Tree t;
  const auto dir = expand_data_files({t.p("corpus")}, "data.train_files");
  EXPECT_EQ(dir, (std::vector<std::string>{t.p("corpus/a.fasta"), t.p("corpus/b.fa.gz"),
                                           t.p("corpus/plants/y.fna"), t.p("corpus/plants/z.fq")}));
  const auto glob = expand_data_files({t.p("corpus/*.f*"), t.p("top.fa")}, "data.train_files");
  EXPECT_EQ(glob, (std::vector<std::string>{t.p("corpus/a.fasta"), t.p("corpus/a.fasta.fai"),
                                            t.p("corpus/b.fa.gz"), t.p("top.fa")}));
  testing::write_text(t.p("list.txt"), "# the corpus\n\n  top.fa  \ncorpus/plants\r\n" +
                                           t.p("corpus/b.fa.gz") + "\n");
  const auto list = expand_data_files({"@" + t.p("list.txt")}, "data.train_files");
  EXPECT_EQ(list, (std::vector<std::string>{t.p("top.fa"), t.p("corpus/plants/y.fna"),
                                            t.p("corpus/plants/z.fq"), t.p("corpus/b.fa.gz")}));
  // A plain path is kept as written, existing or not (its reader names it).
  EXPECT_EQ(expand_data_files({"missing.fa"}, "k"), (std::vector<std::string>{"missing.fa"}));
}

TEST(DataFiles, EmptyMatchesAndBadListsAreUsageErrors) {
  Tree t;
  expect_error([&] { expand_data_files({t.p("corpus/*.bam")}, "data.train_files"); },
               ExitCode::kUsage, {"data.train_files", "*.bam", "matches no file"});
  fs::create_directory(t.p("empty"));
  expect_error([&] { expand_data_files({t.p("empty")}, "data.eval_files"); }, ExitCode::kUsage,
               {"data.eval_files", t.p("empty"), "holds no sequence"});
  expect_error([&] { expand_data_files({"@" + t.p("nope.txt")}, "data.train_files"); },
               ExitCode::kUsage, {"cannot read the file list", "nope.txt"});
  testing::write_text(t.p("nested.txt"), "@other.txt\n");
  expect_error([&] { expand_data_files({"@" + t.p("nested.txt")}, "data.train_files"); },
               ExitCode::kUsage, {"do not nest"});
  PackOptions o;
  o.progress_seconds = 0;
  pack_genome_store(t.p("store"), {t.p("top.fa")}, o);
  EXPECT_EQ(expand_data_files({t.p("store")}, "k"), (std::vector<std::string>{t.p("store")}));
  expect_error(
      [&] {
        expand_data_files({t.p("store"), t.p("top.fa")}, "data.train_files");
      },
      ExitCode::kUsage, {"genome store must be the only entry"});
}

// The bundled genome's first 200 kbases with soft-masked and N runs, as FASTA and as a store.
struct Corpus {
  testing::TempDir d;
  std::string fasta = d.file("g.fa");
  std::string store = d.file("g.store");
  Corpus() {
    std::string s = testing::random_bases(200'000, 77);
    for (size_t i = 5'000; i < 9'000; ++i) s[i] = 'N';
    for (size_t i = 20'000; i < 60'000; ++i) s[i] = static_cast<char>(std::tolower(s[i]));
    std::string text = ">c1\n";
    for (size_t i = 0; i < 150'000; i += 70) text += s.substr(i, 70) + "\n";
    text += ">c2\n" + s.substr(150'000) + "\n";
    testing::write_gzip(fasta, text);
    PackOptions o;
    o.progress_seconds = 0;
    pack_genome_store(store, {fasta}, o);
  }
};

Config corpus_config(const std::string& train) {
  Config c;
  c.data.train_files = {train};
  c.model.max_seq_length = 64;
  c.training.micro_batch_size = 2;
  c.training.grad_accum_steps = 6;
  c.data.eval_fraction = 0.05;
  c.data.reverse_complement = 0.5;
  return c;
}

void collect(const Batch& b, std::map<uint64_t, std::vector<int64_t>>& out) {
  for (int64_t r = 0; r < b.rows; ++r) {
    std::vector<int64_t> row(b.input_ids.begin() + r * b.seq_len,
                             b.input_ids.begin() + (r + 1) * b.seq_len);
    row.insert(row.end(), b.labels.begin() + r * b.seq_len, b.labels.begin() + (r + 1) * b.seq_len);
    EXPECT_TRUE(out.emplace(b.sample_ids[r], row).second) << "sample " << b.sample_ids[r];
  }
}

TEST(DataFiles, StoreTrainsAndEvaluatesLikeItsFastaAtAnyWorldSize) {
  Corpus corpus;
  const Config fasta = corpus_config(corpus.fasta), store = corpus_config(corpus.store);
  auto tok = make_tokenizer(fasta);
  // Reference: the FASTA on one rank, global batch 12, 4 steps.
  std::map<uint64_t, std::vector<int64_t>> reference, seen;
  {
    auto one = make_train_loader(fasta, tok, 0, 1);
    for (int i = 0; i < 24; ++i) collect(one->next(), reference);
  }
  ASSERT_EQ(reference.size(), 48u);
  // The store: 2 ranks for 2 steps, then resumed on 3 ranks for 2 more.
  Config two = store;
  two.training.grad_accum_steps = 3;
  SamplerState state;
  for (int r = 0; r < 2; ++r) {
    auto l = make_train_loader(two, tok, r, 2);
    for (int i = 0; i < 6; ++i) collect(l->next(), seen);
    state = l->state();
  }
  Config three = store;
  three.training.micro_batch_size = 1;
  three.training.grad_accum_steps = 4;
  for (int r = 0; r < 3; ++r) {
    auto l = make_train_loader(three, tok, r, 3, state, 2);
    for (int i = 0; i < 8; ++i) collect(l->next(), seen);
  }
  ASSERT_EQ(seen.size(), reference.size());
  for (const auto& [id, row] : reference) {
    ASSERT_TRUE(seen.count(id)) << "sample " << id << " missing";
    EXPECT_EQ(seen[id], row) << "sample " << id << " differs";
  }
  // The held-out tail: the same windows in the same order.
  auto e1 = make_eval_loader(fasta, tok, 0, 1), e2 = make_eval_loader(store, tok, 0, 1);
  ASSERT_EQ(e1->dataset_size(), e2->dataset_size());
  for (int i = 0; i < 4; ++i) {
    const Batch a = e1->next(), b = e2->next();
    EXPECT_EQ(a.input_ids, b.input_ids) << "eval batch " << i;
    EXPECT_EQ(a.labels, b.labels) << "eval batch " << i;
  }
}

TEST(DataFiles, PipelineExpandsGlobsAndRefusesADamagedStore) {
  Corpus corpus;
  auto tok = make_tokenizer(corpus_config(corpus.fasta));
  const auto glob = make_dataset(corpus_config(corpus.d.file("*.fa")), *tok, Split::kTrain);
  const auto store = make_dataset(corpus_config(corpus.store), *tok, Split::kTrain);
  EXPECT_EQ(glob->size(), store->size());
  fs::resize_file(corpus.store + "/names.bin", 1);
  expect_error([&] { make_dataset(corpus_config(corpus.store), *tok, Split::kTrain); },
               kStoreCorrupt, {corpus.store + "/names.bin"});
}

}  // namespace
}  // namespace dnallm::data
