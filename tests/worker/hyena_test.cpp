// HyenaDNA (worker/models/hyena): the long convolution against a direct convolution, causality,
// the import of the Hugging Face layout against logits of LongSafari's hub code
// (tests/data/hf-fixtures/hyenadna_*, tests/hf/make_hyena_fixtures.py) and one-line refusals
// of damaged directories.
#include "worker/models/hyena/hyena.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "tests/support/hf_fixtures.hpp"
#include "tests/support/kept_export.hpp"
#include "tests/worker/reference_logits.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::models::hyena {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return dnallm::testing::hf_fixture(name); }

// The HyenaDNA tokenizer's ids (characters A C G T N -> 7..11, others [UNK] 6, [SEP] 1
// appended, [PAD] 4 on the left), written here from the hub tokenizer's definition.
std::vector<std::vector<int64_t>> hyena_ids(const std::vector<std::string>& seqs) {
  size_t longest = 0;
  for (const auto& s : seqs) longest = std::max(longest, s.size() + 1);
  std::vector<std::vector<int64_t>> out;
  for (const auto& s : seqs) {
    std::vector<int64_t> row(longest - s.size() - 1, 4);
    for (char c : s) {
      const auto at = std::string("ACGTN").find(c);
      row.push_back(at == std::string::npos ? 6 : 7 + int64_t(at));
    }
    row.push_back(1);
    out.push_back(row);
  }
  return out;
}

TEST(Hyena, FftConvolutionIsTheCausalDirectConvolution) {
  torch::manual_seed(1);
  const int64_t B = 2, D = 3, L = 37;
  auto u = torch::randn({B, D, L}, torch::kFloat64);
  auto k = torch::randn({D, L}, torch::kFloat64);
  auto bias = torch::randn({D}, torch::kFloat64);
  auto direct = torch::zeros({B, D, L}, torch::kFloat64);
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t s = 0; s <= t; ++s) direct.select(2, t) += u.select(2, s) * k.select(1, t - s);
  }
  direct += u * bias.view({1, D, 1});
  auto fft = fft_long_conv(u.to(torch::kFloat32), k.to(torch::kFloat32), bias.to(torch::kFloat32));
  EXPECT_LT((fft.to(torch::kFloat64) - direct).abs().max().item<double>(), 1e-4);
}

TEST(Hyena, OutputsDependOnlyOnEarlierTokens) {
  HyenaOptions o;
  o.d_model = 16, o.d_inner = 32, o.n_layer = 2, o.max_seq_len = 64, o.filter_order = 8;
  torch::manual_seed(2);
  HyenaLM model(o);
  model->eval();
  torch::NoGradGuard no_grad;
  auto ids = torch::randint(7, 12, {1, 40});
  auto changed = ids.clone();
  changed.index_put_({0, torch::indexing::Slice(25, torch::indexing::None)}, 7);
  auto a = model->forward(ids), b = model->forward(changed);
  EXPECT_TRUE(torch::allclose(a.slice(1, 0, 25), b.slice(1, 0, 25), 0, 1e-6));
  EXPECT_FALSE(torch::allclose(a.slice(1, 25), b.slice(1, 25), 0, 1e-6));
}

TEST(Hyena, ActivationCheckpointingGivesTheSameGradients) {
  HyenaOptions o;
  o.d_model = 16, o.d_inner = 32, o.n_layer = 3, o.max_seq_len = 64, o.filter_order = 8;
  auto grads = [&](bool checkpoint) {
    o.gradient_checkpointing = checkpoint;
    torch::manual_seed(3);
    HyenaLM model(o);
    model->train();
    auto ids = torch::randint(7, 12, {2, 50}, torch::TensorOptions().dtype(torch::kLong));
    model->forward(ids).pow(2).mean().backward();
    std::vector<torch::Tensor> out;
    for (auto& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto plain = grads(false), checkpointed = grads(true);
  ASSERT_EQ(plain.size(), checkpointed.size());
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], checkpointed[i])) << i;
}

