// Issue 40 through the real binaries: every Hugging Face directory of tests/data/hf-fixtures (as
// the hub ships them) runs in dnallm-eval (--logits, --fasta) and dnallm-infer (embed, predict,
// generate) with exit 0 through one loader (Note [One model loader]); the logits equal the
// reference implementation's (expected.safetensors) within 1e-4, a causal model's bits per base
// equal those computed from the reference's logits, predictions equal the reference's softmax,
// and an embedding does not depend on its batch. No LibTorch here: the files are read with
// checkpoint/safetensors.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "tests/support/process.hpp"

namespace {

namespace fs = std::filesystem;
using dnallm::testing::kBin;
using dnallm::testing::kSrc;

const std::string kFixtures = kSrc + "/tests/data/hf-fixtures";
constexpr double kTolerance = 1e-4;

// A tensor of a safetensors file as doubles (F32 or I64), with its shape.
struct Array {
  std::vector<int64_t> shape;
  std::vector<double> v;
};

std::map<std::string, Array> read_arrays(const std::string& path) {
  dnallm::checkpoint::SafetensorsReader reader(path);
  std::map<std::string, Array> out;
  for (const auto& [name, e] : reader.file().tensors) {
    Array a;
    a.shape = e.spec.shape;
    const uint64_t n = e.spec.numel();
    std::vector<char> bytes(e.data_end - e.data_begin);
    reader.read(e, bytes.data());
    a.v.resize(n);
    if (bytes.size() == n * 8) {
      for (uint64_t i = 0; i < n; ++i) {
        int64_t x = 0;
        std::memcpy(&x, bytes.data() + i * 8, 8);
        a.v[i] = double(x);
      }
    } else {
      for (uint64_t i = 0; i < n; ++i) {
        float x = 0;
        std::memcpy(&x, bytes.data() + i * 4, 4);
        a.v[i] = x;
      }
    }
    out[name] = std::move(a);
  }
  return out;
}

nlohmann::json fixture_json(const std::string& name) {
  return nlohmann::json::parse(std::ifstream(kFixtures + "/" + name + "/fixture.json"));
}

// The reference's attention mask; HyenaDNA's and Caduceus' fixtures hold none (their models
// take no mask): their hub tokenizers pad with [PAD] = 4, on the left.
Array reference_mask(const std::map<std::string, Array>& want) {
  if (want.count("attention_mask") != 0) return want.at("attention_mask");
  Array mask = want.at("input_ids");
  for (auto& v : mask.v) v = v == 4 ? 0 : 1;
  return mask;
}

bool is_causal(const std::string& name) { return name.find("causal") != std::string::npos; }
bool is_classifier(const std::string& name) { return name.find("_cls") != std::string::npos; }

// The Hugging Face directories: every fixture folder with a config.json (bert_cls_lora is a base
// and an adapter: AdapterOnItsBase).
std::vector<std::string> hub_fixtures() {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(kFixtures)) {
    if (fs::exists(e.path() / "config.json")) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The fixture's sequences, one a line (dnallm-eval --logits) and as FASTA records.
void write_inputs(const std::string& name, const std::string& dir) {
  std::ofstream lines(dir + "/seqs.txt"), fasta(dir + "/seqs.fa");
  int i = 0;
  const auto fixture = fixture_json(name);  // (a temporary's member would dangle in the loop)
  for (const auto& s : fixture.at("sequences")) {
    lines << s.get<std::string>() << "\n";
    fasta << ">s" << ++i << "\n" << s.get<std::string>() << "\n";
  }
}

dnallm::testing::CommandResult run(const std::string& cmd) {
  auto r = dnallm::testing::run_shell(cmd, dnallm::testing::Streams::kStdoutOnly);
  if (r.code != 0) r = dnallm::testing::run_shell(cmd);  // again, for its messages
  return r;
}

// Largest |a - b| over the rows' real positions (`mask` [B, T]; logits [B, T, V] or [B, C]).
double max_diff_at_real_tokens(const Array& a, const Array& b, const Array& mask) {
  EXPECT_EQ(a.shape, b.shape);
  if (a.shape != b.shape) return 1e9;
  double worst = 0;
  const bool per_token = a.shape.size() == 3;
  const int64_t per_row = per_token ? a.shape[1] * a.shape[2] : a.shape[1];
  for (int64_t r = 0; r < a.shape[0]; ++r) {
    for (int64_t j = 0; j < per_row; ++j) {
      if (per_token && mask.v[size_t(r * mask.shape[1] + j / a.shape[2])] == 0) continue;
      const size_t i = size_t(r * per_row + j);
      worst = std::max(worst, std::abs(a.v[i] - b.v[i]));
    }
  }
  return worst;
}

class PublishedModels : public ::testing::Test {
 protected:
  void SetUp() override { tmp_ = dnallm::testing::make_temp_dir("published_models"); }
  std::string tmp_;
};

TEST_F(PublishedModels, LogitsOfEveryHubDirectoryAreTheReferences) {
  const auto names = hub_fixtures();
  ASSERT_GE(names.size(), 20u);
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    write_inputs(name, tmp_);
    const std::string out = tmp_ + "/" + name + ".safetensors";
    const auto r = run(kBin + "dnallm-eval --model " + kFixtures + "/" + name + " --logits " +
                       tmp_ + "/seqs.txt --out " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto got = read_arrays(out);
    const auto want = read_arrays(kFixtures + "/" + name + "/expected.safetensors");
    EXPECT_EQ(got.at("input_ids").v, want.at("input_ids").v);
    EXPECT_EQ(got.at("attention_mask").v, reference_mask(want).v);
    // (a model without a mask computes its padded positions as the reference does: all compared)
    Array all = got.at("attention_mask");
    for (auto& v : all.v) v = 1;
    const double diff = max_diff_at_real_tokens(
        got.at("logits"), want.at("logits"),
        want.count("attention_mask") != 0 ? want.at("attention_mask") : all);
    EXPECT_LE(diff, kTolerance);
    std::cout << name << ": max |ours - reference| = " << diff << "\n";
  }
}

TEST_F(PublishedModels, AdapterOnItsBase) {
  const std::string dir = kFixtures + "/bert_cls_lora";
  write_inputs("bert_cls_lora", tmp_);
  const std::string out = tmp_ + "/lora.safetensors";
  // The adapter as --model, its base named (its adapter_config.json names none).
  const auto r = run(kBin + "dnallm-eval --model " + dir + "/adapter --base " + dir +
                     "/base --tokenizer " + dir + " --logits " + tmp_ + "/seqs.txt --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto got = read_arrays(out);
  const auto want = read_arrays(dir + "/expected.safetensors");
  EXPECT_LE(max_diff_at_real_tokens(got.at("logits"), want.at("logits"), want.at("attention_mask")),
            kTolerance);
  EXPECT_LE(max_diff_at_real_tokens(got.at("merged_logits"), want.at("merged_logits"),
                                    want.at("attention_mask")),
            kTolerance);
  // Without a base: one exit-2 line saying to give --base.
  const auto no_base =
      dnallm::testing::run_shell(kBin + "dnallm-infer embed --model " + dir + "/adapter --input " +
                                 tmp_ + "/seqs.fa --out " + tmp_ + "/e.npy");
  EXPECT_EQ(no_base.code, 2) << no_base.out;
  EXPECT_NE(no_base.out.find("--base"), std::string::npos) << no_base.out;
}

// Bits per base of a causal model from the reference's own logits: the next-token
// log-probabilities of every row without padding.
double reference_bits_per_base(const std::string& name, std::vector<std::string>* scored) {
  const auto want = read_arrays(kFixtures + "/" + name + "/expected.safetensors");
  const auto& ids = want.at("input_ids");
  const auto mask = reference_mask(want);
  const auto& logits = want.at("logits");
  const auto seqs = fixture_json(name).at("sequences");
  const int64_t t_len = ids.shape[1], vocab = logits.shape[2];
  double log_prob = 0, bases = 0;
  for (int64_t r = 0; r < ids.shape[0]; ++r) {
    bool padded = false;
    for (int64_t t = 0; t < t_len; ++t) padded |= mask.v[size_t(r * t_len + t)] == 0;
    if (padded) continue;
    scored->push_back(seqs[size_t(r)].get<std::string>());
    for (int64_t t = 1; t < t_len; ++t) {
      const int64_t id = int64_t(ids.v[size_t(r * t_len + t)]);
      // one token a base in these fixtures; the trailing [SEP] (HyenaDNA) is not a base
      if (t == t_len - 1 && name.rfind("hyenadna", 0) == 0) continue;
      const double* row = &logits.v[size_t((r * t_len + t - 1) * vocab)];
      double most = row[0];
      for (int64_t k = 1; k < vocab; ++k) most = std::max(most, row[k]);
      double sum = 0;
      for (int64_t k = 0; k < vocab; ++k) sum += std::exp(row[k] - most);
      log_prob += row[id] - most - std::log(sum);
      bases += 1;
    }
  }
  return -log_prob / std::log(2.0) / bases;
}

TEST_F(PublishedModels, GenomeScoresOfEveryLanguageModel) {
  for (const auto& name : hub_fixtures()) {
    if (is_classifier(name) || name == "hyenadna_long") continue;
    SCOPED_TRACE(name);
    std::vector<std::string> scored;
    const double want = is_causal(name) ? reference_bits_per_base(name, &scored) : 0;
    {
      std::ofstream fasta(tmp_ + "/score.fa");
      int i = 0;
      for (const auto& s :
           is_causal(name) ? scored
                           : fixture_json(name).at("sequences").get<std::vector<std::string>>()) {
        fasta << ">s" << ++i << "\n" << s << "\n";
      }
    }
    const auto r = run(kBin + "dnallm-eval --model " + kFixtures + "/" + name + " --fasta " + tmp_ +
                       "/score.fa --window 100000 --device cpu");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    const double got = j.at("bits_per_base").get<double>();
    EXPECT_TRUE(std::isfinite(got) && got > 0) << r.out;
    EXPECT_EQ(j.at("metric"), is_causal(name) ? "next_token" : "pseudo_log_likelihood");
    if (is_causal(name)) {
      EXPECT_NEAR(got, want, kTolerance) << r.out;
    } else {
      EXPECT_EQ(j.at("forward_passes").get<int64_t>(), j.at("tokens").get<int64_t>());
    }
    std::cout << name << ": " << r.out;
  }
}

TEST_F(PublishedModels, EmbeddingsOfEveryHubDirectoryDoNotDependOnTheirBatch) {
  for (const auto& name : hub_fixtures()) {
    if (name == "hyenadna_long") continue;
    SCOPED_TRACE(name);
    write_inputs(name, tmp_);
    const std::string cmd = kBin + "dnallm-infer embed --device cpu --model " + kFixtures + "/" +
                            name + " --input " + tmp_ + "/seqs.fa --log-level warn";
    const auto one = run(cmd + " --batch-size 1 --out " + tmp_ + "/one.safetensors");
    ASSERT_EQ(one.code, 0) << one.out;
    const auto all = run(cmd + " --batch-size 3 --out " + tmp_ + "/all.safetensors");
    ASSERT_EQ(all.code, 0) << all.out;
    const auto a = read_arrays(tmp_ + "/one.safetensors").at("embeddings");
    const auto b = read_arrays(tmp_ + "/all.safetensors").at("embeddings");
    ASSERT_EQ(a.shape.size(), 2u);
    EXPECT_EQ(a.shape[0], 3);
    ASSERT_EQ(a.shape, b.shape);
    double worst = 0;
    for (size_t i = 0; i < a.v.size(); ++i) worst = std::max(worst, std::abs(a.v[i] - b.v[i]));
    EXPECT_LE(worst, 1e-4);
  }
}

// The reference implementation's final hidden states (hidden.safetensors: tests/hf/
// make_hidden_states.py) against dnallm-infer embed, per token and mean-pooled, each sequence
// embedded alone: rows the reference did not pad are compared at every position; a padded row
// only where the reference masks (right padding) and not at all where its model has no mask
// (HyenaDNA, Caduceus: the left [PAD] tokens are inputs there).
TEST_F(PublishedModels, EmbeddingsAreTheReferencesHiddenStates) {
  int compared = 0;
  for (const auto& name : hub_fixtures()) {
    const std::string dir = kFixtures + "/" + name;
    if (!fs::exists(dir + "/hidden.safetensors")) continue;
    SCOPED_TRACE(name);
    write_inputs(name, tmp_);
    const auto want = read_arrays(kFixtures + "/" + name + "/expected.safetensors");
    const auto hidden = read_arrays(dir + "/hidden.safetensors").at("hidden_states");
    const bool has_mask = want.count("attention_mask") != 0;
    const auto mask = reference_mask(want);
    const std::string cmd =
        kBin + "dnallm-infer embed --device cpu --log-level warn --batch-size 1 --model " + dir +
        " --input " + tmp_ + "/seqs.fa";
    ASSERT_EQ(run(cmd + " --pooling tokens --out " + tmp_ + "/tokens.safetensors").code, 0);
    ASSERT_EQ(run(cmd + " --pooling mean --out " + tmp_ + "/mean.safetensors").code, 0);
    const auto tokens = read_arrays(tmp_ + "/tokens.safetensors");
    const auto& rows = tokens.at("embeddings");
    const auto& offsets = tokens.at("offsets");
    const auto mean = read_arrays(tmp_ + "/mean.safetensors").at("embeddings");
    const int64_t b = hidden.shape[0], t_len = hidden.shape[1], h = hidden.shape[2];
    ASSERT_EQ(rows.shape[1], h);
    double worst = 0, worst_mean = 0;
    for (int64_t r = 0; r < b; ++r) {
      int64_t real = 0, first = -1;
      for (int64_t t = 0; t < t_len; ++t) {
        if (mask.v[size_t(r * t_len + t)] != 0) {
          ++real;
          if (first < 0) first = t;
        }
      }
      if (real < t_len && !has_mask) continue;  // padded as an input: another sequence
      const auto begin = int64_t(offsets.v[size_t(r)]), end = int64_t(offsets.v[size_t(r + 1)]);
      ASSERT_EQ(end - begin, real) << "row " << r;
      for (int64_t k = 0; k < h; ++k) {
        double sum = 0;
        for (int64_t j = 0; j < real; ++j) {
          const double ref = hidden.v[size_t(((r * t_len) + first + j) * h + k)];
          worst = std::max(worst, std::abs(rows.v[size_t((begin + j) * h + k)] - ref));
          sum += ref;
        }
        worst_mean = std::max(worst_mean, std::abs(mean.v[size_t(r * h + k)] - sum / real));
      }
      ++compared;
    }
    EXPECT_LE(worst, kTolerance);
    EXPECT_LE(worst_mean, kTolerance);
    std::cout << name << ": hidden states max |ours - reference| = " << worst << " per token, "
              << worst_mean << " mean-pooled\n";
  }
  EXPECT_GE(compared, 40);
}

TEST_F(PublishedModels, PredictionsAreTheReferencesSoftmax) {
  for (const auto& name : hub_fixtures()) {
    if (!is_classifier(name)) continue;
    SCOPED_TRACE(name);
    write_inputs(name, tmp_);
    const auto r = run(kBin + "dnallm-infer predict --device cpu --log-level warn --model " +
                       kFixtures + "/" + name + " --input " + tmp_ + "/seqs.fa --out -");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto want = read_arrays(kFixtures + "/" + name + "/expected.safetensors");
    const auto& logits = want.at("logits");
    const auto mask = reference_mask(want);
    std::istringstream lines(r.out);
    std::string line;
    std::getline(lines, line);  // header
    for (int64_t row = 0; row < logits.shape[0]; ++row) {
      ASSERT_TRUE(std::getline(lines, line)) << r.out;
      bool padded = false;
      for (int64_t t = 0; t < mask.shape[1]; ++t)
        padded |= mask.v[size_t(row * mask.shape[1] + t)] == 0;
      if (padded) continue;  // the reference padded it (maybe on the left): another input
      std::vector<double> probs;
      std::istringstream cells(line);
      std::string cell;
      for (int k = 0; std::getline(cells, cell, ','); ++k) {
        if (k >= 2) probs.push_back(std::stod(cell));
      }
      const int64_t c = logits.shape[1];
      ASSERT_EQ(int64_t(probs.size()), c) << line;
      double most = -1e30, sum = 0;
      for (int64_t k = 0; k < c; ++k) most = std::max(most, logits.v[size_t(row * c + k)]);
      for (int64_t k = 0; k < c; ++k) sum += std::exp(logits.v[size_t(row * c + k)] - most);
      for (int64_t k = 0; k < c; ++k) {
        EXPECT_NEAR(probs[size_t(k)], std::exp(logits.v[size_t(row * c + k)] - most) / sum, 1e-4)
            << line;
      }
    }
  }
}

TEST_F(PublishedModels, CausalModelsGenerate) {
  for (const auto& name : hub_fixtures()) {
    if (!is_causal(name)) continue;
    SCOPED_TRACE(name);
    const auto r =
        run(kBin + "dnallm-infer generate --device cpu --log-level warn --model " + kFixtures +
            "/" + name + " --prompt ACGTACGTTAGC --max-new-tokens 5 --temperature 0 --out -");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto at = r.out.find('\n');
    ASSERT_NE(at, std::string::npos) << r.out;
    const auto bases = r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
    EXPECT_EQ(bases.substr(0, 12), "ACGTACGTTAGC") << r.out;
    EXPECT_EQ(bases.size(), 17u) << r.out;
  }
}

// The positions a fixture's config.json declares (max_position_embeddings, HyenaDNA's
// max_seq_len; Caduceus has none: 128).
int64_t declared_positions(const std::string& name) {
  const auto c = nlohmann::json::parse(std::ifstream(kFixtures + "/" + name + "/config.json"));
  for (const char* key : {"max_position_embeddings", "max_seq_len"}) {
    if (c.contains(key)) return c.at(key).get<int64_t>();
  }
  return 128;
}

// Issue 57: RoBERTa numbering (roberta_prelayernorm_mlm, esm_v1_mlm) gives the real tokens the
// positions padding_idx + 1, ..., so a table of N positions holds N - padding_idx - 1 tokens;
// embed cut to N and crashed ("index out of range in self"), as mutagenesis and dnallm-eval did
// on windows of one token a base. Every program that cuts an input to the model's positions,
// on every hub directory it accepts, with a record 40 bases past them: "ACGTN" repeated (N
// splits every k-mer and BPE merge, so a token a base or close). hyenadna_long (4200
// positions) is left out for time; hyenadna_causal is the same family.
TEST_F(PublishedModels, InputsPastThePositionsAreCutInEveryProgram) {
  for (const auto& name : hub_fixtures()) {
    if (name == "hyenadna_long") continue;
    SCOPED_TRACE(name);
    const int64_t length = declared_positions(name) + 40;
    std::string bases;
    while (static_cast<int64_t>(bases.size()) < length) bases += "ACGTN";
    std::ofstream(tmp_ + "/long.fa") << ">chr1\n" << bases << "\n";
    const int64_t pos = length / 2 - (length / 2) % 5 + 1;  // 1-based, an A
    std::ofstream(tmp_ + "/one.vcf") << "##fileformat=VCFv4.2\n##contig=<ID=chr1>\n"
                                     << "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"
                                     << "chr1\t" << pos << "\t.\tA\tG\t.\t.\t.\n";
    const std::string model = " --device cpu --log-level warn --model " + kFixtures + "/" + name;
    const std::string in = " --input " + tmp_ + "/long.fa";
    std::vector<std::string> programs = {"dnallm-infer embed" + model + in + " --out " + tmp_ +
                                         "/e.npy"};
    if (is_classifier(name)) {
      programs.push_back("dnallm-infer predict" + model + in + " --out -");
    } else {
      programs.push_back("dnallm-eval --fasta " + tmp_ + "/long.fa" + model);
      programs.push_back("dnallm-infer mutagenesis" + model + in + " --region " +
                         std::to_string(pos) + "-" + std::to_string(pos + 1) + " --out -");
      programs.push_back("dnallm-infer variants" + model + " --reference " + tmp_ +
                         "/long.fa --vcf " + tmp_ + "/one.vcf --out -");
    }
    if (is_causal(name)) {
      programs.push_back("dnallm-infer generate" + model + in +
                         " --max-new-tokens 2 --temperature 0 --out -");
    }
    for (const auto& program : programs) {
      SCOPED_TRACE(program);
      const auto r = dnallm::testing::run_shell(kBin + program);
      EXPECT_EQ(r.out.find("internal error"), std::string::npos) << r.out;
      // Overlapping k-mers (DNABERT-1's tokenizer) have no variant score: refused, exit 2.
      if (r.code == 2 && r.out.find("overlapping k-mers") != std::string::npos) continue;
      EXPECT_EQ(r.code, 0) << r.out;
    }
    fs::remove(tmp_ + "/long.fa.fai");
  }
}

// ... and training from them: model.max_seq_length may be exactly the tokens the positions hold
// (a step on full genome windows), one more is exit 2 naming the largest (the same rule,
// reserved_positions(), as the cuts above).
TEST_F(PublishedModels, FineTuningFromRobertaNumberedPositionsTakesExactlyThem) {
  const std::vector<std::tuple<std::string, std::string, int64_t>> models = {
      {"roberta_prelayernorm_mlm", " --set tokenizer.k=3", 65},
      {"esm_v1_mlm", " --set tokenizer.kind=nt --set tokenizer.k=6", 62}};
  for (const auto& [name, tokenizer, usable] : models) {
    SCOPED_TRACE(name);
    const auto train = [&, name = name, tokenizer = tokenizer](int64_t length) {
      return dnallm::testing::run_shell(
          "cd " + kSrc + " && " + kBin + "dnallm-train --config configs/dnabert-mlm.toml" +
          " --set model.init_from=" + kFixtures + "/" + name + tokenizer +
          " --set model.max_seq_length=" + std::to_string(length) +
          " --set training.max_steps=1 --set training.micro_batch_size=2" +
          " --set training.grad_accum_steps=1 --set training.eval_steps=0" +
          " --set checkpoint.save_steps=0 --set data.dataloader_num_workers=0" +
          " --set checkpoint.dir=" + tmp_ + "/ck_" + name + std::to_string(length));
    };
    const auto fits = train(usable);
    EXPECT_EQ(fits.code, 0) << fits.out;
    EXPECT_NE(fits.out.find("step 1/1 loss"), std::string::npos) << fits.out;
    const auto over = train(usable + 1);
    EXPECT_EQ(over.code, 2) << over.out;
    EXPECT_NE(over.out.find("set model.max_seq_length <= " + std::to_string(usable)),
              std::string::npos)
        << over.out;
  }
}

TEST_F(PublishedModels, ADirectoryThatIsNoModelIsOneExit2Message) {
  fs::create_directories(tmp_ + "/empty");
  std::ofstream(tmp_ + "/seqs.fa") << ">a\nACGT\n";
  for (const std::string& program :
       {"dnallm-eval --fasta " + tmp_ + "/seqs.fa",
        "dnallm-infer embed --input " + tmp_ + "/seqs.fa --out " + tmp_ + "/e.npy"}) {
    const auto r = dnallm::testing::run_shell(kBin + program + " --model " + tmp_ + "/empty");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("neither config.json nor adapter_config.json"), std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("HyenaDNA or Caduceus"), std::string::npos) << r.out;
  }
}

}  // namespace
