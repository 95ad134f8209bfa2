// The inputs of dnallm-infer variants (worker/infer/variant_io.hpp) on files a careless or
// hostile user gives (issue 57): a VCF cut short, malformed records, VCFs without ##contig
// lines, a reference whose .fai or .gzi is stale. Torch-free: the readers alone, on files each
// test writes.
#include "worker/infer/variant_io.hpp"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/process.hpp"
#include "tests/worker/data/test_files.hpp"

namespace dnallm::infer {
namespace {

namespace fs = std::filesystem;
using data::testing::TempDir;
using data::testing::write_bgzf;
using data::testing::write_gzip;
using data::testing::write_text;

const std::string kHeader =
    "##fileformat=VCFv4.2\n##contig=<ID=chr1,length=100000>\n"
    "##INFO=<ID=DP,Number=1,Type=Integer,Description=\"Depth\">\n"
    "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n";

// `n` SNV records on chr1 with an INFO field that compresses badly (several BGZF blocks).
std::string records(int n) {
  std::string out;
  uint64_t x = 7;
  for (int i = 0; i < n; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    out += "chr1\t" + std::to_string(i * 10 + 1) + "\trs" + std::to_string(i) +
           "\tA\tC\t50\tPASS\t" + "DP=" + std::to_string(x >> 20) + "\n";
  }
  return out;
}

std::vector<VcfRecord> read_all(const std::string& path) {
  VcfReader reader(path);
  std::vector<VcfRecord> out;
  for (VcfRecord r; reader.next(r);) out.push_back(r);
  return out;
}

// The offsets at which the BGZF blocks of `path` begin (each block's BSIZE + 1 bytes long).
std::vector<uint64_t> bgzf_blocks(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<uint64_t> starts;
  for (uint64_t at = 0; at + 18 <= bytes.size();) {
    starts.push_back(at);
    const auto lo = static_cast<unsigned char>(bytes[at + 16]);
    const auto hi = static_cast<unsigned char>(bytes[at + 17]);
    at += (lo | (hi << 8)) + 1u;
  }
  return starts;
}

size_t files_in(const fs::path& dir) {
  return static_cast<size_t>(std::distance(fs::directory_iterator(dir), fs::directory_iterator()));
}

void expect_bad_vcf(const std::string& path, const std::vector<std::string>& parts) {
  dnallm::testing::expect_error([&] { read_all(path); }, ExitCode::kBadData, parts);
}

TEST(VariantInputs, ABgzipVcfCutAtABlockBoundaryIsTruncated) {
  TempDir dir;
  const std::string text = kHeader + records(4400);
  const auto whole = dir.file("whole.vcf.gz");
  write_bgzf(whole, text);
  EXPECT_EQ(read_all(whole).size(), 4400u);
  const auto blocks = bgzf_blocks(whole);
  ASSERT_GE(blocks.size(), 3u);  // data blocks and the end-of-file block
  // Cut after the first block: what is left decompresses cleanly, fewer records.
  const auto cut = dir.file("cut.vcf.gz");
  fs::copy_file(whole, cut);
  fs::resize_file(cut, blocks[1]);
  expect_bad_vcf(cut, {"--vcf " + cut, "truncated", "end-of-file block"});
  // Only the end-of-file block missing.
  fs::resize_file(cut, 0);
  fs::copy_file(whole, cut, fs::copy_options::overwrite_existing);
  fs::resize_file(cut, fs::file_size(whole) - 28);
  expect_bad_vcf(cut, {"--vcf " + cut, "truncated"});
}

TEST(VariantInputs, APlainGzipVcfCutMidRecordIsNamedTruncated) {
  TempDir dir;
  const auto gz = dir.file("cut.vcf.gz");
  write_gzip(gz, kHeader + records(4400));
  fs::resize_file(gz, fs::file_size(gz) / 2);
  expect_bad_vcf(gz, {"--vcf " + gz, "truncated or corrupt after line"});
}

// Note [VCF lines] (variant_io.cpp): the line, the field and what is wrong, never the reference.
TEST(VariantInputs, AMalformedRecordNamesTheLineAndTheField) {
  TempDir dir;
  const auto vcf = dir.file("bad.vcf");
  const std::string good = "chr1\t5\t.\tA\tC\t.\t.\t.\n";
  struct Case {
    std::string line;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"chr1\t1000\t.\n", {"3 tab-separated columns", "CHROM POS ID REF ALT"}},
      {"chr1 1000 . A C . . .\n", {"1 tab-separated column ", "separated by spaces"}},
      {"chr1\tabc\t.\tA\tC\t.\t.\t.\n", {"POS \"abc\" is not a position"}},
      {"chr1\t-5\t.\tA\tC\t.\t.\t.\n", {"POS \"-5\" is not a position"}},
      {"chr1\t12x\t.\tA\tC\t.\t.\t.\n", {"POS \"12x\" is not a position"}},
      {"chr1\t99999999999999999999\t.\tA\tC\t.\t.\t.\n", {"POS \"99999999999999999999\""}},
      {"chr1\t0\t.\tA\tC\t.\t.\t.\n", {"POS 0 (a telomere)"}},
      {"chr1\t5\t.\t\tC\t.\t.\t.\n", {"REF is empty"}},
      {"chr1\t5\t.\t.\tC\t.\t.\t.\n", {"REF is empty or \".\""}},
      {"chr1\t5\t.\tA\t\t.\t.\t.\n", {"ALT is empty"}},
      {"\t5\t.\tA\tC\t.\t.\t.\n", {"CHROM is empty"}},
      {"\n", {"an empty line"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.line);
    write_text(vcf, kHeader + good + c.line + good);
    auto parts = c.parts;
    parts.push_back("--vcf " + vcf + ":6: ");  // header lines 1-4, the good record line 5
    expect_bad_vcf(vcf, parts);
  }
}

TEST(VariantInputs, UndeclaredContigsAreReadAsBcftoolsReadsThem) {
  TempDir dir;
  const auto vcf = dir.file("no_contigs.vcf");
  write_text(vcf,
             "##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"
             "chr1\t5\t.\tA\tC\t.\t.\t.\nchr2\t7\t.\tG\tT,A\t.\t.\tDP=3;AF=0.5\n"
             "chr1\t9\t.\tc\tg\t.\t.\t.\n");
  const auto r = read_all(vcf);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].chrom, "chr1");
  EXPECT_EQ(r[0].pos, 4);
  EXPECT_EQ(r[1].chrom, "chr2");
  EXPECT_EQ(r[1].alts, (std::vector<std::string>{"T", "A"}));
  EXPECT_EQ(r[2].chrom, "chr1");
  EXPECT_EQ(r[2].ref, "C");
  // One contig declared, a record on another.
  write_text(vcf, kHeader + "chrM\t3\t.\tT\tA\t.\t.\t.\nchr1\t4\t.\tA\tG\t.\t.\t.\n");
  const auto mixed = read_all(vcf);
  ASSERT_EQ(mixed.size(), 2u);
  EXPECT_EQ(mixed[0].chrom, "chrM");
  EXPECT_EQ(mixed[1].chrom, "chr1");
}

