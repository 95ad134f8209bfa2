// Hugging Face import against golden fixtures that transformers itself wrote
// (tests/data/hf-fixtures; tests/hf/make_fixtures.py makes a fresh set): the family's own tokenizer
// ids exactly, and transformers' fp32 logits within 1e-4. Then every unsupported model or option is
// refused with exit code 2 naming the key, and dnallm-eval --logits end to end.
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/hf_fixtures.hpp"
#include "tests/support/process.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/pipeline.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/lora_linear.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/transformer/hf_export.hpp"
#include "worker/models/transformer/hf_import.hpp"
#include "worker/models/transformer/quantized_linear.hpp"

namespace dnallm::models {
namespace {

using dnallm::testing::expect_error;

namespace fs = std::filesystem;
// The committed fixtures, or DNALLM_HF_FIXTURES_DIR (tests/support/hf_fixtures.hpp).
const std::string kFixtures = dnallm::testing::hf_fixtures_dir();
constexpr double kTolerance = 1e-4;

std::vector<std::string> fixture_sequences(const std::string& family) {
  std::ifstream f(kFixtures + "/" + family + "/fixture.json");
  return nlohmann::json::parse(f).at("sequences").get<std::vector<std::string>>();
}

torch::Tensor tensor_of(const data::HfBatch& b, const std::vector<int64_t>& v) {
  return torch::tensor(v, torch::kInt64).view({b.rows, b.seq_len});
}

struct Outputs {
  torch::Tensor ids, mask, logits, merged;
};

// What our import computes for a fixture family (tokenizer files in `tokenizer_dir`).
Outputs run_family(const std::string& model_dir, const std::string& tokenizer_dir,
                   const std::string& family, const std::string& adapter_dir = "") {
  auto checkpoint = read_hf_checkpoint(model_dir);
  auto tokenizer = data::HfTokenizer::load(tokenizer_dir);
  auto batch = tokenizer.encode_batch(fixture_sequences(family));
  Outputs o;
  o.ids = tensor_of(batch, batch.input_ids);
  o.mask = tensor_of(batch, batch.attention_mask);
  ForwardInputs in;
  in.input_ids = o.ids;
  in.attention_mask = o.mask;
  torch::NoGradGuard no_grad;
  if (adapter_dir.empty()) {
    o.logits = build_hf_model(checkpoint)->forward(in).logits;
  } else {
    auto model =
        build_hf_model_with_adapter(checkpoint, read_peft_adapter(adapter_dir, checkpoint));
    o.logits = model->forward(in).logits;
    model->merge_lora();
    o.merged = model->forward(in).logits;
  }
  return o;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// A regenerated fixture set (DNALLM_HF_FIXTURES_DIR) has the Nucleotide Transformer v2
// families only when make_fixtures.py was given that remote code; the committed set has them.
#define SKIP_WITHOUT_FIXTURE(family)                                                          \
  if (!fs::exists(kFixtures + "/" + (family)) && std::getenv("DNALLM_HF_FIXTURES_DIR")) {     \
    GTEST_SKIP() << (family) << " was not made (make_fixtures.py --nt-v2-code DIR makes it)"; \
  }

void expect_matches_fixture(const std::string& family) {
  SCOPED_TRACE(family);
  const std::string dir = kFixtures + "/" + family;
  auto expected = load_safetensors(dir + "/expected.safetensors");
  auto got = run_family(dir, dir, family);
  ASSERT_TRUE(torch::equal(got.ids, expected.at("input_ids"))) << "ids\n"
                                                               << got.ids << "\nexpected\n"
                                                               << expected.at("input_ids");
  ASSERT_TRUE(torch::equal(got.mask, expected.at("attention_mask")));
  ASSERT_EQ(got.logits.sizes(), expected.at("logits").sizes());
  const double diff = max_abs_diff(got.logits, expected.at("logits"));
  std::cout << family << ": max |logit diff| vs transformers " << diff << "\n";
  EXPECT_LE(diff, kTolerance);
}

TEST(HfImportTest, BertMaskedLmDnabertKmers) { expect_matches_fixture("bert_mlm"); }
TEST(HfImportTest, BertSequenceClassification) { expect_matches_fixture("bert_cls"); }
TEST(HfImportTest, EsmMaskedLmNucleotideTransformer) { expect_matches_fixture("esm_mlm"); }
TEST(HfImportTest, EsmSequenceClassification) { expect_matches_fixture("esm_cls"); }
TEST(HfImportTest, GptNeoXCausalLm) { expect_matches_fixture("gptneox_causal"); }
TEST(HfImportTest, LlamaCausalLm) { expect_matches_fixture("llama_causal"); }
TEST(HfImportTest, LlamaGroupedQueryAttention) { expect_matches_fixture("llama_gqa_causal"); }
TEST(HfImportTest, LlamaMultiQueryAttention) { expect_matches_fixture("llama_mqa_causal"); }
// Note [Rotary variants], Note [Parallel residual]: Llama 3's rotary base; Pythia's partial
// rotary (rotary_pct 0.25) with the parallel residual.
TEST(HfImportTest, LlamaRopeTheta500k) { expect_matches_fixture("llama_rope500k_gqa_causal"); }
TEST(HfImportTest, GptNeoXPythiaPartialRotaryParallelResidual) {
  expect_matches_fixture("gptneox_pythia_causal");
}

// The two fixtures above can fail: each setting, put back to the default, moves the logits far
// past the tolerance (the import reads the settings; the fixtures depend on them).
TEST(HfImportTest, RotaryVariantFixturesDependOnTheirSettings) {
  struct Change {
    const char* family;
    const char* what;
    std::function<void(ModelOptions&)> edit;
  };
  const std::vector<Change> changes = {
      {"llama_rope500k_gqa_causal", "rope_theta 10000", [](auto& o) { o.rope_theta = 10000; }},
      {"gptneox_pythia_causal", "the whole head rotating", [](auto& o) { o.rotary_fraction = 1; }},
      {"gptneox_pythia_causal", "sequential residual",
       [](auto& o) { o.parallel_residual = false; }}};
  for (const auto& c : changes) {
    SCOPED_TRACE(std::string(c.family) + ", " + c.what);
    const std::string dir = kFixtures + "/" + c.family;
    auto checkpoint = read_hf_checkpoint(dir);
    const auto expected = load_safetensors(dir + "/expected.safetensors");
    ForwardInputs in;
    in.input_ids = expected.at("input_ids");
    in.attention_mask = expected.at("attention_mask");
    torch::NoGradGuard no_grad;
    EXPECT_LE(max_abs_diff(build_hf_model(checkpoint)->forward(in).logits, expected.at("logits")),
              kTolerance);
    c.edit(checkpoint.options);
    EXPECT_GT(max_abs_diff(build_hf_model(checkpoint)->forward(in).logits, expected.at("logits")),
              100 * kTolerance);
  }
}

// Generation with the KV cache (which keeps the shared key/value heads once) picks the same
// tokens as recomputing the whole prefix, for grouped- and multi-query Llama (also with Llama
// 3's rotary base).
TEST(HfImportTest, GroupedQueryKvCacheGenerationEqualsRecomputation) {
  for (const char* family : {"llama_gqa_causal", "llama_mqa_causal", "llama_rope500k_gqa_causal"}) {
    SCOPED_TRACE(family);
    auto model = build_hf_model(read_hf_checkpoint(kFixtures + "/" + family));
    ASSERT_LT(key_value_heads(model->options()), model->options().heads);
    auto prompt = load_safetensors(kFixtures + "/" + family + "/expected.safetensors")
                      .at("input_ids")
                      .narrow(1, 0, 6);
    GenerateOptions g;
    g.max_new_tokens = 12;
    auto cached = model->generate(prompt, g);
    g.use_cache = false;
    EXPECT_TRUE(torch::equal(cached, model->generate(prompt, g)));
  }
}

// The KV cache with a partial rotary and the parallel residual (Pythia): the cached positions'
// tables are those of their places, so each step's logits equal the whole prefix's.
TEST(HfImportTest, PythiaKvCacheGenerationEqualsRecomputation) {
  const std::string dir = kFixtures + "/gptneox_pythia_causal";
  auto model = build_hf_model(read_hf_checkpoint(dir));
  ASSERT_LT(rotary_dims(model->options()), model->options().hidden / model->options().heads);
  ASSERT_TRUE(model->options().parallel_residual);
  auto ids = load_safetensors(dir + "/expected.safetensors").at("input_ids").narrow(1, 0, 20);
  torch::NoGradGuard no_grad;
  ForwardInputs whole;
  whole.input_ids = ids;
  const auto want = model->forward(whole).logits;
  std::vector<LayerCache> cache(size_t(model->options().layers));
  int64_t past = 0;
  for (int64_t step : {6, 1, 1, 5, 7}) {  // a prompt, single tokens, then chunks
    ForwardInputs in;
    in.input_ids = ids.narrow(1, past, step);
    auto hidden = model->encode(in, &cache, past);
    auto logits = torch::linear(hidden, model->named_parameters()["lm_head.weight"]);
    EXPECT_LE(max_abs_diff(logits, want.narrow(1, past, step)), 1e-5) << "at " << past;
    past += step;
  }
  GenerateOptions g;
  g.max_new_tokens = 12;
  auto cached = model->generate(ids.narrow(1, 0, 6), g);
  g.use_cache = false;
  EXPECT_TRUE(torch::equal(cached, model->generate(ids.narrow(1, 0, 6), g)));
}

// Nucleotide Transformer v2 / AgroNT: its remote code (auto_map, Note [Remote code]) made these.
TEST(HfImportTest, NucleotideTransformerV2MaskedLm) {
  SKIP_WITHOUT_FIXTURE("esm_v2_mlm");
  expect_matches_fixture("esm_v2_mlm");
  const auto h = read_hf_checkpoint(kFixtures + "/esm_v2_mlm");
  EXPECT_TRUE(h.options.gated_mlp && !h.options.ffn_bias && !h.options.tie_embeddings);
}
TEST(HfImportTest, NucleotideTransformerV2Classification) {
  SKIP_WITHOUT_FIXTURE("esm_v2_cls");
  expect_matches_fixture("esm_v2_cls");
}
TEST(HfImportTest, NucleotideTransformerV1LearnedPositions) {
  expect_matches_fixture("esm_v1_mlm");
}

TEST(HfImportTest, RobertaPreLayerNormMaskedLm) {
  expect_matches_fixture("roberta_prelayernorm_mlm");
}

// DNABERT-2 (Note [DNABERT-2 import]): the reference's own remote code made these logits
// (tests/hf/make_fixtures.py --dnabert2-ref); its sequences run past alibi_starting_size. The
// ids are the fixture's (tokenizer.json is a BPE model). At padding positions the reference
// puts the head of a zero state, which is not part of the function: token-level logits are
// compared at real tokens. A regenerated set made without the reference has no such folder.
bool has_fixture(const std::string& family) {
  if (fs::exists(kFixtures + "/" + family)) return true;
  EXPECT_NE(kFixtures, std::string(DNALLM_HF_FIXTURES)) << family << " is missing";
  return false;
}

double dnabert2_diff(const torch::Tensor& got, const std::map<std::string, torch::Tensor>& want,
                     const std::string& key = "logits") {
  const auto& expected = want.at(key);
  if (got.dim() == 3) {
    auto real = want.at("attention_mask").to(torch::kBool);
    return max_abs_diff(got.index({real}), expected.index({real}));
  }
  return max_abs_diff(got, expected);
}

torch::Tensor dnabert2_logits(TransformerLM& model, const std::map<std::string, torch::Tensor>& e) {
  ForwardInputs in;
  in.input_ids = e.at("input_ids");
  in.attention_mask = e.at("attention_mask");
  torch::NoGradGuard no_grad;
  return model->forward(in).logits;
}

void expect_dnabert2_fixture(const std::string& family) {
  SCOPED_TRACE(family);
  if (!has_fixture(family)) GTEST_SKIP() << "no " << family << " in " << kFixtures;
  const std::string dir = kFixtures + "/" + family;
  auto expected = load_safetensors(dir + "/expected.safetensors");
  auto checkpoint = read_hf_checkpoint(dir);
  EXPECT_EQ(checkpoint.model_type, "dnabert2");
  EXPECT_TRUE(checkpoint.options.alibi);
  const auto alibi_size =
      nlohmann::json::parse(std::ifstream(dir + "/config.json")).at("alibi_starting_size");
  EXPECT_GT(expected.at("input_ids").size(1), alibi_size.get<int64_t>());
  auto model = build_hf_model(checkpoint);
  auto got = dnabert2_logits(model, expected);
  ASSERT_EQ(got.sizes(), expected.at("logits").sizes());
  const double diff = dnabert2_diff(got, expected);
  std::cout << family << ": max |logit diff| vs the reference code " << diff << "\n";
  EXPECT_LE(diff, kTolerance);
}

TEST(HfImportTest, Dnabert2MaskedLmFourHeads) { expect_dnabert2_fixture("dnabert2_mlm"); }
TEST(HfImportTest, Dnabert2SequenceClassificationSixHeads) {
  expect_dnabert2_fixture("dnabert2_cls");
}

// Note [pytorch_model.bin]: the hub repository's weights file (a torch.save pickle of the state
// dict, the decoder sharing the embeddings' storage) computes the same as model.safetensors; a
// damaged one is exit 5.
TEST(HfImportTest, Dnabert2PytorchModelBinAsShipped) {
  if (!has_fixture("dnabert2_mlm")) GTEST_SKIP();
  if (!fs::exists(kFixtures + "/dnabert2_mlm/pytorch_model.bin")) GTEST_SKIP();
  const auto dir = fs::temp_directory_path() / ("dnallm_db2_bin_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy(kFixtures + "/dnabert2_mlm", dir);
  fs::remove(dir / "model.safetensors");
  auto expected = load_safetensors(kFixtures + "/dnabert2_mlm/expected.safetensors");
  auto model = build_hf_model(read_hf_checkpoint(dir.string()));
  EXPECT_LE(dnabert2_diff(dnabert2_logits(model, expected), expected), kTolerance);
  fs::permissions(dir / "pytorch_model.bin", fs::perms::owner_write, fs::perm_options::add);
  auto expect_damaged_bin = [&](const std::string& needle) {
    expect_error([&] { read_hf_checkpoint(dir.string()); }, ExitCode::kCheckpointCorrupt, {needle});
  };
  std::ofstream(dir / "pytorch_model.bin", std::ios::trunc) << "not a pickle";
  expect_damaged_bin("not a torch.save zip archive");
  // Note [State-dict unpickler]: a pickle naming a Python callable (os.system) is refused
  // before anything is called.
  {
    fs::remove(dir / "pytorch_model.bin");
    caffe2::serialize::PyTorchStreamWriter writer((dir / "pytorch_model.bin").string());
    const std::string evil(
        "\x80\x02"
        "cos\nsystem\n"
        "q\x00"
        "X\x04\x00\x00\x00"
        "true\x85R.",
        27);
    writer.writeRecord("data.pkl", evil.data(), evil.size());
    writer.writeEndOfFile();
  }
  expect_damaged_bin("os.system");
  fs::remove_all(dir);
}

// The dnabert2_mlm fixture's inputs and reference logits (expected.safetensors), the model
// imported from it and our logits on those inputs.
struct Dnabert2Mlm {
  std::map<std::string, torch::Tensor> expected;
  TransformerLM model;
  torch::Tensor logits;
};
Dnabert2Mlm import_dnabert2_mlm() {
  const std::string dir = kFixtures + "/dnabert2_mlm";
  auto expected = load_safetensors(dir + "/expected.safetensors");
  auto model = build_hf_model(read_hf_checkpoint(dir));
  auto logits = dnabert2_logits(model, expected);
  return {std::move(expected), model, logits};
}

// Note [Scored positions only] with ALiBi: the last block computes the scored queries alone, so
// their rows of the per-query bias must be the ones picked.
TEST(HfImportTest, Dnabert2ScoredPositionsOnlyMatchTheFullLogits) {
  if (!has_fixture("dnabert2_mlm")) GTEST_SKIP();
  auto [e, model, full] = import_dnabert2_mlm();
  ForwardInputs in;
  in.input_ids = e.at("input_ids");
  in.attention_mask = e.at("attention_mask");
  in.labels = torch::full_like(in.input_ids, -100);
  const std::vector<std::pair<int64_t, int64_t>> picks = {{0, 1}, {0, 20}, {1, 3}, {1, 24}, {2, 4}};
  for (auto [r, t] : picks) in.labels[r][t] = in.input_ids[r][t];
  in.logits_for_labels_only = true;
  torch::NoGradGuard no_grad;
  auto selected = model->forward(in).logits;  // [N, vocab], row-major order of the picks
  ASSERT_EQ(selected.size(0), int64_t(picks.size()));
  for (size_t i = 0; i < picks.size(); ++i) {
    EXPECT_LE(max_abs_diff(selected[int64_t(i)], full[picks[i].first][picks[i].second]), 1e-5)
        << picks[i].first << "," << picks[i].second;
  }
}

// Note [Padding-free feed-forward]: a padded batch (the feed-forward on real tokens only) and
// each sequence alone (no padding, every row) give the same logits at real tokens.
TEST(HfImportTest, Dnabert2PaddedBatchEqualsEachSequenceAlone) {
  if (!has_fixture("dnabert2_mlm")) GTEST_SKIP();
  auto [e, model, batched] = import_dnabert2_mlm();
  const auto& ids = e.at("input_ids");
  const auto& mask = e.at("attention_mask");
  ASSERT_LT(mask.sum().item<int64_t>(), mask.numel());  // the batch is padded
  torch::NoGradGuard no_grad;
  for (int64_t r = 0; r < ids.size(0); ++r) {
    const int64_t n = mask[r].sum().item<int64_t>();
    ForwardInputs in;
    in.input_ids = ids[r].narrow(0, 0, n).unsqueeze(0);
    in.attention_mask = mask[r].narrow(0, 0, n).unsqueeze(0);
    auto alone = model->forward(in).logits[0];
    EXPECT_LE(max_abs_diff(alone, batched[r].narrow(0, 0, n)), 1e-5) << "row " << r;
  }
}

// Note [ALiBi]: the slopes by their definition (2^(-8 i / n) for a power of two; otherwise those
// of the power below, then the odd-numbered ones of twice it), against the implementation.
TEST(HfImportTest, AlibiSlopesForAnyHeadCount) {
  auto pow2 = [](int n) {
    std::vector<double> s;
    for (int i = 1; i <= n; ++i) s.push_back(std::exp2(-8.0 * i / n));
    return s;
  };
  for (int n : {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24}) {
    SCOPED_TRACE(n);
    int below = 1;
    while (below * 2 <= n) below *= 2;
    auto want = pow2(below);
    const auto twice = pow2(2 * below);
    for (size_t i = 0; int(want.size()) < n; i += 2) want.push_back(twice[i]);
    const auto got = alibi_slopes(n);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12 * want[i]);
  }
  // The bias of a long sequence is the symmetric distance times the slope, at any length.
  auto bias = alibi_bias(6, 0, 700, 700, torch::kCPU);
  const auto slopes = alibi_slopes(6);
  EXPECT_FLOAT_EQ(bias[0][5][3][650].item<float>(), float(-647 * float(slopes[5])));
  EXPECT_FLOAT_EQ(bias[0][2][699][0].item<float>(), bias[0][2][0][699].item<float>());
}

TEST(HfImportTest, PeftLoraAdapterOnItsBase) {
  const std::string dir = kFixtures + "/bert_cls_lora";
  auto expected = load_safetensors(dir + "/expected.safetensors");
  auto got = run_family(dir + "/base", dir, "bert_cls_lora", dir + "/adapter");
  ASSERT_TRUE(torch::equal(got.ids, expected.at("input_ids")));
  EXPECT_LE(max_abs_diff(got.logits, expected.at("logits")), kTolerance);
  EXPECT_LE(max_abs_diff(got.merged, expected.at("merged_logits")), kTolerance);
  // The adapter matters: without it the logits are another function.
  auto base = run_family(dir + "/base", dir, "bert_cls_lora");
  EXPECT_GT(max_abs_diff(base.logits, expected.at("logits")), kTolerance);
}

// ---------------------------------------------------------------------------------------------
// model.init_from = a Hugging Face directory (fine-tuning): [tokenizer]'s vocabulary is mapped
// onto the directory's. With the fixture's ids written in our vocabulary, the model we train
// computes the fixture's logits (the vocabulary axis mapped the same way), and our tokenizer
// (with our framing) gives the family's ids.

struct InitCase {
  const char* family;
  cfg::Arch arch;
  cfg::TokenizerKind kind;
  int k;
};

void PrintTo(const InitCase& c, std::ostream* os) { *os << c.family; }

class HfInitFromTest : public ::testing::TestWithParam<InitCase> {};

TEST_P(HfInitFromTest, OurVocabularyComputesTheFixture) {
  const auto& c = GetParam();
  SKIP_WITHOUT_FIXTURE(std::string(c.family));
  const std::string dir = kFixtures + "/" + c.family;
  Config config;
  config.model.arch = c.arch;
  config.model.task = cfg::Task::kPretrain;
  config.model.init_from = dir;
  config.model.max_seq_length = 60;
  config.tokenizer.kind = c.kind;
  config.tokenizer.k = c.k;
  config.tokenizer.stride = 1;
  auto ours = data::make_tokenizer(config);
  auto model = init_from_hf(config, *ours, BuildContext{});
  model->eval();
  const auto theirs = data::HfTokenizer::load(dir);
  const auto map = vocabulary_map(*ours, theirs, dir);
  std::map<int64_t, int64_t> back;  // their id -> ours
  for (size_t id = 0; id < map.size(); ++id) {
    if (map[id] >= 0) back[map[id]] = static_cast<int64_t>(id);
  }
  auto expected = load_safetensors(dir + "/expected.safetensors");
  auto their_ids = expected.at("input_ids");
  auto mask = expected.at("attention_mask");
  auto our_ids = torch::zeros_like(their_ids);
  for (int64_t i = 0; i < their_ids.numel(); ++i) {
    const auto t = their_ids.view(-1)[i].item<int64_t>();
    ASSERT_TRUE(back.count(t)) << "their id " << t << " has no counterpart";
    our_ids.view(-1)[i] = back[t];
  }
  // Our tokenizer with our framing gives the same tokens.
  const auto seqs = fixture_sequences(c.family);
  for (int64_t r = 0; r < their_ids.size(0); ++r) {
    std::vector<int64_t> framed;
    if (c.arch == cfg::Arch::kBert) framed.push_back(data::kClsId);
    for (auto id : ours->encode(seqs[size_t(r)])) framed.push_back(id);
    if (c.arch == cfg::Arch::kBert) framed.push_back(data::kSepId);
    std::vector<int64_t> want;
    for (int64_t t = 0; t < their_ids.size(1); ++t) {
      if (mask[r][t].item<int64_t>() == 1) want.push_back(our_ids[r][t].item<int64_t>());
    }
    EXPECT_EQ(framed, want) << "row " << r;
  }
  ForwardInputs in;
  in.input_ids = our_ids;
  in.attention_mask = mask;
  torch::NoGradGuard no_grad;
  auto got = model->forward(in).logits;
  std::vector<int64_t> cols_ours, cols_theirs;
  for (size_t id = 0; id < map.size(); ++id) {
    if (map[id] < 0) continue;
    cols_ours.push_back(static_cast<int64_t>(id));
    cols_theirs.push_back(map[id]);
  }
  auto real = mask.to(torch::kBool);
  auto a = got.index_select(-1, torch::tensor(cols_ours)).index({real});
  auto b = expected.at("logits").index_select(-1, torch::tensor(cols_theirs)).index({real});
  EXPECT_LE(max_abs_diff(a, b), kTolerance);
}

INSTANTIATE_TEST_SUITE_P(
    Families, HfInitFromTest,
    ::testing::Values(InitCase{"bert_mlm", cfg::Arch::kBert, cfg::TokenizerKind::kKmer, 3},
                      InitCase{"esm_mlm", cfg::Arch::kBert, cfg::TokenizerKind::kNt, 6},
                      InitCase{"roberta_prelayernorm_mlm", cfg::Arch::kBert,
                               cfg::TokenizerKind::kKmer, 3},
                      InitCase{"gptneox_causal", cfg::Arch::kGpt, cfg::TokenizerKind::kChar, 3},
                      InitCase{"llama_causal", cfg::Arch::kGpt, cfg::TokenizerKind::kChar, 3},
                      InitCase{"llama_gqa_causal", cfg::Arch::kGpt, cfg::TokenizerKind::kChar, 3},
                      InitCase{"esm_v2_mlm", cfg::Arch::kBert, cfg::TokenizerKind::kNt, 6},
                      InitCase{"esm_v1_mlm", cfg::Arch::kBert, cfg::TokenizerKind::kNt, 6}),
    [](const auto& info) { return std::string(info.param.family); });

// Note [Memory predicted]: a fine-tune of a Hugging Face directory is predicted from its
// config.json and weights header before anything is built, with advice that fits a shape the
// user does not choose; the same run under a limit it fits passes.
TEST(HfInitFromTest, ABaseThatCannotFitIsRefusedBeforeItIsBuilt) {
  SKIP_WITHOUT_FIXTURE("esm_v2_mlm");
  const auto config = [](double limit_gb) {
    return parse_config(fmt::format("[model]\narch = \"bert\"\nmax_seq_length = 60\n"
                                    "init_from = \"{}/esm_v2_mlm\"\n[tokenizer]\nkind = \"nt\"\n"
                                    "[training]\nmicro_batch_size = 2\nmemory_limit_gb = {}\n",
                                    kFixtures, limit_gb),
                        "hf_memory");
  };
  const auto tok = data::make_tokenizer(config(1.0));
  const BuildContext context;
  try {
    check_model_memory(config(0.0001), *tok, context);  // 100 kB
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage) << e.what();
    for (const char* needle : {"more than training.memory_limit_gb = 0.0001",
                               "the model is model.init_from", "parallel.zero_stage = 3"}) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(check_model_memory(config(1.0), *tok, context));
}

// What check_model_memory predicts for `config`, in GB (from the refusal under a tiny limit).
double predicted_gb(Config config, const data::Tokenizer& tok, const BuildContext& context) {
  config.training.memory_limit_gb = 1e-9;
  try {
    check_model_memory(config, tok, context);
  } catch (const Error& e) {
    const std::string what = e.what(), at = "needs at least ";
    const auto i = what.find(at);
    if (i != std::string::npos) return std::stod(what.substr(i + at.size()));
    ADD_FAILURE() << what;
  }
  ADD_FAILURE() << "a limit of 1 byte was accepted";
  return 0;
}

// QLoRA from a Hugging Face directory (lora.quantize_base = "nf4"): each block's base linears
// are quantized as soon as the block is filled (Note [LoRA block by block]), so the fp32 base is
// never whole; the model computes what the whole import quantized afterwards computes, bit for
// bit, and keeps no fp32 copy of a quantized weight. (The setting used to be ignored here: the
// base stayed fp32.)
TEST(HfInitFromTest, QloraQuantizesTheImportedBaseBlockByBlock) {
  SKIP_WITHOUT_FIXTURE("esm_v2_mlm");
  Config qlora =
      parse_config(fmt::format("[model]\narch = \"bert\"\nmax_seq_length = 60\n"
                               "init_from = \"{}/esm_v2_mlm\"\n[tokenizer]\nkind = \"nt\"\n"
                               "[lora]\nr = 4\nquantize_base = \"nf4\"\n",
                               kFixtures),
                   "hf_qlora");
  Config lora = qlora;
  lora.lora.quantize_base = cfg::QuantizeBase::kNone;
  const auto tok = data::make_tokenizer(qlora);
  auto streamed = init_from_hf(qlora, *tok, BuildContext{});
  auto after = init_from_hf(lora, *tok, BuildContext{});
  const auto report = quantize_linears(*after, WeightFormat::kNf4);
  ASSERT_GT(report.linears, 0);
  int64_t quantized = 0;
  for (const auto& block : streamed->blocks()) {
    for (const auto& m : block->modules()) {
      if (auto* lin = m->as<LoraLinearImpl>()) {
        EXPECT_TRUE(lin->quantized());
        EXPECT_EQ(lin->weight.numel(), 0);
        quantized += lin->quantized() ? 1 : 0;
      }
    }
  }
  EXPECT_EQ(quantized, report.linears);
  streamed->eval();
  after->eval();
  ForwardInputs in;
  in.input_ids = torch::randint(5, tok->vocab_size(), {2, 24}, torch::kLong);
  in.attention_mask = torch::ones({2, 24}, torch::kLong);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(streamed->forward(in).logits, after->forward(in).logits));
}

// Note [Memory predicted] under QLoRA: the blocks' linear weights count 4.127 bits each, on every
// rank, so a limit between the two predictions lets the quantized base through and refuses the
// fp32 one (LoRA alone), at one rank and under ZeRO-3 at 4.
TEST(HfInitFromTest, QloraIsPredictedAtFourBitsAWeight) {
  for (const int world : {1, 4}) {
    Config qlora = parse_config(
        fmt::format("[model]\narch = \"bert\"\nhidden = 256\nffn = 1024\nlayers = 4\n"
                    "max_seq_length = 64\n[training]\nmicro_batch_size = 1\n"
                    "[parallel]\nzero_stage = {}\n[lora]\nr = 4\nquantize_base = \"nf4\"\n",
                    world == 1 ? 0 : 3),
        "qlora_memory");
    Config lora = qlora;
    lora.lora.quantize_base = cfg::QuantizeBase::kNone;
    const auto tok = data::make_tokenizer(qlora);
    BuildContext context;
    context.world_size = context.local_world_size = world;
    const double q = predicted_gb(qlora, *tok, context), f = predicted_gb(lora, *tok, context);
    std::cout << "[ measured ] " << world << " rank(s): predicted " << q << " GB with QLoRA, " << f
              << " GB with LoRA\n";
    ASSERT_LT(q, f * (world == 1 ? 0.5 : 0.8));
    qlora.training.memory_limit_gb = lora.training.memory_limit_gb = (q + f) / 2;
    EXPECT_NO_THROW(check_model_memory(qlora, *tok, context));
    EXPECT_THROW(check_model_memory(lora, *tok, context), Error);
  }
}

TEST(HfInitFromTest, AnotherTokenizationIsRefused) {
  Config config;
  config.model.arch = cfg::Arch::kBert;
  config.model.init_from = kFixtures + "/esm_mlm";
  config.model.max_seq_length = 60;
  config.tokenizer.kind = cfg::TokenizerKind::kKmer;
  config.tokenizer.k = 6;
  config.tokenizer.stride = 6;
  expect_error([&] { init_from_hf(config, *data::make_tokenizer(config), BuildContext{}); },
               ExitCode::kUsage, {"tokenizer.kind = \"nt\", tokenizer.k = 6"});
}

// ---------------------------------------------------------------------------------------------
// Refusals (exit code 2, naming the key)

class HfRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = dnallm::testing::make_test_case_dir("hf_refusal");
    fs::copy(kFixtures + "/bert_mlm", dir_);
    for (auto& e : fs::directory_iterator(dir_)) {
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  void edit_config(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json c;
    {
      std::ifstream f(dir_ / "config.json");
      c = nlohmann::json::parse(f);
    }
    edit(c);
    std::ofstream(dir_ / "config.json") << c.dump(2);
  }

  // dir_ becomes a writable copy of the fixture `family`.
  void use_fixture(const std::string& family) {
    fs::remove_all(dir_);
    fs::copy(kFixtures + "/" + family, dir_);
    for (auto& e : fs::directory_iterator(dir_)) {
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    }
  }

  // Expects read_hf_checkpoint to fail with kUsage and a message holding every `needles`.
  void expect_refused(const std::vector<std::string>& needles) {
    try {
      read_hf_checkpoint(dir_.string());
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage) << e.what();
      for (const auto& n : needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  }

  fs::path dir_;
};

TEST_F(HfRefusalTest, TheUnmodifiedCopyIsAccepted) {
  EXPECT_NO_THROW(read_hf_checkpoint(dir_.string()));
}

TEST_F(HfRefusalTest, Alibi) {
  edit_config([](auto& c) { c["position_embedding_type"] = "alibi"; });
  expect_refused({"alibi", "supported"});
}

TEST_F(HfRefusalTest, RemoteCode) {
  edit_config([](auto& c) { c["auto_map"] = {{"AutoModel", "dnabert_layer.BertModel"}}; });
  expect_refused({"auto_map", "remote code"});
}

TEST_F(HfRefusalTest, UnknownConfigKey) {
  edit_config([](auto& c) { c["flash_attention_variant"] = "triton"; });
  expect_refused({"flash_attention_variant", "not understood"});
}

TEST_F(HfRefusalTest, UnsupportedArchitecture) {
  edit_config([](auto& c) { c["model_type"] = "mamba"; });
  expect_refused({"model_type = \"mamba\"", "supported are bert"});
}

TEST_F(HfRefusalTest, UnsupportedHead) {
  edit_config([](auto& c) { c["architectures"] = {"BertForTokenClassification"}; });
  expect_refused({"BertForTokenClassification", "*ForMaskedLM"});
}

TEST_F(HfRefusalTest, UnsupportedActivation) {
  edit_config([](auto& c) { c["hidden_act"] = "gelu_new"; });
  expect_refused({"hidden_act", "gelu"});
}

TEST_F(HfRefusalTest, UnusedTensor) {
  auto weights = load_safetensors((dir_ / "model.safetensors").string());
  std::vector<std::pair<std::string, torch::Tensor>> list(weights.begin(), weights.end());
  list.emplace_back("bert.encoder.layer.0.attention.self.distance_embedding.weight",
                    torch::zeros({127, 16}));
  save_safetensors((dir_ / "model.safetensors").string(), list);
  expect_refused({"distance_embedding", "not used"});
}

TEST_F(HfRefusalTest, MissingTensor) {
  auto weights = load_safetensors((dir_ / "model.safetensors").string());
  weights.erase("bert.encoder.layer.1.output.dense.weight");
  save_safetensors(
      (dir_ / "model.safetensors").string(),
      std::vector<std::pair<std::string, torch::Tensor>>(weights.begin(), weights.end()));
  expect_refused({"bert.encoder.layer.1.output.dense.weight", "lacks"});
}

TEST_F(HfRefusalTest, Dnabert2UnknownOrMissingTensor) {
  if (!has_fixture("dnabert2_mlm")) GTEST_SKIP();
  fs::remove_all(dir_);
  fs::copy(kFixtures + "/dnabert2_mlm", dir_);
  for (auto& e : fs::directory_iterator(dir_)) {
    fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  }
  EXPECT_NO_THROW(read_hf_checkpoint(dir_.string()));
  const auto path = (dir_ / "model.safetensors").string();
  const auto original = load_safetensors(path);
  auto weights = original;
  weights.emplace("bert.encoder.layer.0.mlp.gated_bias", torch::zeros({96}));
  save_safetensors(
      path, std::vector<std::pair<std::string, torch::Tensor>>(weights.begin(), weights.end()));
  expect_refused({"bert.encoder.layer.0.mlp.gated_bias", "not used"});
  weights = original;
  weights.erase("bert.encoder.layer.1.attention.self.Wqkv.weight");
  save_safetensors(
      path, std::vector<std::pair<std::string, torch::Tensor>>(weights.begin(), weights.end()));
  expect_refused({"bert.encoder.layer.1.attention.self.query.weight", "lacks"});
  // Another remote code (a module other than DNABERT-2's) stays refused.
  save_safetensors(
      path, std::vector<std::pair<std::string, torch::Tensor>>(original.begin(), original.end()));
  edit_config([](auto& c) { c["auto_map"]["AutoModel"] = "modeling_other.OtherModel"; });
  expect_refused({"\"auto_map\" has AutoModel = \"modeling_other.OtherModel\"", "remote code"});
}

// Note [Remote code]: only the Nucleotide Transformer v2's (and DNABERT-2's)
// auto_map targets are accepted.
TEST_F(HfRefusalTest, RemoteCodeOtherThanNucleotideTransformerV2) {
  SKIP_WITHOUT_FIXTURE("esm_v2_mlm");
  fs::remove_all(dir_);
  fs::copy(kFixtures + "/esm_v2_mlm", dir_);
  edit_config([](auto& c) { c["auto_map"]["AutoModel"] = "modeling_esm.EsmModel"; });
  expect_refused({"\"auto_map\" has AutoModel = \"modeling_esm.EsmModel\"", "remote code"});
  edit_config([](auto& c) {
    c["auto_map"].erase("AutoModel");
    c["auto_map"]["AutoModelForMaskedLM"] = "modeling_nt.EsmForMaskedLM";
  });
  expect_refused({"AutoModelForMaskedLM = \"modeling_nt.EsmForMaskedLM\""});
  // Without its auto_map the config.json says transformers' own ESM, which this is not.
  edit_config([](auto& c) { c.erase("auto_map"); });
  expect_refused({"add_bias_fnn", "restore auto_map"});
}

TEST_F(HfRefusalTest, KeyValueHeadsThatDoNotDivideTheHeads) {
  fs::remove_all(dir_);
  fs::copy(kFixtures + "/llama_gqa_causal", dir_);
  edit_config([](auto& c) { c["num_key_value_heads"] = 3; });
  expect_refused({"num_attention_heads 4 is not a multiple of num_key_value_heads 3"});
  edit_config([](auto& c) { c["num_key_value_heads"] = 8; });
  expect_refused({"num_key_value_heads = 8 is outside [1, 4]"});
  edit_config([](auto& c) { c["num_key_value_heads"] = 0; });
  expect_refused({"num_key_value_heads = 0 must be a positive divisor"});
}

TEST_F(HfRefusalTest, ScaledRotary) {
  fs::remove_all(dir_);
  fs::copy(kFixtures + "/llama_causal", dir_);
  edit_config([](auto& c) { c["rope_parameters"]["rope_type"] = "yarn"; });
  expect_refused({"rope_type", "default"});
  use_fixture("gptneox_pythia_causal");
  edit_config([](auto& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; });
  expect_refused({"rope_scaling", "not supported"});
}

// Note [Rotary config]: the rotary keys of other transformers versions (Pythia's and Llama 3's
// own config.json: rotary_pct, rotary_emb_base; rope_theta) and GPTNeoXConfig's defaults
// (rotary_pct 0.25, use_parallel_residual true) give the fixtures' function, as transformers
// computes it for these files (checked with transformers 5.24: the same logits).
TEST_F(HfRefusalTest, RotaryKeysOfOtherTransformersVersionsComputeTheFixture) {
  auto expect_fixture_logits = [&](const std::string& family) {
    const auto expected = load_safetensors(kFixtures + "/" + family + "/expected.safetensors");
    EXPECT_LE(max_abs_diff(run_family(dir_.string(), dir_.string(), family).logits,
                           expected.at("logits")),
              kTolerance);
  };
  use_fixture("gptneox_pythia_causal");
  edit_config([](auto& c) {  // Pythia's config.json
    c.erase("rope_parameters");
    c["rotary_pct"] = 0.25;
    c["rotary_emb_base"] = 10000;
  });
  expect_fixture_logits("gptneox_pythia_causal");
  edit_config([](auto& c) {  // nothing said: GPTNeoXConfig's defaults
    c.erase("rotary_pct");
    c.erase("rotary_emb_base");
    c.erase("use_parallel_residual");
  });
  expect_fixture_logits("gptneox_pythia_causal");
  use_fixture("llama_rope500k_gqa_causal");
  edit_config([](auto& c) {  // Llama 3's config.json
    c.erase("rope_parameters");
    c["rope_theta"] = 500000.0;
  });
  expect_fixture_logits("llama_rope500k_gqa_causal");
}

// A rotary key that disagrees with the one transformers reads, or that the model type's code
// ignores, or a share of the head that is not an even number of channels: exit 2 naming it.
TEST_F(HfRefusalTest, RotarySettingsThatDisagreeOrCannotBeComputed) {
  use_fixture("llama_rope500k_gqa_causal");
  edit_config([](auto& c) { c["rope_theta"] = 10000.0; });
  expect_refused({"rope_theta = 10000 is not supported", "llama reads the rotary base = 500000"});
  use_fixture("llama_rope500k_gqa_causal");
  edit_config([](auto& c) { c["rope_parameters"]["partial_rotary_factor"] = 0.5; });
  expect_refused({"rope_parameters.partial_rotary_factor = 0.5 is not supported",
                  "the rotating share of each head = 1"});
  use_fixture("llama_rope500k_gqa_causal");
  edit_config([](auto& c) { c["use_parallel_residual"] = true; });
  expect_refused({"use_parallel_residual", "sequential residual"});
  use_fixture("gptneox_pythia_causal");
  edit_config([](auto& c) { c["rotary_pct"] = 0.5; });
  expect_refused({"rotary_pct = 0.5 is not supported", "gpt_neox reads the rotating share"});
  use_fixture("gptneox_pythia_causal");
  edit_config([](auto& c) { c["rope_theta"] = 500000; });  // GPTNeoXConfig reads rotary_emb_base
  expect_refused(
      {"rope_theta = 500000 is not supported", "gpt_neox reads the rotary base = 10000"});
  use_fixture("gptneox_pythia_causal");
  edit_config([](auto& c) { c["rope_parameters"]["partial_rotary_factor"] = 0.3125; });
  expect_refused({"rotary positions on 5 channels of each head", "an even number of channels"});
  edit_config([](auto& c) { c["rope_parameters"]["partial_rotary_factor"] = 0; });
  expect_refused({"rotary fraction", "(0, 1]"});
  edit_config([](auto& c) { c["rope_parameters"]["partial_rotary_factor"] = "half"; });
  expect_refused({"rope_parameters.partial_rotary_factor", "is not a number"});
  use_fixture("gptneox_pythia_causal");
  edit_config([](auto& c) { c["use_parallel_residual"] = "yes"; });
  expect_refused({"a value has the wrong type"});
  use_fixture("esm_mlm");  // ESM's rotary has a fixed base
  edit_config([](auto& c) { c["rope_theta"] = 500000; });
  expect_refused({"rope_theta = 500000 is not supported", "esm reads the rotary base = 10000"});
}

// Issue 22: a downloaded directory is untrusted (Note [Model shape limits], Note [Untrusted
// files]): damaged values are refused before any allocation, in one bounded line.

TEST_F(HfRefusalTest, ZeroHeadsIsRefusedNotSigfpe) {
  edit_config([](auto& c) { c["num_attention_heads"] = 0; });
  expect_refused({"num_attention_heads = 0 is outside [1, 32]"});
}

TEST_F(HfRefusalTest, HundredThousandLayersFailFastInOneShortLine) {
  edit_config([](auto& c) { c["num_hidden_layers"] = 100000; });
  try {
    read_hf_checkpoint(dir_.string());
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find("num_hidden_layers = 100000 is outside [1, 1024]"),
              std::string::npos)
        << e.what();
    EXPECT_LT(std::string(e.what()).size(), 600u);
  }
}

TEST_F(HfRefusalTest, HugeAndNegativeSizesAreNotOutOfMemoryAdvice) {
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, int64_t>>{{"hidden_size", int64_t{1} << 35},
                                                    {"intermediate_size", int64_t{1} << 40},
                                                    {"vocab_size", -5},
                                                    {"max_position_embeddings", 0}}) {
    SCOPED_TRACE(key);
    edit_config([&](auto& c) { c[key] = value; });
    try {
      read_hf_checkpoint(dir_.string());
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find(key + " = " + std::to_string(value) + " is outside"),
                std::string::npos)
          << e.what();
      EXPECT_EQ(std::string(e.what()).find("micro_batch_size"), std::string::npos);
    }
    SetUp();
  }
}

