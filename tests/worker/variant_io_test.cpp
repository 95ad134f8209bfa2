// The inputs of dnallm-infer variants (worker/infer/variant_io.hpp) on files a careless or
// hostile user gives (issue 57): a VCF cut short, malformed records, VCFs without ##contig
// lines. Torch-free: the reader alone, on files each test writes.
#include "worker/infer/variant_io.hpp"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
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

}  // namespace
}  // namespace dnallm::infer