// Note [Hyena chunked block]: pieces that divide nothing (300 positions by 37, 16 channels by 5)
// and a trained positional feature (the filter MLP read from an offset): the logits and every
// gradient of the plain block, with and without gradients recorded.
TEST(Hyena, ChunkedBlocksGiveThePlainOutputsAndGradients) {
  HyenaOptions o;
  o.d_model = 16, o.d_inner = 40, o.n_layer = 2, o.max_seq_len = 320, o.filter_order = 8;
  auto run = [&](bool checkpoint, HyenaChunking chunking) {
    o.gradient_checkpointing = checkpoint;
    o.chunking = chunking;
    torch::manual_seed(4);
    HyenaLM model(o);
    const auto z = positional_features(o, o.max_seq_len, torch::kCPU).first;
    model->blocks[1]->mixer->filter_fn->stored_z = z + 0.01 * torch::randn_like(z);
    auto ids = torch::randint(7, 12, {2, 300}, torch::TensorOptions().dtype(torch::kLong));
    model->train();
    auto logits = model->forward(ids);
    (logits.pow(2).mean() + logits.slice(1, 290).sum()).backward();
    std::vector<torch::Tensor> out{logits.detach()};
    for (auto& p : model->parameters()) out.push_back(p.grad().clone());
    torch::NoGradGuard no_grad;
    model->eval();
    out.push_back(model->forward(ids));
    return out;
  };
  const auto plain = run(false, {});
  double worst = 0;
  for (const auto& chunked : {run(true, {37, 5}), run(true, {0, 5}), run(true, {64, 0})}) {
    ASSERT_EQ(plain.size(), chunked.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      const double scale = plain[i].abs().max().item<double>();
      const double diff = (plain[i] - chunked[i]).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5 * (1 + scale)) << "tensor " << i << " of " << plain.size();
      EXPECT_GT(scale, 0) << i;
      worst = std::max(worst, diff / (1 + scale));
    }
  }
  std::cout << "chunked vs plain: max |difference| / (1 + max |plain|) = " << worst << "\n";
}

// Note [Hyena fused mixer]: the CPU operator against the plain form (short filter by Conv1d, FFT
// convolution by autograd) on the same parameters: the output and the gradients of the input and
// of every parameter, in double (to 1e-12: the same arithmetic) and in float (to 1e-5), with two
// sequences, an odd length and a width that is not a multiple of the vector width.
TEST(Hyena, FusedMixerGivesThePlainOutputAndGradients) {
  for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
    SCOPED_TRACE(c10::toString(dtype));
    HyenaOptions o;
    o.d_model = 20, o.max_seq_len = 160, o.filter_order = 8;
    torch::manual_seed(6);
    HyenaOperator op(o);
    op->to(dtype);
    const auto [z, t] = positional_features(o, 151, torch::kCPU);
    const auto x = torch::randn({2, 151, o.d_model}, dtype);
    const auto weight = torch::randn({2, 151, o.d_model}, dtype);  // a loss that weighs each value
    auto run = [&](bool fused) {
      op->fused = fused;
      op->zero_grad();
      auto xi = x.clone().requires_grad_(true);
      auto out = op->forward(xi, z.to(dtype), t.to(dtype));
      (out * weight).sum().backward();
      std::vector<torch::Tensor> all{out.detach(), xi.grad()};
      for (const auto& p : op->parameters()) all.push_back(p.grad().clone());
      return all;
    };
    const auto fused = run(true), plain = run(false);
    ASSERT_EQ(fused.size(), plain.size());
    const double tolerance = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_EQ(fused[i].scalar_type(), dtype) << "tensor " << i;
      const double scale = plain[i].abs().max().item<double>();
      const double diff = (fused[i] - plain[i]).abs().max().item<double>();
      EXPECT_GT(scale, 0) << "tensor " << i;
      EXPECT_LE(diff, tolerance * (1 + scale)) << "tensor " << i << " of " << plain.size();
    }
  }
}

void expect_fixture(const std::string& name) {
  SCOPED_TRACE(name);
  const auto dir = fixture(name);
  auto expected = load_safetensors(dir + "/expected.safetensors");
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(dir + "/fixture.json"));
  const auto ids = hyena_ids(meta.at("sequences").get<std::vector<std::string>>());
  const auto& want_ids = expected.at("input_ids");
  ASSERT_EQ(want_ids.size(0), int64_t(ids.size()));
  for (size_t r = 0; r < ids.size(); ++r) {
    auto row = torch::tensor(ids[r], torch::kLong);
    EXPECT_TRUE(torch::equal(row, want_ids[r])) << "row " << r;
  }
  auto model = load_hf_hyena(dir);
  torch::NoGradGuard no_grad;
  dnallm::testing::expect_reference_logits(name, model->forward(want_ids), expected.at("logits"));
}

TEST(Hyena, HuggingFaceFixturesMatchTheReference) {
  expect_fixture("hyenadna_causal");
  expect_fixture("hyenadna_cls");   // its z was moved: the stored one must be used
  expect_fixture("hyenadna_long");  // 4,101 tokens
}