TEST_F(HfRefusalTest, NegativeLayerNormEps) {
  edit_config([](auto& c) { c["layer_norm_eps"] = -1; });
  expect_refused({"layer_norm_eps = -1 must be a finite number in (0, 1)"});
}

TEST_F(HfRefusalTest, AValueOfTheWrongTypeIsAUsageError) {
  edit_config([](auto& c) { c["position_embedding_type"] = 7; });
  expect_refused({"config.json: a value has the wrong type"});
}

TEST_F(HfRefusalTest, DuplicatedConfigKey) {
  std::string text = dnallm::testing::read_text((dir_ / "config.json").string());
  text.insert(text.find('{') + 1, "\"num_hidden_layers\": 1,");
  std::ofstream(dir_ / "config.json") << text;
  expect_refused({"key \"num_hidden_layers\" appears twice"});
}

TEST_F(HfRefusalTest, ConfigJsonLinkedToDevZero) {
  fs::remove(dir_ / "config.json");
  fs::create_symlink("/dev/zero", dir_ / "config.json");
  expect_refused({"is not a regular file (a device)"});
}

// Damaged weights: exit code 5 (a damaged file), naming the file or the tensor: a file that
// cannot be opened when the directory is read, a damaged tensor when it is (Note [Lazy Hugging
// Face import]: when the model is built).
void expect_damaged(const fs::path& dir, const std::string& needle) {
  expect_error([&] { build_hf_model(read_hf_checkpoint(dir.string())); },
               ExitCode::kCheckpointCorrupt, {needle});
}