// A FASTA of `contigs`, `width` bases a line.
std::string fasta_text(const std::vector<std::pair<std::string, std::string>>& contigs,
                       size_t width) {
  std::string out;
  for (const auto& [name, bases] : contigs) {
    out += ">" + name + " a description\n";
    for (size_t at = 0; at < bases.size(); at += width) out += bases.substr(at, width) + "\n";
  }
  return out;
}

// Sets the modification time of `path` `seconds` from its FASTA's (negative: older).
void age(const std::string& path, const std::string& fasta, int seconds) {
  fs::last_write_time(path, fs::last_write_time(fasta) + std::chrono::seconds(seconds));
}

// Note [Stale indexes] (fasta_index.hpp): the index of another FASTA, older than this one
// (the case: scores read at the wrong bases) or newer but not fitting it.
TEST(VariantInputs, AStaleFaiIsRebuiltNotTrusted) {
  TempDir dir;
  const auto fa = dir.file("ref.fa");
  const std::string a = data::testing::random_bases(500, 1),
                    b = data::testing::random_bases(700, 2);
  write_text(fa, fasta_text({{"chr1", a}, {"chr2", b}}, 60));
  { ReferenceGenome first(fa); }  // builds ref.fa.fai
  const auto fai = fa + ".fai";
  ASSERT_TRUE(fs::exists(fai));
  const auto indexed_at = fs::last_write_time(fai);
  { ReferenceGenome again(fa); }  // a fresh index that fits is left alone
  EXPECT_EQ(fs::last_write_time(fai), indexed_at);
  const std::string index_of_first = dnallm::testing::read_text(fai);

  // Another FASTA under the same name: longer header, other line width, chr1 grown.
  const std::string a2 = data::testing::random_bases(900, 3);
  for (const int seconds : {-7200, 3600}) {  // the index older, then newer but not fitting
    SCOPED_TRACE(seconds);
    write_text(fa, fasta_text({{"chr1", a2}, {"chr2", b}}, 50));
    write_text(fai, index_of_first);
    age(fai, fa, seconds);
    ReferenceGenome genome(fa);
    EXPECT_EQ(genome.length("chr1"), 900);
    EXPECT_EQ(genome.fetch("chr1", 0, 900), a2);
    EXPECT_EQ(genome.fetch("chr2", 690, 700), b.substr(690));
    EXPECT_NE(dnallm::testing::read_text(fai), index_of_first);
  }
  // A record appended after the index was made (its time set back, as a copy may leave it).
  write_text(fa, fasta_text({{"chr1", a2}, {"chr2", b}, {"chr3", a}}, 50));
  { ReferenceGenome genome(fa); }
  const std::string two_records = dnallm::testing::read_text(fai);
  write_text(fa, fasta_text({{"chr1", a2}, {"chr2", b}}, 50));
  { ReferenceGenome genome(fa); }
  const std::string index_of_two = dnallm::testing::read_text(fai);
  write_text(fa, fasta_text({{"chr1", a2}, {"chr2", b}, {"chr3", a}}, 50));
  write_text(fai, index_of_two);
  age(fai, fa, 3600);
  {
    ReferenceGenome genome(fa);
    EXPECT_EQ(genome.contigs(), 3);
    EXPECT_EQ(genome.fetch("chr3", 0, 500), a);
    EXPECT_EQ(dnallm::testing::read_text(fai), two_records);
  }
  // An index whose entries name other records, or lie past the end.
  for (const std::string bad : {"chrX\t10\t6\t60\t61\n", "chr1\t90000\t18\t50\t51\n",
                                "chr1\t900\t18\t50\t49\n", "not an index\n"}) {
    SCOPED_TRACE(bad);
    write_text(fai, bad);
    age(fai, fa, 3600);
    ReferenceGenome genome(fa);
    EXPECT_EQ(genome.fetch("chr1", 100, 110), a2.substr(100, 10));
  }
}

