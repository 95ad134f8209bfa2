// Issue 22 through the real dnallm-infer binary: nothing a command reads is ever written
// (Note [Outputs never inputs], core/output_file.cpp), sampling options are checked, and a damaged
// model directory (Note [Model shape limits], Note [Untrusted files]) is refused with exit
// code 2 or 5 and one line, never a stack trace, a signal or "internal error". Each test
// writes the damaged file itself from a tiny model that dnallm-train trains for 2 steps.
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tests/support/process.hpp"

namespace {

namespace fs = std::filesystem;
using dnallm::testing::kBin;
using dnallm::testing::kSrc;
using dnallm::testing::read_text;

const std::string kTiny =
    " --set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64"
    " --set model.max_seq_length=64 --set training.micro_batch_size=4 --set training.max_steps=2"
    " --set training.logging_steps=1 --set checkpoint.save_steps=0 --set training.eval_steps=0";

// The lines of `out` that report an error (spdlog's "[error]" or a bare "dnallm-infer: ").
std::vector<std::string> error_lines(const std::string& out) {
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin < out.size()) {
    size_t end = out.find('\n', begin);
    if (end == std::string::npos) end = out.size();
    const std::string line = out.substr(begin, end - begin);
    if (line.find("[error]") != std::string::npos || line.rfind("dnallm-infer:", 0) == 0) {
      lines.push_back(line);
    }
    begin = end + 1;
  }
  return lines;
}

// Expects `cmd` to exit with `code` and report exactly one error line holding `needle`, with
// no stack trace and no "internal error".
void expect_refused(const std::string& cmd, int code, const std::string& needle) {
  SCOPED_TRACE(cmd);
  const auto r = dnallm::testing::run_shell(cmd);
  EXPECT_EQ(r.code, code) << r.out;
  const auto lines = error_lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_NE(lines[0].find(needle), std::string::npos) << lines[0];
  EXPECT_LT(lines[0].size(), 2100u);
  EXPECT_EQ(r.out.find("frame #"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("internal error"), std::string::npos) << r.out;
}

// Files in `dir` whose name contains `part`.
std::vector<std::string> files_with(const fs::path& dir, const std::string& part) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().find(part) != std::string::npos) {
      out.push_back(e.path().string());
    }
  }
  return out;
}

class InferUntrusted : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = dnallm::testing::make_temp_dir("infer_untrusted");
    std::ofstream(dir_ / "in.fa") << ">a\nACGTACGTAAC\n>b\nTTGACA\n";
    std::ofstream(dir_ / "in.csv") << "sequence\nACGTAC\nGGCCTA\n";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A tiny causal LM exported to <dir>/<name>/final (extra: more --set).
  std::string train(const std::string& name, const std::string& extra = "") {
    const auto ck = (dir_ / name).string();
    auto r = dnallm::testing::run_shell("cd " + kSrc + " && " + kBin +
                                        "dnallm-train --config configs/gpt.toml" + kTiny +
                                        " --set checkpoint.dir=" + ck + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    return ck + "/final";
  }
  // A copy of `model` to damage.
  fs::path copy_of(const std::string& model, const std::string& name) {
    const auto to = dir_ / name;
    fs::copy(model, to, fs::copy_options::recursive);
    return to;
  }
  static void edit_config(const fs::path& model, const std::function<void(nlohmann::json&)>& f) {
    auto c = nlohmann::json::parse(read_text((model / "config.json").string()));
    f(c);
    std::ofstream(model / "config.json") << c.dump(2);
  }
  std::string infer(const std::string& sub, const std::string& model, const std::string& rest) {
    return kBin + "dnallm-infer " + sub + " --device cpu --model " + model + " " + rest;
  }
  fs::path dir_;
};

TEST_F(InferUntrusted, AnOutputThatIsAnInputIsRefusedBeforeAnyWork) {
  const auto model = train("gpt");
  const auto fa = (dir_ / "in.fa").string();
  const auto csv = (dir_ / "in.csv").string();
  const std::string fa_before = read_text(fa), csv_before = read_text(csv);
  expect_refused(infer("predict", model, "--input " + csv + " --out " + csv), 2,
                 "is the same file as " + csv);
  expect_refused(infer("generate", model, "--input " + fa + " --out " + fa), 2,
                 "is the same file as " + fa);
  // A hard link and a path through a symlinked directory are the same file too.
  fs::create_hard_link(fa, dir_ / "link.fa");
  expect_refused(
      infer("generate", model, "--input " + fa + " --out " + (dir_ / "link.fa").string()), 2,
      "which this command reads");
  fs::create_directory_symlink(dir_, dir_ / "via");
  expect_refused(
      infer("generate", model, "--input " + fa + " --out " + (dir_ / "via/in.fa").string()), 2,
      "is the same file as " + fa);
  // The model's own files are inputs as well.
  expect_refused(infer("predict", model, "--input " + csv + " --out " + model + "/config.json"), 2,
                 "config.json is the same file as");
  EXPECT_EQ(read_text(fa), fa_before);
  EXPECT_EQ(read_text(csv), csv_before);
}