TEST_F(HfRefusalTest, WeightsFileThatIsNotARegularFile) {
  const auto weights = dir_ / "model.safetensors";
  fs::remove(weights);
  fs::create_directories(weights);
  expect_damaged(dir_, "model.safetensors is a directory");
  fs::remove(weights);
  fs::create_symlink("/dev/zero", weights);
  expect_damaged(dir_, "is not a regular file (a device)");
  fs::remove(weights);
  fs::create_symlink(weights, weights);
  expect_damaged(dir_, "symbolic link loop");
}

TEST_F(HfRefusalTest, NanOrInfiniteWeights) {
  auto weights = load_safetensors((dir_ / "model.safetensors").string());
  weights.at("bert.encoder.layer.0.output.dense.weight")[0][0] =
      std::numeric_limits<float>::infinity();
  save_safetensors(
      (dir_ / "model.safetensors").string(),
      std::vector<std::pair<std::string, torch::Tensor>>(weights.begin(), weights.end()));
  expect_damaged(dir_, "tensor bert.encoder.layer.0.output.dense.weight holds NaN or infinite");
}

// ---------------------------------------------------------------------------------------------
// Export: each of our model kinds written in a transformers layout and imported again through
// the path the fixtures validate must compute our logits (at real tokens; padding positions
// are not part of the function) and the tokenizer must give our pipeline's ids.