TEST(VariantInputs, AStaleIndexThatCannotBeRebuiltIsRefusedNamingIt) {
  TempDir dir;
  const auto fa = dir.file("ref.fa");
  write_text(fa, fasta_text({{"chr1", data::testing::random_bases(300, 4)}}, 60));
  // A directory where the index is: faidx writes a new one beside it but cannot put it in place
  // (the same path as an unwritable folder, which root, as tests often run, never meets).
  const auto fai = fa + ".fai";
  fs::create_directory(fai);
  write_text(fai + "/keep", "x");
  age(fai, fa, -3600);
  dnallm::testing::expect_error([&] { ReferenceGenome genome(fa); }, ExitCode::kBadData,
                                {"--reference " + fa, "its index " + fai, "is older than the FASTA",
                                 "samtools faidx " + fa, "or delete " + fai});
  EXPECT_EQ(files_in(dir.path()), 2u);  // ref.fa and the directory: no temporary left
}

TEST(VariantInputs, AStaleGziIsRebuiltNotTrusted) {
  TempDir dir;
  const auto gz = dir.file("ref.fa.gz");
  const std::string a = data::testing::random_bases(90000, 5);  // > one BGZF block
  write_bgzf(gz, fasta_text({{"chr1", a}}, 60));
  { ReferenceGenome first(gz); }
  ASSERT_TRUE(fs::exists(gz + ".gzi"));
  const std::string old_fai = dnallm::testing::read_text(gz + ".fai");
  const std::string old_gzi = dnallm::testing::read_text(gz + ".gzi");
  const std::string b = data::testing::random_bases(120000, 6);
  write_bgzf(gz, fasta_text({{"chr1", b}}, 70));
  // The .fai rebuilt for the new file but the .gzi the old one's: older, then newer.
  { ReferenceGenome rebuilt(gz); }
  for (const int seconds : {-3600, 3600}) {
    SCOPED_TRACE(seconds);
    write_text(gz + ".gzi", old_gzi);
    age(gz + ".gzi", gz, seconds);
    ReferenceGenome genome(gz);
    EXPECT_EQ(genome.fetch("chr1", 100000, 100020), b.substr(100000, 20));
  }
  // Both of the old file, newer than it.
  write_text(gz + ".fai", old_fai);
  write_text(gz + ".gzi", old_gzi);
  age(gz + ".fai", gz, 60);
  age(gz + ".gzi", gz, 60);
  ReferenceGenome genome(gz);
  EXPECT_EQ(genome.length("chr1"), 120000);
  EXPECT_EQ(genome.fetch("chr1", 119990, 120000), b.substr(119990));
  // The .gzi missing beside a .fai.
  fs::remove(gz + ".gzi");
  ReferenceGenome without(gz);
  EXPECT_EQ(without.fetch("chr1", 0, 10), b.substr(0, 10));
}

}  // namespace
}  // namespace dnallm::infer
