// The packed genome store (Note [Genome store format]) against the FASTA path it replaces: a
// generated genome with contigs of every length modulo 4, N runs and soft-masked runs at contig
// starts, ends and across each other, IUPAC codes, U, wrapped, unwrapped (longer than the
// packer's read block) and Windows lines, in plain, gzip and BGZF files. Every window around
// every boundary reads byte-identical from the store and from SequenceReader, the datasets over
// both give the same samples, and a damaged store or one of another version is refused.
#include "worker/data/genome_store.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/process.hpp"
#include "worker/data/genome_cache.hpp"
#include "worker/data/genome_dataset.hpp"
#include "worker/data/sequence_reader.hpp"
#include "worker/data/sequence_stream.hpp"
#include "worker/data/store_packer.hpp"

namespace dnallm::data {
namespace {

namespace fs = std::filesystem;
using dnallm::testing::expect_error;

// A contig's text as a FASTA writer would put it: soft-masked and N runs, an IUPAC code, a U.
std::string make_contig(size_t length, uint64_t seed) {
  std::string s = testing::random_bases(length, seed);
  uint64_t x = seed;
  auto next = [&x](uint64_t n) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<size_t>((x >> 33) % n);
  };
  for (int run = 0; run < 6 && length > 8; ++run) {
    const size_t at = next(length), len = 1 + next(std::min<size_t>(length / 4 + 1, 300));
    for (size_t i = at; i < std::min(length, at + len); ++i) s[i] = 'N';
  }
  for (int run = 0; run < 6 && length > 8; ++run) {
    const size_t at = next(length), len = 1 + next(std::min<size_t>(length / 3 + 1, 500));
    for (size_t i = at; i < std::min(length, at + len); ++i)
      s[i] = static_cast<char>(std::tolower(s[i]));
  }
  if (length > 20) {
    s[length / 2] = 'R';  // IUPAC: N
    s[length / 3] = 'u';  // soft-masked U: t
    s[0] = 'N';           // runs at the contig's ends
    s[length - 1] = 'n';
  }
  return s;
}

std::string wrap(const std::string& s, size_t width, const char* eol) {
  std::string out;
  for (size_t i = 0; i < s.size(); i += width) out += s.substr(i, width) + eol;
  return out;
}

struct Genome {
  testing::TempDir dir;
  std::vector<std::string> files;
};

// Three files: plain (wrapped at 60, one contig on a single 1.3 Mbase line), gzip (CRLF,
// wrapped at 61, short contigs of every length modulo 4), BGZF (wrapped at 80).
const Genome& genome() {
  static const std::unique_ptr<Genome> g = [] {
    auto out = std::make_unique<Genome>();
    std::string a, b, c;
    a += ">chr1 first\n" + wrap(make_contig(10'003, 1), 60, "\n");
    a += ">chr2\n" + make_contig(1'300'001, 2) + "\n";
    a += ">chr3\n" + wrap(make_contig(4'097, 3), 60, "\n") + "\n\n";
    for (size_t len : {1, 2, 3, 4, 5, 7, 9, 33, 250}) {
      b += fmt::format(">short_{} x\r\n", len) + wrap(make_contig(len, 10 + len), 61, "\r\n");
    }
    b += ">allN\r\n" + std::string(130, 'N') + "\r\n";
    c += ">chrB\n" + wrap(make_contig(70'000, 4), 80, "\n");
    c += ">chrC\n" + wrap(make_contig(200'000, 5), 80, "\n");
    out->files = {out->dir.file("a.fa"), out->dir.file("b.fa.gz"), out->dir.file("c.fa.bgz")};
    testing::write_text(out->files[0], a);
    testing::write_gzip(out->files[1], b);
    testing::write_bgzf(out->files[2], c);
    return out;
  }();
  return *g;
}

std::vector<SequenceRecord> read_all(bool keep_case) {
  std::vector<SequenceRecord> out;
  for (const auto& f : genome().files) {
    SequenceReader r(f);
    r.set_keep_case(keep_case);
    SequenceRecord rec;
    while (r.next(rec)) out.push_back(rec);
  }
  return out;
}

std::string pack_to(const std::string& name) {
  const std::string dir = genome().dir.file(name);
  PackOptions o;
  o.progress_seconds = 0;
  const PackStats s = pack_genome_store(dir, genome().files, o);
  EXPECT_GT(s.bases, 1'500'000u);
  EXPECT_GT(s.bytes_per_base(), 0.25);
  EXPECT_LT(s.bytes_per_base(), 0.5);
  return dir;
}

const std::string& store_dir() {
  static const std::string dir = pack_to("store");
  return dir;
}

// Positions where something changes: contig ends, N runs, case runs (and their neighbours).
std::vector<int64_t> boundaries(const std::string& cased) {
  std::vector<int64_t> out = {0, static_cast<int64_t>(cased.size())};
  for (size_t i = 1; i < cased.size(); ++i) {
    const bool n0 = std::toupper(cased[i - 1]) == 'N', n1 = std::toupper(cased[i]) == 'N';
    const bool l0 = std::islower(cased[i - 1]) != 0, l1 = std::islower(cased[i]) != 0;
    if (n0 != n1 || l0 != l1) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

TEST(GenomeStore, EveryWindowAtEveryBoundaryEqualsTheFasta) {
  const auto store = GenomeStore::open(store_dir());
  const auto upper = read_all(false), cased = read_all(true);
  ASSERT_EQ(store->record_count(), upper.size());
  int64_t windows = 0;
  for (size_t r = 0; r < upper.size(); ++r) {
    const std::string& s = upper[r].bases;
    const auto len = static_cast<int64_t>(s.size());
    ASSERT_EQ(store->record_name(r), upper[r].name);
    ASSERT_EQ(store->record_length(r), len) << upper[r].name;
    std::string whole, whole_cased;
    store->read(r, 0, len, whole);
    store->read_keep_case(r, 0, len, whole_cased);
    ASSERT_EQ(whole, s) << upper[r].name;
    ASSERT_EQ(whole_cased, cased[r].bases) << upper[r].name;
    for (const int64_t b : boundaries(cased[r].bases)) {
      for (int64_t start = b - 5; start <= b + 4; ++start) {
        for (int64_t w : {1, 2, 3, 4, 5, 7, 13, 64, 510}) {
          if (start < 0 || start + w > len) continue;
          std::string got, got_cased;
          store->read(r, start, w, got);
          store->read_keep_case(r, start, w, got_cased);
          ASSERT_EQ(got, s.substr(start, w)) << upper[r].name << " at " << start << " +" << w;
          ASSERT_EQ(got_cased, cased[r].bases.substr(start, w)) << upper[r].name << " " << start;
          const auto n = static_cast<int64_t>(std::count(got.begin(), got.end(), 'N'));
          ASSERT_EQ(store->count_n(r, start, w, w), n) << upper[r].name << " at " << start;
          ++windows;
        }
      }
    }
  }
  EXPECT_GT(windows, 10'000);
}

TEST(GenomeStore, DatasetsOverStoreAndFastaGiveTheSameSamples) {
  const auto store = GenomeStore::open(store_dir());
  for (auto sampling : {cfg::Sampling::kRandom, cfg::Sampling::kTile}) {
    for (auto split : {Split::kAll, Split::kTrain, Split::kEval}) {
      GenomeOptions o;
      o.window_bases = 100;
      o.sampling = sampling;
      o.window_stride = sampling == cfg::Sampling::kTile ? 37 : 0;
      o.max_n_fraction = 0.05;
      o.reverse_complement = 0.5;
      o.eval_fraction = 0.1;
      o.split = split;
      GenomeDataset fasta(genome().files, o);
      GenomeDataset packed(store, o, store_dir());
      ASSERT_EQ(packed.size(), fasta.size());
      ASSERT_EQ(packed.total_bases(), fasta.total_bases());
      for (uint64_t i = 0; i < std::min<uint64_t>(fasta.size(), 3000); ++i) {
        SampleRng a(9, 0, i), b(9, 0, i);
        ASSERT_EQ(packed.get(i, a).bases, fasta.get(i, b).bases)
            << cfg::spelling(sampling) << " split " << static_cast<int>(split) << " sample " << i;
      }
    }
  }
}

// Note [Genome weights]: a store's files are the files it was packed from, so a mix by weights or
// by temperature draws the same windows from the store as from the FASTA files.
TEST(GenomeStore, WeightsMixStoreAndFastaAlike) {
  const auto store = GenomeStore::open(store_dir());
  ASSERT_EQ(store->file_count(), genome().files.size());
  for (size_t f = 0; f < genome().files.size(); ++f)
    EXPECT_EQ(store->file_name(f), genome().files[f]);
  for (int mix = 0; mix < 2; ++mix) {
    GenomeOptions o;
    o.window_bases = 100;
    o.max_n_fraction = 0.05;
    o.eval_fraction = 0.1;
    o.split = Split::kTrain;
    if (mix == 0) o.file_weights = {1, 0.5, 3};
    if (mix == 1) o.temperature = 3;
    GenomeDataset fasta(genome().files, o);
    GenomeDataset packed(store, o, store_dir());
    for (uint64_t i = 0; i < 3000; ++i) {
      SampleRng a(9, 0, i), b(9, 0, i);
      ASSERT_EQ(packed.get(i, a).bases, fasta.get(i, b).bases) << "mix " << mix << " " << i;
    }
  }
}

// Note [Genome cache]: files over the threshold are packed once into data.cache_dir, reused
// while unchanged, packed again when one changes; two processes at once share one store.
TEST(GenomeCache, LargeFilesArePackedOnceReusedAndPackedAgainWhenChanged) {
  testing::TempDir cache;
  testing::TempDir data;
  std::vector<std::string> files;
  for (size_t i = 0; i < 2; ++i) {
    files.push_back(data.file(fmt::format("g{}.fa", i)));
    testing::write_text(files.back(),
                        fmt::format(">c{}\n", i) + make_contig(20'000, 30 + i) + "\n");
  }
  GenomeCacheOptions o;
  o.cache_dir = cache.file("genomes");
  o.threshold_bases = 50'000;
  EXPECT_EQ(cached_genome_store(files, o), "");  // about 40 kbases: read into memory
  o.threshold_bases = 30'000;
  o.skip_bad_records = true;
  EXPECT_EQ(cached_genome_store(files, o), "");  // packing refuses bad records
  o.skip_bad_records = false;
  const std::string dir = cached_genome_store(files, o);
  ASSERT_EQ(fs::path(dir).parent_path(), fs::path(o.cache_dir));
  ASSERT_TRUE(is_genome_store(dir));
  const auto manifest = [&] { return GenomeStore::open(dir)->manifest_text(); };
  const std::string first = manifest();
  EXPECT_EQ(cached_genome_store(files, o), dir);
  EXPECT_EQ(manifest(), first);  // reused, not packed again
  // The windows are the FASTA's.
  GenomeOptions g;
  g.window_bases = 300;
  g.max_n_fraction = 0.1;
  GenomeDataset fasta(files, g);
  GenomeDataset packed(GenomeStore::open(dir), g, dir);
  for (uint64_t i = 0; i < 200; ++i) {
    SampleRng a(3, 0, i), b(3, 0, i);
    ASSERT_EQ(packed.get(i, a).bases, fasta.get(i, b).bases);
  }
  // A source that changes (here: its time) makes the store stale: packed again in place.
  fs::last_write_time(files[1], fs::last_write_time(files[1]) + std::chrono::seconds(5));
  EXPECT_EQ(cached_genome_store(files, o), dir);
  EXPECT_NE(manifest(), first);
  // Another list of files is another store.
  EXPECT_NE(cached_genome_store({files[0]}, GenomeCacheOptions{1000, o.cache_dir}), dir);
  // Without data.cache_dir: beside the first file.
  GenomeCacheOptions beside;
  beside.threshold_bases = 1000;
  EXPECT_EQ(fs::path(cached_genome_store(files, beside)).parent_path(),
            fs::path(files[0]).parent_path());
}

TEST(GenomeCache, ProcessesPackingAtOnceShareOneStore) {
  testing::TempDir cache;
  GenomeCacheOptions o;
  o.cache_dir = cache.file("c");
  o.threshold_bases = 1000;
  std::string a, b;
  std::thread other([&] { a = cached_genome_store(genome().files, o); });
  b = cached_genome_store(genome().files, o);
  other.join();
  EXPECT_EQ(a, b);
  GenomeStore::open(a)->verify_all();
  for (const auto& e : fs::directory_iterator(o.cache_dir)) {
    EXPECT_EQ(e.path().filename().string().find(".packing"), std::string::npos) << e.path();
  }
}

// Note [Genome regions]: BED regions narrow a store's windows as they narrow the FASTA's.
TEST(GenomeStore, RegionsNarrowStoreAndFastaAlike) {
  const auto store = GenomeStore::open(store_dir());
  std::string train, held, exclude;
  for (size_t r = 0; r < store->record_count(); ++r) {
    const int64_t len = store->record_length(r);
    const std::string name = store->record_name(r);
    if (len < 4000) continue;  // the short records: in no BED, so in no window of train.bed
    train += fmt::format("{}\t{}\t{}\n", name, len / 10, len * 9 / 10);
    held += fmt::format("{}\t{}\t{}\n", name, len / 2, len / 2 + len / 20 + 1);
    exclude += fmt::format("{}\t{}\t{}\n", name, len / 4, len / 4 + 777);
  }
  testing::TempDir dir;
  auto bed = [&](const std::string& name, const std::string& text) {
    testing::write_text(dir.file(name), text);
    return std::make_shared<const GenomeRegions>(read_bed(dir.file(name)));
  };
  for (auto split : {Split::kTrain, Split::kEval}) {
    GenomeOptions o;
    o.window_bases = 100;
    o.sampling = cfg::Sampling::kTile;
    o.window_stride = 53;
    o.max_n_fraction = 0.05;
    o.split = split;
    o.include = bed("train.bed", train);
    o.held_out = bed("eval.bed", held);
    o.exclude = bed("exclude.bed", exclude);
    GenomeDataset fasta(genome().files, o);
    GenomeDataset packed(store, o, store_dir());
    GenomeOptions whole = o;
    whole.include = whole.held_out = whole.exclude = nullptr;
    whole.split = Split::kAll;
    ASSERT_EQ(packed.size(), fasta.size());
    EXPECT_LT(fasta.size(), GenomeDataset(genome().files, whole).size() * 9 / 10);
    for (uint64_t i = 0; i < fasta.size(); ++i) {
      SampleRng a(9, 0, i), b(9, 0, i);
      ASSERT_EQ(packed.get(i, a).bases, fasta.get(i, b).bases)
          << "split " << static_cast<int>(split) << " " << i;
    }
  }
}

TEST(GenomeStore, StreamingParserMatchesTheReaderOnBadInput) {
  testing::TempDir d;
  struct Case {
    std::string name, text;
  };
  const std::vector<Case> cases = {
      {"bad_char.fa", ">r1\nACGT\nACXT\n"},     {"cr_inside.fa", ">r1\nAC\rGT\n"},
      {"empty.fa", ">r1\n>r2\nACGT\n"},         {"no_header.fa", "\nACGT\n"},
      {"fq_quality.fq", "@r1\nACGT\n+\nIII\n"}, {"fq_plus.fq", "@r1\nACGT\nIIII\n"},
  };
  struct Null final : SequenceSink {
    void begin_record(const std::string&) override {}
    void bases(std::string_view) override {}
    void end_record() override {}
  } sink;
  for (const auto& c : cases) {
    const std::string path = d.file(c.name);
    testing::write_text(path, c.text);
    std::string reader_error;
    try {
      read_sequences(path, cfg::DataFormat::kAuto, BadRecordPolicy::kError);
    } catch (const Error& e) {
      reader_error = e.what();
    }
    ASSERT_FALSE(reader_error.empty()) << c.name;
    expect_error([&] { stream_sequences(path, cfg::DataFormat::kAuto, sink); }, ExitCode::kBadData,
                 {reader_error});
  }
}

std::string copy_store(const std::string& name) {
  const std::string dir = genome().dir.file(name);
  fs::remove_all(dir);
  fs::copy(store_dir(), dir);
  return dir;
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5A);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

TEST(GenomeStore, ADamagedChunkIsRefusedWhereItIsReadAndByVerify) {
  const std::string dir = copy_store("flipped");
  flip_byte(dir + "/bases.2bit", 3 * kStoreChunkBytes + 17);  // inside chr2
  const auto store = GenomeStore::open(dir);                  // lazily checked: opens
  std::string untouched;
  store->read(0, 0, 100, untouched);  // chr1, chunk 0: fine
  const int64_t at = (3 * static_cast<int64_t>(kStoreChunkBytes) + 17) * 4 - 10'003;
  expect_error(
      [&] {
        std::string s;
        store->read(1, at, 10, s);
      },
      kStoreCorrupt, {dir + "/bases.2bit", "do not match their checksum", "pack it again"});
  expect_error([&] { GenomeStore::open(dir)->verify_all(); }, kStoreCorrupt, {"bases.2bit"});
}

TEST(GenomeStore, TruncatedMissingOrMismatchedFilesAreRefusedAtOpen) {
  {
    const std::string dir = copy_store("truncated");
    fs::resize_file(dir + "/bases.2bit", fs::file_size(dir + "/bases.2bit") - 1);
    expect_error([&] { GenomeStore::open(dir); }, kStoreCorrupt,
                 {dir + "/bases.2bit", "the manifest says"});
  }
  {
    const std::string dir = copy_store("missing");
    fs::remove(dir + "/n_runs.bin");
    expect_error([&] { GenomeStore::open(dir); }, kStoreCorrupt, {"n_runs.bin", "missing"});
  }
  {
    const std::string dir = copy_store("sums");
    flip_byte(dir + "/checksums.bin", 5);
    expect_error([&] { GenomeStore::open(dir); }, kStoreCorrupt,
                 {"checksums.bin", "does not match the checksum"});
  }
  {
    const std::string dir = copy_store("manifest");
    testing::write_text(dir + "/genome-store.json", "{\"format\": \"dnallm-genome-store\", ");
    expect_error([&] { GenomeStore::open(dir); }, kStoreCorrupt,
                 {"genome-store.json", "not a valid manifest"});
  }
}

TEST(GenomeStore, AnotherFormatVersionIsRefused) {
  const std::string dir = copy_store("v2");
  auto m = nlohmann::json::parse(dnallm::testing::read_text(dir + "/genome-store.json"));
  m["version"] = kStoreVersion + 1;
  testing::write_text(dir + "/genome-store.json", m.dump());
  expect_error([&] { GenomeStore::open(dir); }, ExitCode::kBadData,
               {"genome-store.json", fmt::format("format version {}", kStoreVersion + 1),
                "pack its sources again"});
}

TEST(GenomeStore, PackIsAtomicAndRefusesToOverwrite) {
  testing::TempDir d;
  const std::string good = d.file("good.fa"), bad = d.file("bad.fa");
  testing::write_text(good, ">a\nACGT\n");
  testing::write_text(bad, ">b\nACGT\nAC*T\n");
  PackOptions o;
  o.progress_seconds = 0;
  expect_error(
      [&] {
        pack_genome_store(d.file("s"), {good, bad}, o);
      },
      ExitCode::kBadData, {bad + ":1: record 'b'", "'*' at line 3 column 3"});
  for (const auto& e : fs::directory_iterator(d.path()))  // neither the store nor its temp dir
    EXPECT_TRUE(e.path() == good || e.path() == bad) << e.path();
  pack_genome_store(d.file("s"), {good}, o);
  EXPECT_TRUE(is_genome_store(d.file("s")));
  expect_error([&] { pack_genome_store(d.file("s"), {good}, o); }, ExitCode::kUsage,
               {d.file("s"), "exists", "--replace"});
  o.replace = true;
  pack_genome_store(d.file("s"), {good, good}, o);
  EXPECT_EQ(GenomeStore::open(d.file("s"))->record_count(), 2u);
  fs::create_directory(d.file("plain"));
  expect_error([&] { pack_genome_store(d.file("plain"), {good}, o); }, ExitCode::kUsage,
               {"exists"});  // --replace replaces a store only
}

TEST(GenomeStore, CommandLineExitCodes) {
  const std::string bin = dnallm::testing::kBin + "dnallm-data";
  testing::TempDir d;
  const std::string fa = d.file("g.fa");
  testing::write_text(fa, ">a\n" + testing::random_bases(5000, 3) + "\n");
  const auto pack =
      dnallm::testing::run_shell(fmt::format("{} pack {} {}", bin, d.file("s"), d.path().string()));
  ASSERT_EQ(pack.code, 0) << pack.out;
  EXPECT_NE(pack.out.find("bytes/base"), std::string::npos) << pack.out;
  EXPECT_NE(pack.out.find("Mbases/s"), std::string::npos) << pack.out;
  auto verify = dnallm::testing::run_shell(fmt::format("{} verify {}", bin, d.file("s")));
  EXPECT_EQ(verify.code, 0) << verify.out;
  flip_byte(d.file("s") + "/bases.2bit", 100);
  verify = dnallm::testing::run_shell(fmt::format("{} verify {}", bin, d.file("s")));
  EXPECT_EQ(verify.code, 5) << verify.out;
  EXPECT_NE(verify.out.find(d.file("s") + "/bases.2bit"), std::string::npos) << verify.out;
  const auto again = dnallm::testing::run_shell(fmt::format("{} pack {} {}", bin, d.file("s"), fa));
  EXPECT_EQ(again.code, 2) << again.out;
  testing::write_text(d.file("bad.fa"), ">x\nAC-GT\n");
  const auto bad =
      dnallm::testing::run_shell(fmt::format("{} pack {} {}", bin, d.file("t"), d.file("bad.fa")));
  EXPECT_EQ(bad.code, 3) << bad.out;
  EXPECT_NE(bad.out.find("'-'"), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace dnallm::data
