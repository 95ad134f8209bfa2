#include "worker/data/sequence_reader.hpp"

#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::data {
namespace {

const char kFasta[] =
    ">chr1 first record\n"
    "ACGTACGTAC\n"
    "acgtnNNNAC\n"
    "\n"
    ">chr2\r\n"
    "GGGGRYCCCC\r\n"
    ">chr3\n"
    "TTU\n";

void expect_records(const std::vector<SequenceRecord>& r) {
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].name, "chr1");
  EXPECT_EQ(r[0].bases, "ACGTACGTACACGTNNNNAC");
  EXPECT_EQ(r[0].line, 1);
  EXPECT_EQ(r[1].name, "chr2");
  EXPECT_EQ(r[1].bases, "GGGGNNCCCC");
  EXPECT_EQ(r[2].bases, "TTT");
  EXPECT_EQ(r[2].line, 7);
}

using dnallm::testing::expect_bad_data;

// One FASTA record "chr" of `lines` lines of 60 random bases.
std::string long_fasta(int lines) {
  std::string text = ">chr\n";
  for (int i = 0; i < lines; ++i) text += testing::random_bases(60, i) + "\n";
  return text;
}

// Reading `name` in `dir`, cut short, must fail naming the file and "truncated".
void expect_truncated(const testing::TempDir& dir, const std::string& name,
                      BadRecordPolicy policy) {
  expect_bad_data([&] { read_sequences(dir.file(name), cfg::DataFormat::kAuto, policy); },
                  {name, "truncated"});
}

TEST(SequenceReader, PlainGzipAndBgzfFasta) {
  testing::TempDir dir;
  testing::write_text(dir.file("a.fa"), kFasta);
  testing::write_gzip(dir.file("a.fa.gz"), kFasta);
  testing::write_bgzf(dir.file("b.fasta.gz"), kFasta);
  for (const char* name : {"a.fa", "a.fa.gz", "b.fasta.gz"}) {
    SCOPED_TRACE(name);
    expect_records(read_sequences(dir.file(name), cfg::DataFormat::kAuto, BadRecordPolicy::kError));
  }
}

TEST(SequenceReader, BgzfManyBlocksAndRecords) {
  testing::TempDir dir;
  std::string text;
  std::vector<std::string> seqs;
  for (int r = 0; r < 5; ++r) {
    seqs.push_back(testing::random_bases(50000 + r, r));  // > 64 KiB BGZF blocks in total
    text += ">rec" + std::to_string(r) + "\n";
    for (size_t p = 0; p < seqs.back().size(); p += 70) text += seqs.back().substr(p, 70) + "\n";
  }
  testing::write_bgzf(dir.file("many.fa.bgz"), text);
  auto r = read_sequences(dir.file("many.fa.bgz"), cfg::DataFormat::kAuto, BadRecordPolicy::kError);
  ASSERT_EQ(r.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(r[i].bases, seqs[i]);
}

TEST(SequenceReader, BundledGenome) {
  auto r = read_sequences(std::string(DNALLM_SOURCE_DIR) + "/data/ecoli_k12_mg1655.fa.gz",
                          cfg::DataFormat::kAuto, BadRecordPolicy::kError);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].bases.size(), 4639675u);
}

TEST(SequenceReader, FastqMultiRecordAndSniffing) {
  testing::TempDir dir;
  std::string fq = "@r1 desc\nACGTN\n+\nIIIII\n@r2\nggcc\n+r2\n!!!!\n";
  testing::write_bgzf(dir.file("reads.fq.gz"), fq);
  testing::write_text(dir.file("reads.txt"), fq);
  for (const char* name : {"reads.fq.gz", "reads.txt"}) {
    auto r = read_sequences(dir.file(name), cfg::DataFormat::kAuto, BadRecordPolicy::kError);
    ASSERT_EQ(r.size(), 2u);
    EXPECT_EQ(r[0].name, "r1");
    EXPECT_EQ(r[0].bases, "ACGTN");
    EXPECT_EQ(r[1].bases, "GGCC");
    EXPECT_EQ(r[1].line, 5);
  }
}

TEST(SequenceReader, InvalidCharacterNamesFileLineRecord) {
  testing::TempDir dir;
  testing::write_text(dir.file("bad.fa"), ">ok\nACGT\n>broken\nACGT\nAC-GT\n>ok2\nAAAA\n");
  expect_bad_data(
      [&] { read_sequences(dir.file("bad.fa"), cfg::DataFormat::kAuto, BadRecordPolicy::kError); },
      {"bad.fa", "broken", "'-'", "line 5", "column 3"});
  int64_t skipped = 0;
  auto r =
      read_sequences(dir.file("bad.fa"), cfg::DataFormat::kAuto, BadRecordPolicy::kSkip, &skipped);
  EXPECT_EQ(skipped, 1);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[1].name, "ok2");
}

TEST(SequenceReader, EmptySequence) {
  testing::TempDir dir;
  testing::write_text(dir.file("empty.fa"), ">a\nACGT\n>nothing\n>b\nTT\n");
  expect_bad_data(
      [&] {
        read_sequences(dir.file("empty.fa"), cfg::DataFormat::kAuto, BadRecordPolicy::kError);
      },
      {"empty.fa:3", "nothing", "empty sequence"});
  int64_t skipped = 0;
  EXPECT_EQ(
      read_sequences(dir.file("empty.fa"), cfg::DataFormat::kAuto, BadRecordPolicy::kSkip, &skipped)
          .size(),
      2u);
  EXPECT_EQ(skipped, 1);
}