TEST(Hyena, ATrainedPositionalFeatureIsKeptAndAnUntrainedOneRegenerated) {
  auto cls = load_hf_hyena(fixture("hyenadna_cls"));
  auto causal = load_hf_hyena(fixture("hyenadna_causal"));
  EXPECT_TRUE(cls->blocks[0]->mixer->filter_fn->stored_z.defined());
  EXPECT_FALSE(causal->blocks[0]->mixer->filter_fn->stored_z.defined());
}

TEST(Hyena, ExportIsTheLayoutItCameInAndLoadsBackExactly) {
  for (const char* name : {"hyenadna_causal", "hyenadna_cls"}) {
    SCOPED_TRACE(name);
    auto model = load_hf_hyena(fixture(name));
    // DNALLM_HYENA_EXPORT_KEEP=DIR keeps the exports in DIR/<fixture> for
    // tests/hf/check_hyena_export.py (LongSafari's code loads them).
    const dnallm::testing::KeptExport dir("DNALLM_HYENA_EXPORT_KEEP", "hyena_export", name);
    const std::string& out = dir.path();
    export_hf_hyena(model, out, fixture(name));
    nlohmann::json config = nlohmann::json::parse(std::ifstream(out + "/config.json"));
    EXPECT_EQ(config.at("auto_map").at("AutoModelForCausalLM"),
              "modeling_hyena.HyenaDNAForCausalLM");
    EXPECT_TRUE(fs::exists(out + "/tokenizer_config.json"));
    auto again = load_hf_hyena(out);
    EXPECT_EQ(again->blocks[0]->mixer->filter_fn->stored_z.defined(),
              model->blocks[0]->mixer->filter_fn->stored_z.defined());
    auto ids = load_safetensors(fixture(name) + "/expected.safetensors").at("input_ids");
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(model->forward(ids), again->forward(ids)));
  }
}

// A copy of a fixture with `edit` applied to its config.json.
std::string damaged_copy(const std::string& name,
                         const std::function<void(nlohmann::json&)>& edit) {
  const fs::path out =
      fs::temp_directory_path() / ("dnallm_hyena_" + name + std::to_string(::getpid()));
  fs::remove_all(out);
  fs::copy(fixture("hyenadna_causal"), out);
  nlohmann::json c = nlohmann::json::parse(std::ifstream(out / "config.json"));
  edit(c);
  std::ofstream(out / "config.json") << c.dump();
  return out.string();
}

void expect_usage(const std::string& dir, const std::string& needle) {
  try {
    load_hf_hyena(dir);
    FAIL() << "expected exit 2 for " << dir;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

TEST(Hyena, DamagedDirectoriesAreOneLineRefusals) {
  expect_usage(damaged_copy("layers", [](auto& c) { c["n_layer"] = 3; }),
               "hyena.backbone.layers.2.");  // a missing tensor, named
  expect_usage(damaged_copy("fewer", [](auto& c) { c["n_layer"] = 1; }),
               "unexpected tensor hyena.backbone.layers.1.");
  expect_usage(
      damaged_copy("arch",
                   [](auto& c) { c["architectures"] = {"HyenaDNAForSequenceClassification"}; }),
      "architectures names");
  expect_usage(damaged_copy("order", [](auto& c) { c["hyena_order"] = 3; }), "hyena_order");
  expect_usage(damaged_copy("width", [](auto& c) { c["d_model"] = 0; }), "d_model");
  expect_usage(damaged_copy("emb", [](auto& c) { c["emb_dim"] = 4; }), "emb_dim");
  expect_usage(damaged_copy("inner", [](auto& c) { c["d_inner"] = 48; }), "has shape");
  // The wrong JSON type names its key (an "internal error" from the JSON library before).
  expect_usage(damaged_copy("freq", [](auto& c) { c["train_freq"] = "yes"; }),
               "\"train_freq\" = \"yes\" is not true or false");
  auto no_weights = damaged_copy("bin", [](auto&) {});
  fs::rename(no_weights + "/model.safetensors", no_weights + "/pytorch_model.bin");
  expect_usage(no_weights, "safetensors only");
  // Longer than max_seq_len: refused, not truncated as the reference does.
  auto model = load_hf_hyena(fixture("hyenadna_causal"));
  torch::NoGradGuard no_grad;
  EXPECT_THROW(model->forward(torch::full({1, 131}, 7, torch::kLong)), Error);
}

}  // namespace
}  // namespace dnallm::models::hyena