// The st_mode of `path` (0 when it does not exist); lstat: a replaced node shows.
unsigned file_type(const fs::path& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 ? (st.st_mode & S_IFMT) : 0u;
}

// Issue 57 item 1: an output that is a device node or a FIFO is written in place, never
// replaced by a rename (as root, `--out /dev/null` made /dev/null a regular file), and an
// input's index is an input.
TEST_F(InferUntrusted, ADeviceOrFifoOutputIsWrittenInPlaceAndAnInputsIndexIsRefused) {
  const auto model = train("gpt");
  const auto fifo = dir_ / "out.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const auto got = dir_ / "got.fa";
  auto r = dnallm::testing::run_shell(
      "cat " + fifo.string() + " > " + got.string() + " & " +
      infer("generate", model, "--prompt ACGT --max-new-tokens 4 --out " + fifo.string()) +
      "; rc=$?; wait; exit $rc");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(file_type(fifo), unsigned(S_IFIFO));
  EXPECT_NE(read_text(got.string()).find(" generated\n"), std::string::npos)
      << read_text(got.string());
  // Device nodes made here as /dev/null (1, 3) and /dev/full (1, 7) are: root only (CI is).
  const auto null_dev = dir_ / "null", full_dev = dir_ / "full";
  if (::mknod(null_dev.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0 &&
      ::mknod(full_dev.c_str(), S_IFCHR | 0666, makedev(1, 7)) == 0) {
    r = dnallm::testing::run_shell(
        infer("generate", model, "--prompt ACGT --max-new-tokens 4 --out " + null_dev.string()));
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(file_type(null_dev), unsigned(S_IFCHR));
    expect_refused(
        infer("generate", model, "--prompt ACGT --max-new-tokens 4 --out " + full_dev.string()), 2,
        "write to --out " + full_dev.string() + " failed");
    EXPECT_EQ(file_type(full_dev), unsigned(S_IFCHR));
  } else {
    std::cerr << "device-node cases not run: mknod needs root (" << std::strerror(errno) << ")\n";
  }
  const auto fa = (dir_ / "in.fa").string();
  std::ofstream(fa + ".fai") << "a\t11\t3\t11\t12\nb\t6\t19\t6\t7\n";
  const std::string fai_before = read_text(fa + ".fai");
  expect_refused(infer("generate", model, "--input " + fa + " --out " + fa + ".fai"), 2,
                 "is the same file as " + fa + ".fai");
  EXPECT_EQ(read_text(fa + ".fai"), fai_before);
  EXPECT_TRUE(files_with(dir_, ".tmp").empty());
}

// Issue 57 item 1, the outputs written with their header last and renamed into place: embed's
// .npy/.safetensors and the files beside it, dnallm-eval --logits --out. A device or a FIFO
// under such a name is exit 2 before any work and stays what it was (a rename made it a regular
// file, as root /dev/null too); an input of --logits is refused as every program's are.
TEST_F(InferUntrusted, AnOutputWrittenHeaderLastIsNeverADeviceOrAFifo) {
  const std::string model = kSrc + "/tests/data/hf-fixtures/gptneox_causal";
  const auto fa = (dir_ / "in.fa").string();
  const auto seqs = (dir_ / "seqs.txt").string();
  std::ofstream(seqs) << "ACGTACGT\nTTGACA\n";
  const auto embed = [&](const fs::path& out) {
    return infer("embed", model, "--input " + fa + " --out " + out.string());
  };
  const auto logits = [&](const fs::path& out) {
    return kBin + "dnallm-eval --device cpu --model " + model + " --logits " + seqs + " --out " +
           out.string();
  };
  const auto fifo = dir_ / "e.npy", ids_fifo = dir_ / "f.ids.txt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  ASSERT_EQ(::mkfifo(ids_fifo.c_str(), 0600), 0) << std::strerror(errno);
  expect_refused(embed(fifo), 2, "--out " + fifo.string() + " is not a regular file (a FIFO)");
  expect_refused(embed(dir_ / "f.npy"), 2,
                 "--out's ids file " + ids_fifo.string() + " is not a regular file (a FIFO)");
  expect_refused(logits(fifo), 2, "--out " + fifo.string() + " is not a regular file (a FIFO)");
  EXPECT_EQ(file_type(fifo), unsigned(S_IFIFO));
  EXPECT_EQ(file_type(ids_fifo), unsigned(S_IFIFO));
  EXPECT_FALSE(fs::exists(dir_ / "f.npy"));
  expect_refused(logits(seqs), 2, "is the same file as " + seqs);
  expect_refused(logits(model + "/config.json"), 2, "config.json is the same file as");
  // Device nodes made here as /dev/null (1, 3) and /dev/full (1, 7) are: root only (CI is).
  const auto null_dev = dir_ / "null.npy", full_dev = dir_ / "full.safetensors";
  if (::mknod(null_dev.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0 &&
      ::mknod(full_dev.c_str(), S_IFCHR | 0666, makedev(1, 7)) == 0) {
    expect_refused(embed(null_dev), 2, "is not a regular file (a device)");
    expect_refused(embed(full_dev), 2, "is not a regular file (a device)");
    expect_refused(logits(full_dev), 2, "is not a regular file (a device)");
    EXPECT_EQ(file_type(null_dev), unsigned(S_IFCHR));
    EXPECT_EQ(file_type(full_dev), unsigned(S_IFCHR));
  } else {
    std::cerr << "device-node cases not run: mknod needs root (" << std::strerror(errno) << ")\n";
  }
  const auto good = dnallm::testing::run_shell(logits(dir_ / "good.safetensors"));
  EXPECT_EQ(good.code, 0) << good.out;
  EXPECT_TRUE(fs::is_regular_file(dir_ / "good.safetensors"));
  EXPECT_TRUE(files_with(dir_, ".tmp").empty());
}

// Issue 57 item 5: --window is checked: negative, past int64 and past the largest window
// the model takes are one usage error naming --window, never silently the default, an
// overflowed check or a run that holds GBs until killed.
TEST_F(InferUntrusted, AWindowOutOfRangeIsOneUsageErrorNamingIt) {
  const auto model = train("gpt");
  std::ofstream(dir_ / "long.fa") << ">r\n" << std::string(3000, 'A') << "\n";
  const auto mutagenesis = [&](const std::string& window) {
    return infer("mutagenesis", model,
                 "--input " + (dir_ / "long.fa").string() + " --region 10-12 --window " + window +
                     " --out " + (dir_ / "m.tsv").string());
  };
  for (const std::string w : {"-5", "10000000000000000000"}) {
    const auto r = dnallm::testing::run_shell(mutagenesis(w));
    EXPECT_EQ(r.code, 2) << w << ": " << r.out;
    EXPECT_NE(r.out.find("--window"), std::string::npos) << r.out;
  }
  expect_refused(mutagenesis("1000000000"), 2, "give --window <=");
  EXPECT_FALSE(fs::exists(dir_ / "m.tsv"));
}

// Issue 57 items 9 and 5: the variant window is in bases. A 6-mer model (esm_v1_mlm: 62 usable
// positions, <cls> and <eos> around 60 tokens) holds 360 bases, the default window, logged; a
// window was 60 bases by default and 360 refused. One base more is exit 2 naming the largest; a
// run of N next to the variant (a token a base) narrows that site's window, with a warning.
TEST_F(InferUntrusted, TheVariantWindowIsTheBasesThePositionsHold) {
  const std::string model = kSrc + "/tests/data/hf-fixtures/esm_v1_mlm";
  const std::string genome = dnallm::testing::bundled_genome(4000).substr(0, 2000);
  const auto fa = (dir_ / "ref.fa").string(), vcf = (dir_ / "v.vcf").string();
  const auto write_fasta = [&](const std::string& bases) {
    std::ofstream out(fa);
    out << ">chr1\n";
    for (size_t at = 0; at < bases.size(); at += 60) out << bases.substr(at, 60) << "\n";
    fs::remove(fa + ".fai");
  };
  write_fasta(genome);
  const char ref = genome[1000];
  std::ofstream(vcf) << "##fileformat=VCFv4.2\n##contig=<ID=chr1>\n"
                     << "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"
                     << "chr1\t1001\t.\t" << ref << "\t" << (ref == 'A' ? 'C' : 'A')
                     << "\t.\t.\t.\n";
  const auto variants = [&](const std::string& extra) {
    return infer("variants", model, "--reference " + fa + " --vcf " + vcf + " --out - " + extra);
  };
  const auto score = [](const std::string& out) {
    const auto at = out.find("chr1\t1001\t");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  const auto by_default = dnallm::testing::run_shell(variants(""));
  ASSERT_EQ(by_default.code, 0) << by_default.out;
  EXPECT_NE(by_default.out.find("variant window: 360 bases"), std::string::npos) << by_default.out;
  ASSERT_FALSE(score(by_default.out).empty()) << by_default.out;
  const auto whole = dnallm::testing::run_shell(variants("--window 360"));
  ASSERT_EQ(whole.code, 0) << whole.out;
  EXPECT_EQ(score(whole.out), score(by_default.out));
  const auto tokens_as_bases = dnallm::testing::run_shell(variants("--window 60"));
  ASSERT_EQ(tokens_as_bases.code, 0) << tokens_as_bases.out;
  EXPECT_NE(score(tokens_as_bases.out), score(by_default.out));
  expect_refused(variants("--window 361"), 2, "give --window <= 360");
  std::string with_gap = genome;
  with_gap.replace(1010, 200, std::string(200, 'N'));
  write_fasta(with_gap);
  const auto gap = dnallm::testing::run_shell(variants(""));
  ASSERT_EQ(gap.code, 0) << gap.out;
  EXPECT_NE(gap.out.find("1 sites had their 360-base window narrowed"), std::string::npos)
      << gap.out;
  EXPECT_FALSE(score(gap.out).empty()) << gap.out;
}

// Issue 57 item 5 in dnallm-eval: a negative --window is exit 2 naming it (it was the default);
// one past what the model takes (10^19 is read as the largest integer) is cut to it with a
// warning, and the JSON says the window used (it said the option).
TEST_F(InferUntrusted, AnEvalWindowOutOfRangeIsRefusedOrCut) {
  const std::string model = kSrc + "/tests/data/hf-fixtures/hyenadna_causal";
  std::ofstream(dir_ / "long.fa") << ">r\n" << std::string(3000, 'A') << "\n";
  const auto eval = [&](const std::string& window) {
    return dnallm::testing::run_shell(kBin + "dnallm-eval --device cpu --model " + model +
                                      " --fasta " + (dir_ / "long.fa").string() + " --window " +
                                      window);
  };
  const auto negative = eval("-5");
  EXPECT_EQ(negative.code, 2) << negative.out;
  EXPECT_NE(negative.out.find("--window"), std::string::npos) << negative.out;
  for (const std::string w : {"1000000000", "10000000000000000000"}) {
    const auto cut = eval(w);
    ASSERT_EQ(cut.code, 0) << cut.out;
    EXPECT_NE(cut.out.find("is more than the model takes"), std::string::npos) << cut.out;
    const auto at = cut.out.rfind("\n{") + 1;  // the JSON line (0 when it is the first)
    const auto json = nlohmann::json::parse(cut.out.substr(at, cut.out.find('\n', at) - at));
    EXPECT_LT(json.at("window").get<int64_t>(), 1000000000) << cut.out;
  }
}

// The peak resident memory (KiB) of `cmd` (its output to `log`): wait4's ru_maxrss of the shell
// that execs it.
long peak_rss_kib(const std::string& cmd, const fs::path& log, int* code) {
  const std::string line = "exec " + cmd + " > " + log.string() + " 2>&1";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  struct rusage ru {};
  ::wait4(pid, &status, 0, &ru);
  *code = dnallm::testing::exit_code_of(status);
  return ru.ru_maxrss;
}

// Issue 57 item 7 (Note [Long records], sequence_reader.hpp): a record costs what its window
// costs. embed on a 32 MiB record on one line, and dnallm-eval --max-bases on it, peak within
// 16 MiB of the same runs on a record of 20,000 bases (the same windows: embed cuts both to the
// model's positions); they held about 12 bytes a base (~380 MiB more).
TEST_F(InferUntrusted, ALongRecordCostsWhatItsWindowCosts) {
  // embed on a model of 64 positions (a rotary one takes 8,192 tokens: 1.4 GB of attention)
  const std::string masked = kSrc + "/tests/data/hf-fixtures/bert_mlm";
  const std::string causal = kSrc + "/tests/data/hf-fixtures/gptneox_causal";
  const auto long_fa = dir_ / "long.fa", short_fa = dir_ / "short.fa";
  {
    const std::string block = dnallm::testing::bundled_genome(1 << 16);
    std::ofstream out(long_fa);
    out << ">chr\n";
    for (size_t n = 0; n < (size_t{32} << 20); n += block.size()) out << block;
    out << "\n>b\nACGTACGT\n";
    std::ofstream(short_fa) << ">chr\n" << block.substr(0, 20000) << "\n>b\nACGTACGT\n";
  }
  const auto embed = [&](const fs::path& in) {
    return kBin + "dnallm-infer embed --device cpu --model " + masked + " --input " + in.string() +
           " --out " + (dir_ / "e.npy").string();
  };
  const auto eval = [&](const fs::path& in) {
    return kBin + "dnallm-eval --device cpu --model " + causal + " --fasta " + in.string() +
           " --max-bases 20000";
  };
  const std::vector<std::function<std::string(const fs::path&)>> programs = {embed, eval};
  for (const auto& program : programs) {
    int code_short = -1, code_long = -1;
    const long peak_short = peak_rss_kib(program(short_fa), dir_ / "short.log", &code_short);
    const long peak_long = peak_rss_kib(program(long_fa), dir_ / "long.log", &code_long);
    const std::string log = read_text((dir_ / "long.log").string());
    SCOPED_TRACE(program(long_fa));
    ASSERT_EQ(code_short, 0) << read_text((dir_ / "short.log").string());
    ASSERT_EQ(code_long, 0) << log;
    std::cout << "peak RSS: 20,000 bases " << peak_short / 1024 << " MiB, 32 MiB record "
              << peak_long / 1024 << " MiB\n";
    EXPECT_LT(peak_long - peak_short, 16 * 1024) << log;
  }
  EXPECT_EQ(read_text((dir_ / "e.ids.txt").string()), "chr\nb\n");
}

TEST_F(InferUntrusted, AnExistingDirectoryAsOutputIsRefusedAndNothingIsLeft) {
  const auto model = train("gpt");
  const auto fa = (dir_ / "in.fa").string();
  fs::create_directories(dir_ / "out.npy");
  expect_refused(infer("embed", model, "--input " + fa + " --out " + (dir_ / "out.npy").string()),
                 2, "is an existing directory");
  // The ids file's name taken by a directory: refused before the work, ids not renamed.
  fs::create_directories(dir_ / "e.ids.txt");
  expect_refused(infer("embed", model, "--input " + fa + " --out " + (dir_ / "e.npy").string()), 2,
                 "ids file " + (dir_ / "e.ids.txt").string() + " is an existing directory");
  fs::create_directories(dir_ / "p.csv");
  expect_refused(infer("generate", model, "--prompt ACGT --out " + (dir_ / "p.csv").string()), 2,
                 "is an existing directory");
  EXPECT_TRUE(files_with(dir_, ".tmp").empty());
  EXPECT_FALSE(fs::exists(dir_ / "e.npy"));
  // A good run names the ids file F.ids.txt as documented (not F.npy.ids.txt).
  const auto r = dnallm::testing::run_shell(
      infer("embed", model, "--input " + fa + " --out " + (dir_ / "good.npy").string()));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_text((dir_ / "good.ids.txt").string()), "a\nb\n");
  EXPECT_FALSE(fs::exists(dir_ / "good.npy.ids.txt"));
  EXPECT_TRUE(files_with(dir_, ".tmp").empty());
}

TEST_F(InferUntrusted, AFailedRunLeavesNoOutputAndNoTemporaryFile) {
  const auto model = train("gpt");
  // predict needs a classifier: the run fails after its output was opened.
  const auto out = dir_ / "pred.csv";
  expect_refused(
      infer("predict", model, "--input " + (dir_ / "in.csv").string() + " --out " + out.string()),
      2, "predict needs a fine-tuned classifier");
  EXPECT_FALSE(fs::exists(out));
  EXPECT_TRUE(files_with(dir_, ".tmp").empty());
  // An existing output is replaced only when the new one is complete.
  std::ofstream(dir_ / "gen.fa") << "old\n";
  std::ofstream(dir_ / "bad.fa") << ">x\nACGT12\n";
  const auto bad = dnallm::testing::run_shell(
      infer("generate", model,
            "--input " + (dir_ / "bad.fa").string() + " --out " + (dir_ / "gen.fa").string()));
  EXPECT_EQ(bad.code, 3) << bad.out;
  EXPECT_EQ(read_text((dir_ / "gen.fa").string()), "old\n");
  EXPECT_TRUE(files_with(dir_, ".tmp").empty());
}

TEST_F(InferUntrusted, SamplingOptionsAreCheckedAndEveryNewTokenIsABase) {
  const auto model = train("gpt");
  const std::string prompt = "--prompt ACGTACGTAA ";
  expect_refused(infer("generate", model, prompt + "--temperature nan"), 2,
                 "--temperature nan: give a finite number > 0");
  expect_refused(infer("generate", model, prompt + "--temperature -1"), 2, "--temperature -1");
  expect_refused(infer("generate", model, prompt + "--temperature inf"), 2, "--temperature inf");
  expect_refused(infer("generate", model, prompt + "--top-k -5"), 2, "--top-k -5");
  // --prompt "": refused, and no temporary prompts file left behind.
  const auto tmp = dir_ / "tmp";
  fs::create_directories(tmp);
  expect_refused("TMPDIR=" + tmp.string() + " " + infer("generate", model, "--prompt ''"), 2,
                 "--prompt number 1 is empty");
  expect_refused(
      "TMPDIR=" + tmp.string() + " " + infer("generate", model, "--prompt ACGT --temperature nan"),
      2, "--temperature nan");
  EXPECT_TRUE(fs::is_empty(tmp));
  // Sampling from a barely trained model: every one of the 200 new tokens is a base
  // (special tokens are never drawn; they decoded to nothing and shortened the output).
  for (const std::string seed : {"1", "2", "3"}) {
    const auto r = dnallm::testing::run_shell(
        infer("generate", model, prompt + "--max-new-tokens 200 --temperature 1.5 --seed " + seed) +
            " --log-level error",
        dnallm::testing::Streams::kStdoutOnly);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto nl = r.out.find('\n');
    const std::string bases = r.out.substr(nl + 1, r.out.find('\n', nl + 1) - nl - 1);
    EXPECT_EQ(bases.size(), 10u + 200u) << r.out;
  }
  // Learned positions cannot extrapolate: --max-new-tokens beyond them is refused.
  const auto learned = train("learned", " --set model.position=learned");
  expect_refused(infer("generate", learned, prompt + "--max-new-tokens 100000"), 2,
                 "--max-new-tokens 100000 does not fit the model's 64 learned positions");
  const auto ok = dnallm::testing::run_shell(
      infer("generate", learned, prompt + "--max-new-tokens 40") + " --log-level error");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// Note [Batches bounded by tokens]: a batch holds at most 65536 tokens (1024 x 64 here).
TEST_F(InferUntrusted, AHugeBatchSizeIsBoundedByTokens) {
  const auto model = train("gpt");
  const auto out = (dir_ / "e.npy").string();
  const auto r = dnallm::testing::run_shell(
      infer("embed", model,
            "--batch-size 1000000 --input " + (dir_ / "in.fa").string() + " --out " + out));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--batch-size 1000000 lowered to 1024: at most 65536 tokens a batch"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(read_text((dir_ / "e.ids.txt").string()), "a\nb\n");
}

// Note [One model loader]: a Hugging Face directory runs (worker_published_models_test); one whose
// config.json no family reads is one exit-2 line naming its model_type, not bad data.
TEST_F(InferUntrusted, AHuggingFaceDirectoryOfAnotherModelIsOneUsageError) {
  const auto t5 = dir_ / "t5";
  fs::copy(kSrc + "/tests/data/hf-fixtures/bert_mlm", t5);
  fs::permissions(t5 / "config.json", fs::perms::owner_write, fs::perm_options::add);
  auto config = nlohmann::json::parse(std::ifstream(t5 / "config.json"));
  config["model_type"] = "t5";
  std::ofstream(t5 / "config.json") << config.dump();
  expect_refused(
      infer("embed", t5.string(),
            "--input " + (dir_ / "in.fa").string() + " --out " + (dir_ / "e.npy").string()),
      2, "model_type \"t5\" is not a Hugging Face layout this program reads");
}

struct ConfigCase {
  const char* name;
  const char* key;
  nlohmann::json value;
  const char* needle;
};

TEST_F(InferUntrusted, DamagedConfigValuesAreRefusedBeforeAnyAllocation) {
  const auto model = train("gpt");
  const std::vector<ConfigCase> cases = {
      {"heads0", "num_attention_heads", 0, "num_attention_heads = 0 is outside [1, 32]"},
      {"layers", "num_hidden_layers", 100000, "num_hidden_layers = 100000 is outside [1, 1024]"},
      {"negative", "hidden_size", -32, "hidden_size = -32 is outside"},
      {"huge", "vocab_size", int64_t{1} << 40, "vocab_size = 1099511627776 is outside"},
      {"overflow", "intermediate_size", uint64_t{1} << 63, "\"intermediate_size\" = "},
      {"params", "vocab_size", int64_t{1} << 24, "parameters, more than the"},
      {"memory", "hidden_size", 16384, "of memory is available here"},
      {"eps", "layer_norm_eps", -1, "layer_norm_eps = -1 must be a finite number in (0, 1)"},
      {"float", "hidden_size", 32.5, "\"hidden_size\" is missing or not an integer"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto m = copy_of(model, c.name);
    edit_config(m, [&](nlohmann::json& j) {
      j[c.key] = c.value;
      if (std::string(c.name) == "params") j["hidden_size"] = 65536;
      if (std::string(c.name) == "memory") {  // 5e10 parameters: 206 GB as fp32
        j["intermediate_size"] = 65536;
        j["num_hidden_layers"] = 16;
      }
    });
    expect_refused(infer("embed", m.string(),
                         "--input " + (dir_ / "in.fa").string() + " --out " +
                             (dir_ / (std::string(c.name) + ".npy")).string()),
                   2, c.needle);
  }
  // config.json linked to /dev/zero, or far too large: refused without reading it.
  const auto zero = copy_of(model, "zero");
  fs::remove(zero / "config.json");
  fs::create_symlink("/dev/zero", zero / "config.json");
  expect_refused(
      infer("embed", zero.string(),
            "--input " + (dir_ / "in.fa").string() + " --out " + (dir_ / "z.npy").string()),
      2, "is not a regular file (a device)");
  const auto dup = copy_of(model, "dup");
  std::string text = read_text((dup / "config.json").string());
  text.insert(text.find('{') + 1, "\"num_hidden_layers\": 100,");
  std::ofstream(dup / "config.json") << text;
  expect_refused(
      infer("embed", dup.string(),
            "--input " + (dir_ / "in.fa").string() + " --out " + (dir_ / "d.npy").string()),
      2, "key \"num_hidden_layers\" appears twice");
}

// The header of a safetensors file and the offset of its data section.
std::pair<nlohmann::json, size_t> header_of(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  uint8_t le[8];
  f.read(reinterpret_cast<char*>(le), 8);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= uint64_t(le[i]) << (8 * i);
  std::string text(len, '\0');
  f.read(text.data(), static_cast<std::streamsize>(len));
  return {nlohmann::json::parse(text), 8 + len};
}

TEST_F(InferUntrusted, DamagedWeightFilesAreExitCode5) {
  const auto model = train("gpt");
  const std::string in = " --input " + (dir_ / "in.fa").string() + " --out ";
  // model.safetensors a directory, a link to /dev/zero, a symlink loop.
  const auto as_dir = copy_of(model, "as_dir");
  fs::remove(as_dir / "model.safetensors");
  fs::create_directories(as_dir / "model.safetensors");
  expect_refused(infer("embed", as_dir.string(), in + (dir_ / "a.npy").string()), 5,
                 "model.safetensors is a directory");
  const auto zero = copy_of(model, "zero");
  fs::remove(zero / "model.safetensors");
  fs::create_symlink("/dev/zero", zero / "model.safetensors");
  expect_refused(infer("embed", zero.string(), in + (dir_ / "b.npy").string()), 5,
                 "is not a regular file (a device)");
  const auto loop = copy_of(model, "loop");
  fs::remove(loop / "model.safetensors");
  fs::create_symlink(loop / "model.safetensors", loop / "model.safetensors");
  expect_refused(infer("embed", loop.string(), in + (dir_ / "c.npy").string()), 5,
                 "symbolic link loop");
  // A NaN weight: named, exit 5 (all-NaN embeddings and exit 0 before).
  const auto nan = copy_of(model, "nan");
  const auto [header, data] = header_of(nan / "model.safetensors");
  std::string victim;
  uint64_t offset = 0;
  for (const auto& [name, info] : header.items()) {
    if (name != "__metadata__" && info["dtype"] == "F32" &&
        info["data_offsets"][1].get<uint64_t>() > info["data_offsets"][0].get<uint64_t>()) {
      victim = name;
      offset = info["data_offsets"][0].get<uint64_t>();
      break;
    }
  }
  ASSERT_FALSE(victim.empty());
  {
    std::fstream f(nan / "model.safetensors", std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(static_cast<std::streamoff>(data + offset));
    const uint32_t qnan = 0x7fc00000u;
    f.write(reinterpret_cast<const char*>(&qnan), 4);
  }
  expect_refused(infer("embed", nan.string(), in + (dir_ / "n.npy").string()), 5,
                 "tensor " + victim + " holds NaN or infinite values");
}

// Issue 57 through the binary (the readers' cases: tests/worker/variant_io_test.cpp): a VCF
// record that is malformed is one exit-3 line naming the VCF, the line and the field, never the
// reference; a VCF without ##contig lines is scored with a warning; a stale .fai of another
// FASTA is rebuilt, so the scores are those of a fresh index. A hub fixture: no training.
TEST_F(InferUntrusted, VariantInputsAreNamedAndAStaleIndexIsNotTrusted) {
  const std::string model = kSrc + "/tests/data/hf-fixtures/gptneox_causal";
  const auto fa = (dir_ / "ref.fa").string();
  const std::string bases = "ACGTTGCAAGCTTACGGATCCATGCAAGTC";
  std::string genome;
  for (int i = 0; i < 10; ++i) genome += bases;
  const auto write_fasta = [&](const std::string& header, const std::string& text, size_t width) {
    std::ofstream out(fa);
    out << header << "\n";
    for (size_t at = 0; at < text.size(); at += width) out << text.substr(at, width) << "\n";
  };
  write_fasta(">chr1", genome, 60);
  const std::string header = "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n";
  const auto vcf = (dir_ / "v.vcf").string();
  const auto variants = [&](const std::string& records, const std::string& contigs = "") {
    std::ofstream(vcf) << "##fileformat=VCFv4.2\n" << contigs << header << records;
    return infer("variants", model, "--reference " + fa + " --vcf " + vcf + " --out -");
  };
  for (const auto& [record, field] : std::vector<std::pair<std::string, std::string>>{
           {"chr1\t100\t.\n", "3 tab-separated columns"},
           {"chr1\tabc\t.\tA\tC\t.\t.\t.\n", "POS \"abc\""},
           {"chr1\t0\t.\tA\tC\t.\t.\t.\n", "POS 0"},
           {"chr1\t-5\t.\tA\tC\t.\t.\t.\n", "POS \"-5\""},
           {"chr1\t12x\t.\tA\tC\t.\t.\t.\n", "POS \"12x\""}}) {
    expect_refused(variants(record), 3, "--vcf " + vcf + ":3: " + field);
  }
  // No ##contig line (position 31 holds A): scored, with the warning bcftools gives.
  const std::string site = "chr1\t31\t.\tA\tG\t.\t.\t.\n";
  const auto fresh = dnallm::testing::run_shell(variants(site));
  EXPECT_EQ(fresh.code, 0) << fresh.out;
  EXPECT_NE(fresh.out.find("contig \"chr1\" has no ##contig line"), std::string::npos) << fresh.out;
  const auto scores = [](const std::string& out) {  // the score's line
    const auto at = out.find("chr1\t31\t");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  // The .fai just written is that of this FASTA; another one (another header, other bases, other
  // lines) gets it, older than itself: faidx read other bytes than the record's bases (issue 57:
  // wrong scores, or the REF blamed on the VCF); now those of the other FASTA's fresh index.
  const std::string declared = "##contig=<ID=chr1>\n";
  const std::string index_of_first = read_text(fa + ".fai");
  std::string other = genome;
  other.insert(0, "GGGG");
  write_fasta(">chr1 assembly 2", other, 50);
  fs::remove(fa + ".fai");
  const auto fresh_other = dnallm::testing::run_shell(variants(site, declared));
  ASSERT_EQ(fresh_other.code, 0) << fresh_other.out;
  std::ofstream(fa + ".fai") << index_of_first;
  fs::last_write_time(fa + ".fai", fs::last_write_time(fa) - std::chrono::hours(2));
  const auto stale = dnallm::testing::run_shell(variants(site, declared));
  ASSERT_EQ(stale.code, 0) << stale.out;
  EXPECT_NE(stale.out.find("is older than the FASTA: rebuilt it"), std::string::npos) << stale.out;
  EXPECT_EQ(scores(stale.out), scores(fresh_other.out));
}

}  // namespace