TEST(SequenceReader, TruncatedGzip) {
  testing::TempDir dir;
  testing::write_gzip(dir.file("t.fa.gz"), long_fasta(2000));
  auto size = std::filesystem::file_size(dir.file("t.fa.gz"));
  std::filesystem::resize_file(dir.file("t.fa.gz"), size / 2);
  expect_truncated(dir, "t.fa.gz", BadRecordPolicy::kSkip);
}

TEST(SequenceReader, TruncatedBgzf) {
  testing::TempDir dir;
  const std::string text = long_fasta(3000);
  testing::write_bgzf(dir.file("cut.fa.gz"), text);
  auto size = std::filesystem::file_size(dir.file("cut.fa.gz"));
  // Without the 28-byte EOF block: every data block intact, the end missing.
  std::filesystem::resize_file(dir.file("cut.fa.gz"), size - 28);
  expect_truncated(dir, "cut.fa.gz", BadRecordPolicy::kError);
  // Cut inside a block.
  testing::write_bgzf(dir.file("mid.fa.gz"), text);
  std::filesystem::resize_file(dir.file("mid.fa.gz"), size / 2);
  expect_truncated(dir, "mid.fa.gz", BadRecordPolicy::kError);
}

TEST(SequenceReader, FastqQualityMismatchAndMissingHeader) {
  testing::TempDir dir;
  testing::write_text(dir.file("q.fastq"), "@r1\nACGT\n+\nIII\n");
  expect_bad_data(
      [&] { read_sequences(dir.file("q.fastq"), cfg::DataFormat::kAuto, BadRecordPolicy::kError); },
      {"q.fastq:4", "r1", "quality has 3"});
  testing::write_text(dir.file("h.fa"), "ACGT\n");
  expect_bad_data(
      [&] { read_sequences(dir.file("h.fa"), cfg::DataFormat::kAuto, BadRecordPolicy::kError); },
      {"h.fa:1", "header"});
  expect_bad_data(
      [&] {
        read_sequences(dir.file("missing.fa"), cfg::DataFormat::kAuto, BadRecordPolicy::kError);
      },
      {"missing.fa"});
}

TEST(SequenceReader, ReverseComplement) {
  EXPECT_EQ(reverse_complement("AACGTN"), "NACGTT");
  EXPECT_EQ(reverse_complement(reverse_complement("GATTACA")), "GATTACA");
}

// Note [Long records]: a line longer than a part is read a part at a time and reads as the
// same bases; a '\r' that ends a part before its '\n' is the line's end, not a base; an invalid
// character past the first part is named at its own column; set_max_bases keeps the first
// bases and counts them all, in FASTA and FASTQ, plain and gzip.
TEST(SequenceReader, ALineLongerThanAPartIsReadInParts) {
  testing::TempDir dir;
  std::string line = testing::random_bases(kLinePartBytes + 1000, 7);
  line[kLinePartBytes - 1] = 'n';  // lower case across the part boundary
  std::string upper = line;
  upper[kLinePartBytes - 1] = 'N';
  // The '\r' of ">b"'s line is its part's last byte.
  const std::string b(kLinePartBytes - 1, 'C');
  const std::string fasta = ">a\n" + line + "\nACGT\n>b\r\n" + b + "\r\n>c\nGG";
  testing::write_text(dir.file("long.fa"), fasta);
  testing::write_gzip(dir.file("long.fa.gz"), fasta);
  for (const char* name : {"long.fa", "long.fa.gz"}) {
    SCOPED_TRACE(name);
    const auto r = read_sequences(dir.file(name), cfg::DataFormat::kAuto, BadRecordPolicy::kError);
    ASSERT_EQ(r.size(), 3u);
    EXPECT_EQ(r[0].bases, upper + "ACGT");
    EXPECT_EQ(r[0].length, static_cast<int64_t>(upper.size() + 4));
    EXPECT_EQ(r[1].line, 4);
    EXPECT_EQ(r[1].bases, b);
    EXPECT_EQ(r[2].line, 6);
    EXPECT_EQ(r[2].bases, "GG");
    SequenceReader cut(dir.file(name));
    cut.set_max_bases(5);
    SequenceRecord rec;
    ASSERT_TRUE(cut.next(rec));
    EXPECT_EQ(rec.bases, upper.substr(0, 5));
    EXPECT_EQ(rec.length, static_cast<int64_t>(upper.size() + 4));
    ASSERT_TRUE(cut.next(rec));
    EXPECT_EQ(rec.bases, "CCCCC");
  }
  std::string bad = line;
  bad[kLinePartBytes + 10] = '!';
  testing::write_text(dir.file("bad.fa"), ">a\n" + bad + "\n");
  expect_bad_data(
      [&] { read_sequences(dir.file("bad.fa"), cfg::DataFormat::kAuto, BadRecordPolicy::kError); },
      {"bad.fa:1: record 'a'", fmt::format("at line 2 column {}", kLinePartBytes + 11)});
  const std::string fastq = "@q\n" + upper + "\n+\n" + std::string(upper.size(), 'I') + "\n";
  testing::write_text(dir.file("long.fq"), fastq);
  SequenceReader q(dir.file("long.fq"));
  q.set_max_bases(3);
  SequenceRecord rec;
  ASSERT_TRUE(q.next(rec));
  EXPECT_EQ(rec.bases, upper.substr(0, 3));
  EXPECT_EQ(rec.length, static_cast<int64_t>(upper.size()));
  EXPECT_FALSE(q.next(rec));
  testing::write_text(dir.file("short_qual.fq"), "@q\n" + upper + "\n+\nIII\n");
  expect_bad_data(
      [&] {
        read_sequences(dir.file("short_qual.fq"), cfg::DataFormat::kAuto, BadRecordPolicy::kError);
      },
      {fmt::format("quality has 3 characters but the sequence has {}", upper.size())});
}

}  // namespace
}  // namespace dnallm::data