// Where an export goes: DNALLM_HF_EXPORT_KEEP=DIR keeps it as DIR/<name> for
// tests/hf/check_export.py (CTest hf_check_export loads every kept export with transformers);
// otherwise a temporary directory, removed with this object.
class ExportDir {
 public:
  explicit ExportDir(const std::string& name) {
    const char* keep = std::getenv("DNALLM_HF_EXPORT_KEEP");
    keep_ = keep != nullptr && *keep != '\0';
    path_ = keep_ ? fs::path(keep) / name
                  : fs::temp_directory_path() /
                        ("dnallm_hf_export_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(path_);
  }
  ~ExportDir() {
    std::error_code ec;
    if (!keep_) fs::remove_all(path_, ec);
  }
  ExportDir(const ExportDir&) = delete;
  ExportDir& operator=(const ExportDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
  bool keep_ = false;
};

struct ExportCase {
  const char* name;
  Arch arch;
  Task task;
  bool rotary;
  const char* tokenizer;  // "char" | "kmer3" | "nt6"
  int64_t lora_r;
  const char* model_type;
  bool dnabert2 = false;  // ALiBi, post-LN, GEGLU (configs/dnabert2-*.toml)
};

void PrintTo(const ExportCase& c, std::ostream* os) { *os << c.name; }

class HfExportTest : public ::testing::TestWithParam<ExportCase> {};

TEST_P(HfExportTest, ReimportComputesOurLogits) {
  const auto& c = GetParam();
  const std::string kind = c.tokenizer;
  auto tok = kind == "char"  ? data::make_char_tokenizer()
             : kind == "nt6" ? data::make_nt_tokenizer(6)
                             : data::make_kmer_tokenizer(3, 1);

  ModelOptions o;
  o.arch = c.arch;
  o.task = c.task;
  o.vocab_size = tok->vocab_size();
  o.hidden = 32;
  o.layers = 2;
  o.heads = 2;
  o.ffn = 64;
  o.max_seq_length = 64;
  o.rotary = c.rotary;
  o.num_labels = c.task == Task::kRegression ? 1 : 3;
  if (c.dnabert2) {
    o.alibi = true;
    o.post_layer_norm = o.embedding_layer_norm = o.gated_mlp = true;
    o.gate_activation = ModelOptions::GateActivation::kGelu;
    o.ffn_in_bias = false;
    o.heads = 4;
    o.max_seq_length = 16;  // shorter than the sequences: ALiBi has no length limit
  }
  torch::manual_seed(7);
  TransformerLM model(o);
  {
    torch::NoGradGuard no_grad;  // non-trivial norms and biases, so a wrong mapping shows
    for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  if (c.lora_r > 0) {
    model->enable_lora(c.lora_r);
    torch::NoGradGuard no_grad;
    for (const auto& item : model->named_parameters()) {
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.1);
    }
  }
  model->eval();
  const ExportDir out(c.name);
  const auto& dir = out.path();
  ASSERT_TRUE(export_hf_transformer(model, *tok, dir.string()));

  // Our pipeline's ids: [CLS] tokens [SEP] (encoders) or [CLS] tokens (causal).
  const auto seqs = fixture_sequences("bert_mlm");
  auto hf_tok = data::HfTokenizer::load(dir.string());
  auto batch = hf_tok.encode_batch(seqs);
  for (int64_t r = 0; r < batch.rows; ++r) {
    std::vector<int64_t> ours = {data::kClsId};
    for (auto id : tok->encode(seqs[size_t(r)])) ours.push_back(id);
    if (c.arch == Arch::kBert) ours.push_back(data::kSepId);
    std::vector<int64_t> theirs;
    for (int64_t i = 0; i < batch.seq_len; ++i) {
      if (batch.attention_mask[size_t(r * batch.seq_len + i)] == 1) {
        theirs.push_back(batch.input_ids[size_t(r * batch.seq_len + i)]);
      }
    }
    EXPECT_EQ(theirs, ours) << "row " << r;
  }
  ForwardInputs in;
  in.input_ids = tensor_of(batch, batch.input_ids);
  in.attention_mask = tensor_of(batch, batch.attention_mask);
  torch::NoGradGuard no_grad;
  auto expected = model->forward(in).logits;
  auto checkpoint = read_hf_checkpoint(dir.string());
  EXPECT_EQ(checkpoint.model_type, c.model_type);
  auto real = in.attention_mask.to(torch::kBool);
  auto compare = [&](TransformerLM& reimported, const char* what) {
    auto got = reimported->forward(in).logits;
    if (c.task == Task::kPretrain) {
      EXPECT_LE(max_abs_diff(got.index({real}), expected.index({real})), 1e-5) << what;
    } else {
      EXPECT_LE(max_abs_diff(got.reshape({-1}), expected.reshape({-1})), 1e-5) << what;
    }
  };
  auto merged = build_hf_model(checkpoint);
  compare(merged, "merged export");
  if (c.lora_r > 0 && c.dnabert2) {
    // PEFT would target DNABERT-2's fused Wqkv: only the merged model is exported.
    EXPECT_FALSE(fs::exists(dir / "adapter"));
  } else if (c.lora_r > 0) {
    auto base = read_hf_checkpoint((dir / "base").string());
    auto adapted =
        build_hf_model_with_adapter(base, read_peft_adapter((dir / "adapter").string(), base));
    compare(adapted, "PEFT adapter on its base");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, HfExportTest,
    ::testing::Values(
        ExportCase{"bert_rotary_mlm", Arch::kBert, Task::kPretrain, true, "kmer3", 0, "esm"},
        ExportCase{"bert_learned_mlm", Arch::kBert, Task::kPretrain, false, "char", 0, "esm"},
        ExportCase{"bert_nt_mlm", Arch::kBert, Task::kPretrain, true, "nt6", 0, "esm"},
        ExportCase{"bert_cls", Arch::kBert, Task::kClassification, false, "kmer3", 0, "esm"},
        ExportCase{"bert_regression", Arch::kBert, Task::kRegression, true, "char", 0, "esm"},
        ExportCase{"bert_cls_lora", Arch::kBert, Task::kClassification, false, "kmer3", 4, "esm"},
        ExportCase{"gpt_rotary", Arch::kGpt, Task::kPretrain, true, "char", 0, "gpt_neox"},
        ExportCase{"dnabert2_mlm", Arch::kBert, Task::kPretrain, false, "char", 0, "dnabert2",
                   true},
        ExportCase{"dnabert2_cls_lora", Arch::kBert, Task::kClassification, false, "kmer3", 4,
                   "dnabert2", true}),
    [](const auto& info) { return std::string(info.param.name); });

// Every fixture family imported and exported again: the model type it came as, computing the
// fixture's logits (ids exactly). DNABERT-style vocabularies are our 3-mer tokenizer's, which
// goes out as tokenizer.json; the others keep the family's own tokenizer files.
struct ReexportCase {
  const char* family;
  const char* model_type;
  bool our_kmer_tokenizer;  // else the fixture's tokenizer files are copied next to the model
};

void PrintTo(const ReexportCase& c, std::ostream* os) { *os << c.family; }

class HfReexportTest : public ::testing::TestWithParam<ReexportCase> {};

TEST_P(HfReexportTest, ImportedFamilyExportsAsItself) {
  const auto& c = GetParam();
  const std::string family = c.family;
  SKIP_WITHOUT_FIXTURE(family);
  const std::string src = kFixtures + "/" + family;
  if (!has_fixture(family)) GTEST_SKIP();
  const bool lora = fs::exists(src + "/adapter");
  const auto checkpoint = read_hf_checkpoint(lora ? src + "/base" : src);
  auto model = lora ? build_hf_model_with_adapter(checkpoint,
                                                  read_peft_adapter(src + "/adapter", checkpoint))
                    : build_hf_model(checkpoint);
  model->eval();
  const ExportDir out(family + "_reexport");
  const std::string dir = out.str();
  if (c.our_kmer_tokenizer) {
    ASSERT_TRUE(export_hf_transformer(model, *data::make_kmer_tokenizer(3, 1), dir));
  } else {
    ASSERT_FALSE(lora);  // export_hf_directory would write the base's tokenizer too
    EXPECT_EQ(export_hf_model(model, dir), c.model_type);
    for (const char* f : {"vocab.txt", "tokenizer.json", "tokenizer_config.json"}) {
      if (fs::exists(src + "/" + f)) fs::copy_file(src + "/" + f, dir + "/" + f);
    }
  }
  EXPECT_EQ(read_hf_checkpoint(dir).model_type, c.model_type);
  if (!lora) {  // the remote code's layout and config.json keys (Note [Remote code]), as shipped
    const auto theirs = nlohmann::json::parse(std::ifstream(src + "/config.json"));
    const auto ours = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    auto auto_map = ours.value("auto_map", nlohmann::json());
    if (std::string(c.model_type) == "dnabert2") {
      // Exported without the source's code: its classes named in the hub repository
      // (Note [DNABERT-2 export]), the same classes as the fixture's local ones.
      for (auto& [key, value] : auto_map.items()) {
        const std::string prefix = "zhihan1996/DNABERT-2-117M--";
        ASSERT_EQ(value.get<std::string>().rfind(prefix, 0), 0u) << value;
        value = value.get<std::string>().substr(prefix.size());
      }
    }
    EXPECT_EQ(auto_map, theirs.value("auto_map", nlohmann::json()));
    EXPECT_EQ(ours.contains("add_bias_fnn"), theirs.contains("add_bias_fnn"));
    if (theirs.contains("auto_map")) {
      std::set<std::string> a, b;
      for (const auto& [name, t] : load_safetensors(src + "/model.safetensors")) a.insert(name);
      for (const auto& [name, t] : load_safetensors(dir + "/model.safetensors")) b.insert(name);
      EXPECT_EQ(a, b);
    }
  }
  auto expected = load_safetensors(src + "/expected.safetensors");
  if (std::string(c.model_type) == "dnabert2") {  // (its ids: the fixture's)
    auto reimported = build_hf_model(read_hf_checkpoint(dir));
    EXPECT_LE(dnabert2_diff(dnabert2_logits(reimported, expected), expected), kTolerance);
    return;
  }
  auto got = run_family(dir, dir, family);  // LoRA merged into the exported model
  EXPECT_TRUE(torch::equal(got.ids, expected.at("input_ids")));
  EXPECT_LE(max_abs_diff(got.logits, expected.at(lora ? "merged_logits" : "logits")), kTolerance);
  if (lora) {
    EXPECT_EQ(read_hf_checkpoint(dir + "/base").model_type, c.model_type);
    auto adapted = run_family(dir + "/base", dir, family, dir + "/adapter");
    EXPECT_LE(max_abs_diff(adapted.logits, expected.at("logits")), kTolerance);
    EXPECT_LE(max_abs_diff(adapted.merged, expected.at("merged_logits")), kTolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, HfReexportTest,
    ::testing::Values(ReexportCase{"bert_mlm", "bert", true},
                      ReexportCase{"bert_cls", "bert", true}, ReexportCase{"esm_mlm", "esm", false},
                      ReexportCase{"esm_cls", "esm", false},
                      ReexportCase{"gptneox_causal", "gpt_neox", false},
                      ReexportCase{"llama_causal", "llama", false},
                      ReexportCase{"llama_gqa_causal", "llama", false},
                      ReexportCase{"llama_mqa_causal", "llama", false},
                      ReexportCase{"llama_rope500k_gqa_causal", "llama", false},
                      ReexportCase{"gptneox_pythia_causal", "gpt_neox", false},
                      ReexportCase{"esm_v2_mlm", "esm", false},
                      ReexportCase{"esm_v2_cls", "esm", false},
                      ReexportCase{"roberta_prelayernorm_mlm", "roberta-prelayernorm", true},
                      ReexportCase{"bert_cls_lora", "bert", true},
                      ReexportCase{"dnabert2_mlm", "dnabert2", false},
                      ReexportCase{"dnabert2_cls", "dnabert2", false}),
    [](const auto& info) { return std::string(info.param.family); });

// Note [DNABERT-2 export]: from a directory with DNABERT-2's code the export copies the files
// and names them locally, keeping the source's config keys; without them auto_map names the
// hub repository's.
TEST(HfExportTest, Dnabert2RemoteCodeComesFromTheSourceDirectory) {
  if (!has_fixture("dnabert2_mlm")) GTEST_SKIP();
  const auto src = fs::temp_directory_path() / ("dnallm_db2_src_" + std::to_string(::getpid()));
  fs::remove_all(src);
  fs::copy(kFixtures + "/dnabert2_mlm", src);
  auto model = build_hf_model(read_hf_checkpoint(src.string()));
  auto config_of = [](const fs::path& d) {
    return nlohmann::json::parse(std::ifstream(d / "config.json"));
  };
  // (Not kept for check_export.py: these hold no tokenizer.)
  const fs::path bare = src.string() + "_no_code", with_code = src.string() + "_with_code";
  fs::remove_all(bare);
  fs::remove_all(with_code);
  export_hf_model(model, bare.string(), src.string());
  EXPECT_EQ(config_of(bare).at("auto_map").at("AutoModelForMaskedLM"),
            "zhihan1996/DNABERT-2-117M--bert_layers.BertForMaskedLM");
  EXPECT_FALSE(fs::exists(bare / "bert_layers.py"));
  // The source's own keys stay (its alibi_starting_size, _name_or_path).
  EXPECT_EQ(config_of(bare).at("alibi_starting_size"), config_of(src).at("alibi_starting_size"));
  for (const char* f :
       {"bert_layers.py", "bert_padding.py", "configuration_bert.py", "flash_attn_triton.py"}) {
    std::ofstream(src / f) << "# stand-in for " << f << "\n";
  }
  export_hf_model(model, with_code.string(), src.string());
  EXPECT_EQ(config_of(with_code).at("auto_map").at("AutoModelForMaskedLM"),
            "bert_layers.BertForMaskedLM");
  EXPECT_EQ(dnallm::testing::read_text((with_code / "bert_layers.py").string()),
            "# stand-in for bert_layers.py\n");
  fs::remove_all(src);
  fs::remove_all(bare);
  fs::remove_all(with_code);
}

// Note [Rotary variants], Note [Parallel residual]: the export writes the settings back in the
// keys transformers reads (the reimport above computes the fixtures' logits with them), and our
// own model directory (config.json: rope_theta, rotary_fraction, parallel_residual) keeps them.
TEST(HfExportTest, RotaryVariantsRoundTrip) {
  struct Want {
    const char* family;
    const char* key;
    nlohmann::json value;
  };
  for (const auto& w :
       std::vector<Want>{{"llama_rope500k_gqa_causal", "rope_theta", 500000.0},
                         {"gptneox_pythia_causal", "rotary_pct", 0.25},
                         {"gptneox_pythia_causal", "use_parallel_residual", true}}) {
    SCOPED_TRACE(std::string(w.family) + " " + w.key);
    auto model = build_hf_model(read_hf_checkpoint(kFixtures + "/" + w.family));
    const auto dir = fs::temp_directory_path() /
                     ("dnallm_hf_rotary_" + std::to_string(::getpid()) + "_" + w.family);
    fs::remove_all(dir);
    export_hf_model(model, (dir / "hf").string());
    const auto config = nlohmann::json::parse(std::ifstream(dir / "hf" / "config.json"));
    EXPECT_EQ(config.at(w.key), w.value);
    if (std::string(w.family) == "gptneox_pythia_causal") {
      EXPECT_EQ(config.at("rope_parameters").at("partial_rotary_factor"), 0.25);
    }
    // Ours: the same options and bit-identical logits after our own export and load.
    export_live_model(as_language_model(model), (dir / "ours").string());
    auto again = load_exported_model((dir / "ours").string());
    EXPECT_EQ(again->export_config(), model->export_config());
    const auto expected = load_safetensors(kFixtures + "/" + w.family + "/expected.safetensors");
    ForwardInputs in;
    in.input_ids = expected.at("input_ids");
    in.attention_mask = expected.at("attention_mask");
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(again->forward(in).logits, model->forward(in).logits));
    fs::remove_all(dir);
  }
  // The defaults write none of these keys: other models' config.json stay as they were.
  auto plain = build_hf_model(read_hf_checkpoint(kFixtures + "/llama_gqa_causal"));
  const auto ours = plain->export_config();
  for (const char* key : {"rope_theta", "rotary_fraction", "parallel_residual"}) {
    EXPECT_FALSE(ours.contains(key)) << key;
  }
}

// A rotary setting the target model type cannot say is refused (exit 2, saying which), never
// exported as another model; export_hf_directory then skips the export.
TEST(HfExportTest, RotaryVariantsWithoutATransformersEquivalentAreRefused) {
  const auto dir = fs::temp_directory_path() / ("dnallm_hf_skip_rot_" + std::to_string(::getpid()));
  auto refused = [&](const char* family, const std::function<void(ModelOptions&)>& edit,
                     const std::string& needle) {
    SCOPED_TRACE(needle);
    auto checkpoint = read_hf_checkpoint(kFixtures + "/" + family);
    edit(checkpoint.options);
    auto model = build_hf_model(checkpoint);
    expect_error([&] { export_hf_model(model, dir.string()); }, ExitCode::kUsage, {needle});
    EXPECT_FALSE(export_hf_transformer(model, *data::make_char_tokenizer(), dir.string()));
    EXPECT_FALSE(fs::exists(dir));
  };
  refused(
      "llama_causal", [](auto& o) { o.rotary_fraction = 0.5; },
      "a partial rotary (0.5 of each head) exports only as gpt_neox");
  refused(
      "llama_causal", [](auto& o) { o.parallel_residual = true; },
      "the parallel residual exports only as gpt_neox");
  refused(
      "esm_mlm", [](auto& o) { o.rope_theta = 500000; },
      "a rotary base (rope_theta) of 500000 exports only as gpt_neox or llama");
}

TEST(HfExportTest, NoTransformersEquivalentIsSkippedNotWrong) {
  ModelOptions o;
  o.arch = Arch::kGpt;
  o.rotary = false;  // GPT with learned positions: no faithful model type
  o.vocab_size = 10;
  o.hidden = 16;
  o.layers = 1;
  o.heads = 2;
  o.ffn = 32;
  o.max_seq_length = 16;
  TransformerLM model(o);
  const auto dir = fs::temp_directory_path() / ("dnallm_hf_skip_" + std::to_string(::getpid()));
  EXPECT_FALSE(export_hf_transformer(model, *data::make_char_tokenizer(), dir.string()));
  EXPECT_FALSE(fs::exists(dir));
  // Grouped-query attention without Llama's norms and MLP: gpt_neox has no
  // num_key_value_heads.
  o.rotary = true;
  o.kv_heads = 1;
  TransformerLM grouped(o);
  EXPECT_FALSE(export_hf_transformer(grouped, *data::make_char_tokenizer(), dir.string()));
  EXPECT_FALSE(fs::exists(dir));
}

// ---------------------------------------------------------------------------------------------
// dnallm-eval --logits (the interface both directions use), end to end.

// The exit code of `command`; what it printed goes to the test's log when it fails.
int run(const std::string& command) {
  const auto r = dnallm::testing::run_shell(command);
  if (r.code != 0) std::cerr << command << "\n" << r.out;
  return r.code;
}

TEST(HfEvalCliTest, LogitsFileMatchesTheFixture) {
  const auto tmp = fs::temp_directory_path() / ("dnallm_hf_cli_" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  {
    std::ofstream seqs(tmp / "seqs.txt");
    for (const auto& s : fixture_sequences("esm_mlm")) seqs << s << "\n";
  }
  const std::string out = (tmp / "out.safetensors").string();
  ASSERT_EQ(run(std::string(DNALLM_EVAL_BIN) + " --model " + kFixtures + "/esm_mlm --logits " +
                (tmp / "seqs.txt").string() + " --out " + out + " > /dev/null"),
            0);
  auto got = load_safetensors(out);
  auto expected = load_safetensors(kFixtures + "/esm_mlm/expected.safetensors");
  EXPECT_TRUE(torch::equal(got.at("input_ids"), expected.at("input_ids")));
  EXPECT_TRUE(torch::equal(got.at("attention_mask"), expected.at("attention_mask")));
  EXPECT_LE(max_abs_diff(got.at("logits"), expected.at("logits")), kTolerance);
  // A refused model (ALiBi) exits 2.
  const auto alibi = tmp / "alibi";
  fs::copy(kFixtures + "/bert_mlm", alibi);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(alibi / "config.json"));
  config["position_embedding_type"] = "alibi";
  fs::permissions(alibi / "config.json", fs::perms::owner_write, fs::perm_options::add);
  std::ofstream(alibi / "config.json") << config.dump();
  EXPECT_EQ(run(std::string(DNALLM_EVAL_BIN) + " --model " + alibi.string() + " --logits " +
                (tmp / "seqs.txt").string() + " --out " + out + " 2> /dev/null"),
            2);
  // Issue 22: a sequence beyond a rotary model's positions is bad data (exit 3), refused before
  // the forward pass (it allocated gigabytes before), like one beyond learned positions.
  std::ofstream(tmp / "long.txt") << "ACGT\n" << std::string(100000, 'A') << "\n";
  for (const char* family : {"esm_mlm", "gptneox_causal", "bert_mlm"}) {
    const auto r = dnallm::testing::run_shell(std::string(DNALLM_EVAL_BIN) + " --model " +
                                              kFixtures + "/" + family + " --logits " +
                                              (tmp / "long.txt").string() + " --out " + out);
    EXPECT_EQ(r.code, 3) << family << "\n" << r.out;
    EXPECT_NE(r.out.find("sequence 2 (100000 bases)"), std::string::npos) << r.out;
  }
  fs::remove_all(tmp);
}

}  // namespace
}  // namespace dnallm::models
