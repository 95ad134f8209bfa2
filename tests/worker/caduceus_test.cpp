// Caduceus (worker/models/caduceus): the import of the Hugging Face layout against logits of
// kuleshov-group's code over mamba-ssm's reference scan (tests/data/hf-fixtures/caduceus_*,
// tests/hf/make_caduceus_fixtures.py), reverse-complement equivariance of Caduceus-PS at three
// lengths, and one-line refusals.
#include "worker/models/caduceus/caduceus.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "core/config.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/kept_export.hpp"
#include "tests/worker/reference_logits.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/caduceus/caduceus_model.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::models::caduceus {
namespace {

using dnallm::testing::expect_error;

namespace fs = std::filesystem;

std::string fixture(const std::string& name) {
  return std::string(DNALLM_HF_FIXTURES) + "/" + name;
}

TEST(Caduceus, HuggingFaceFixturesMatchTheReference) {
  for (const char* name :
       {"caduceus_ph_mlm", "caduceus_ps_mlm", "caduceus_ps_cls", "caduceus_ps_fused_mlm"}) {
    SCOPED_TRACE(name);
    auto expected = load_safetensors(fixture(name) + "/expected.safetensors");
    auto model = load_hf_caduceus(fixture(name));
    torch::NoGradGuard no_grad;
    dnallm::testing::expect_reference_logits(name, model->forward(expected.at("input_ids")),
                                             expected.at("logits"));
    if (HasFatalFailure()) return;
  }
}

// Note [Caduceus fused add+norm]: config.json's fused_add_norm is read, written back by our
// exports (hub layout and our own config), and changes the function: the fused fixture's weights
// under the unfused path miss the reference by far more than the tolerance.
TEST(Caduceus, FusedAddNormIsReadWrittenBackAndComputedApart) {
  auto model = load_hf_caduceus(fixture("caduceus_ps_fused_mlm"));
  ASSERT_TRUE(model->options().fused_add_norm);
  EXPECT_FALSE(load_hf_caduceus(fixture("caduceus_ps_mlm"))->options().fused_add_norm);
  auto o = model->options();
  o.hf_config = nlohmann::json();
  const auto written = hf_config_of(o);
  EXPECT_EQ(written.at("fused_add_norm"), true);
  EXPECT_TRUE(options_from_hf_config(written, "test").fused_add_norm);
  EXPECT_EQ(hf_export_config(model->options()).at("fused_add_norm"), true);
  o.fused_add_norm = false;
  CaduceusLM unfused(o);
  torch::NoGradGuard no_grad;
  auto theirs = model->named_parameters();
  for (auto& p : unfused->named_parameters()) p.value().copy_(theirs[p.key()]);
  const auto expected =
      load_safetensors(fixture("caduceus_ps_fused_mlm") + "/expected.safetensors");
  const auto want = expected.at("logits");
  EXPECT_LE((model->forward(expected.at("input_ids")) - want).abs().max().item<double>(), 1e-4);
  EXPECT_GT((unfused->forward(expected.at("input_ids")) - want).abs().max().item<double>(), 1e-2);
}

// The reverse complement of ids: reversed, each base replaced by its complement.
torch::Tensor reverse_complement(const torch::Tensor& ids, const torch::Tensor& complement) {
  return complement.index({ids.flip({-1})});
}

// Import a fixture, export it, import the export: the same logits, and model.safetensors holds
// the fixture's tensors (names, shapes, dtypes, values) plus only the second names of BiMamba's
// tied projections (Note [Caduceus tied projections]), equal to the first.
TEST(Caduceus, ExportIsTheLayoutItCameInAndLoadsBackExactly) {
  for (const char* name :
       {"caduceus_ph_mlm", "caduceus_ps_mlm", "caduceus_ps_cls", "caduceus_ps_fused_mlm"}) {
    SCOPED_TRACE(name);
    auto model = load_hf_caduceus(fixture(name));
    // DNALLM_CADUCEUS_EXPORT_KEEP=DIR keeps the exports in DIR/<fixture> for
    // tests/hf/check_caduceus_export.py (kuleshov-group's code loads them).
    const dnallm::testing::KeptExport dir("DNALLM_CADUCEUS_EXPORT_KEEP", "caduceus_export", name);
    const std::string& out = dir.path();
    export_hf_caduceus(model, out, fixture(name));
    const auto config = nlohmann::json::parse(std::ifstream(out + "/config.json"));
    const auto source = nlohmann::json::parse(std::ifstream(fixture(name) + "/config.json"));
    EXPECT_EQ(config.at("auto_map").at("AutoModelForMaskedLM"),
              "modeling_caduceus.CaduceusForMaskedLM");
    for (const auto& [key, value] : source.items()) EXPECT_EQ(config.at(key), value) << key;
    const auto want = load_safetensors(fixture(name) + "/model.safetensors");
    const auto got = load_safetensors(out + "/model.safetensors");
    for (const auto& [key, t] : want) {
      SCOPED_TRACE(key);
      ASSERT_EQ(got.count(key), 1u);
      EXPECT_EQ(got.at(key).sizes(), t.sizes());
      EXPECT_EQ(got.at(key).scalar_type(), t.scalar_type());
      EXPECT_TRUE(torch::equal(got.at(key), t));
    }
    size_t tied = 0;
    for (const auto& [key, t] : got) {
      if (want.count(key) != 0) continue;
      SCOPED_TRACE(key);
      if (key == "lm_head.lm_head.weight") {
        // The RCPS masked LM's head, tied to the embedding (Note [Caduceus tied projections]):
        // the fixture's file leaves it out, ours writes it, equal to the embedding it was tied to.
        EXPECT_TRUE(torch::equal(
            t, got.at("caduceus.backbone.embeddings.word_embeddings.embedding.weight")));
        continue;
      }
      const auto at = key.find(".mamba_rev.");
      ASSERT_NE(at, std::string::npos);
      EXPECT_TRUE(key.find(".in_proj.") != std::string::npos ||
                  key.find(".out_proj.") != std::string::npos);
      EXPECT_TRUE(torch::equal(t, got.at(key.substr(0, at) + ".mamba_fwd." + key.substr(at + 11))));
      ++tied;
    }
    EXPECT_EQ(tied, 2u * size_t(model->options().n_layer));
    auto again = load_hf_caduceus(out);
    const auto ids = load_safetensors(fixture(name) + "/expected.safetensors").at("input_ids");
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(model->forward(ids), again->forward(ids)));
  }
}

// Note [Caduceus tied head]: a Caduceus-PS masked LM's head is the embedding matrix, as the hub
// code ties it on load (RCPSLMHead.set_weight), so what we train is what the exported model
// computes; Caduceus-Ph keeps its own head and its export says tie_word_embeddings = false, so
// that transformers 4 does not tie it either. A PS run resumed from a checkpoint with its own
// head_weight (before the tie) keeps it, and so does a directory we exported then.
TEST(Caduceus, RcpsMaskedLmHeadIsTheEmbeddingAsTheHubTiesIt) {
  const auto tokenizer = data::make_char_tokenizer();
  const auto ids = torch::tensor({{5, 6, 7, 8, 9, 6, 7, 5}}, torch::kLong);
  auto lm_of = [](LanguageModel& model) {
    auto* m = dynamic_cast<CaduceusModelImpl*>(model.get());
    EXPECT_NE(m, nullptr);
    return m->lm();
  };
  auto has_parameter = [](LanguageModel& model, const std::string& name) {
    for (const auto& p : model->named_parameters()) {
      if (p.key() == name) return true;
    }
    return false;
  };
  for (const std::string arch : {"caduceus", "caduceus-ps"}) {
    SCOPED_TRACE(arch);
    const bool rcps = arch == "caduceus-ps";
    const Config config = parse_config(
        "[model]\narch = \"" + arch + "\"\ntask = \"pretrain\"\nhidden = 16\nlayers = 2\n", "tied");
    auto model = build_model_for(config, *tokenizer, BuildContext{});
    auto lm = lm_of(model);
    EXPECT_EQ(has_parameter(model, "head_weight"), !rcps);
    EXPECT_EQ(lm->head().unsafeGetTensorImpl() == lm->word_embeddings->weight.unsafeGetTensorImpl(),
              rcps);
    // A tied head's gradient lands in the embedding.
    lm->forward(ids).logsumexp(-1).sum().backward();
    ASSERT_TRUE(lm->word_embeddings->weight.grad().defined());
    torch::NoGradGuard no_grad;
    if (!rcps) lm->head_weight.add_(1.0);  // apart from the embedding, as after training
    const auto logits = lm->forward(ids);

    const fs::path dir = fs::temp_directory_path() / ("dnallm_caduceus_tied_" + arch);
    fs::remove_all(dir);
    ASSERT_TRUE(export_hf_directory(model, *tokenizer, (dir / "hf").string(), "",
                                    whole_model_units(), true));
    const auto hub = load_safetensors((dir / "hf" / "model.safetensors").string());
    const std::string head = rcps ? "lm_head.lm_head.weight" : "lm_head.weight";
    const std::string emb = std::string("caduceus.backbone.embeddings.word_embeddings") +
                            (rcps ? ".embedding" : "") + ".weight";
    ASSERT_EQ(hub.count(head), 1u);
    EXPECT_EQ(torch::equal(hub.at(head), hub.at(emb)), rcps);
    const auto hub_config = nlohmann::json::parse(std::ifstream(dir / "hf" / "config.json"));
    EXPECT_EQ(hub_config.at("tie_word_embeddings"), rcps);
    EXPECT_TRUE(torch::equal(load_hf_caduceus((dir / "hf").string())->forward(ids), logits));

    export_live_model(model, (dir / "ours").string());
    auto again = load_exported_model((dir / "ours").string());
    EXPECT_EQ(has_parameter(again, "head_weight"), !rcps);
    EXPECT_TRUE(torch::equal(lm_of(again)->forward(ids), logits));
    if (!rcps) {
      fs::remove_all(dir);
      continue;
    }
    // Resumed from before the tie: its own head, kept through our export, whose config.json
    // says so (and one from before the tie, with no such key, reads as untied).
    BuildContext resumed;
    resumed.resumed_parameters = {"head_weight", "word_embeddings.weight"};
    auto untied = build_model_for(config, *tokenizer, resumed);
    ASSERT_TRUE(has_parameter(untied, "head_weight"));
    lm_of(untied)->head_weight.add_(1.0);
    const auto untied_logits = lm_of(untied)->forward(ids);
    export_live_model(untied, (dir / "untied").string());
    const fs::path config_path = dir / "untied" / "config.json";
    auto untied_config = nlohmann::json::parse(std::ifstream(config_path));
    EXPECT_EQ(untied_config.at("tie_word_embeddings"), false);
    untied_config.erase("tie_word_embeddings");
    std::ofstream(config_path) << untied_config.dump();
    auto old = load_exported_model((dir / "untied").string());
    ASSERT_TRUE(has_parameter(old, "head_weight"));
    EXPECT_TRUE(torch::equal(lm_of(old)->forward(ids), untied_logits));
    fs::remove_all(dir);
  }
}

TEST(Caduceus, RcpsIsReverseComplementEquivariantAtAnyLength) {
  auto mlm = load_hf_caduceus(fixture("caduceus_ps_mlm"));
  // Note [Caduceus fused add+norm]: the half swap commutes with the RC permutation.
  auto fused = load_hf_caduceus(fixture("caduceus_ps_fused_mlm"));
  auto cls = load_hf_caduceus(fixture("caduceus_ps_cls"));
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  for (int64_t length : {1, 37, 64}) {
    SCOPED_TRACE(length);
    auto ids = torch::randint(7, 12, {2, length});
    auto rc = reverse_complement(ids, mlm->complement);
    // Masked LM: the logits on the RC strand are the RC-permuted logits (position reversed,
    // vocabulary complemented).
    for (auto* m : {&mlm, &fused}) {
      auto a = (*m)->forward(ids), b = (*m)->forward(rc);
      auto permuted = a.flip({1}).index_select(-1, (*m)->complement);
      EXPECT_LE((b - permuted).abs().max().item<double>(), 1e-5);
    }
    // Classifier: the same logits for a sequence and its reverse complement.
    EXPECT_LE((cls->forward(ids) - cls->forward(rc)).abs().max().item<double>(), 1e-5);
  }
  // Caduceus-Ph has no such guarantee (it averages strands post hoc): the test can tell.
  auto ph = load_hf_caduceus(fixture("caduceus_ph_mlm"));
  auto ids = torch::randint(7, 12, {1, 37});
  auto a = ph->forward(ids), b = ph->forward(reverse_complement(ids, ph->complement));
  EXPECT_GT((b - a.flip({1}).index_select(-1, ph->complement)).abs().max().item<double>(), 1e-3);
}

// Records the block hooks' calls (Note [Block hooks]): ('b', i) before block i, ('a', i) after.
class RecordingHooks : public BlockHooks {
 public:
  void before_block(size_t index) override { calls.emplace_back('b', index); }
  torch::Tensor after_block(size_t index, torch::Tensor output) override {
    calls.emplace_back('a', index);
    return output;
  }
  std::vector<std::pair<char, size_t>> calls;
};

// Note [Caduceus activation checkpointing]: for Caduceus-Ph and -PS, masked LM and classifier,
// every parameter's gradient with checkpointing is the one without, bit for bit, and the block
// hooks surround each mixer once per forward, in order, either way.
TEST(Caduceus, ActivationCheckpointingGivesTheSameGradients) {
  for (const bool rcps : {false, true}) {
    for (const bool classifier : {false, true}) {
      SCOPED_TRACE(std::string(rcps ? "ps" : "ph") + (classifier ? " classifier" : " mlm"));
      CaduceusOptions o;
      o.d_model = 16, o.n_layer = 3, o.d_state = 4, o.dt_rank = 2, o.vocab_size = 16;
      o.rcps = rcps, o.classifier = classifier, o.num_labels = 3;
      o.complement = {0, 1, 2, 3, 4, 5, 6, 10, 9, 8, 7, 11, 12, 13, 14, 15};
      using Calls = std::vector<std::pair<char, size_t>>;
      auto grads = [&](bool checkpoint, Calls* calls) {
        torch::manual_seed(3);
        CaduceusLM model(o);
        model->gradient_checkpointing = checkpoint;
        auto hooks = std::make_shared<RecordingHooks>();
        model->block_hooks = hooks;
        model->train();
        auto ids = torch::randint(7, 12, {2, 29}, torch::TensorOptions().dtype(torch::kLong));
        model->forward(ids).pow(2).mean().backward();
        *calls = hooks->calls;
        std::vector<std::pair<std::string, torch::Tensor>> out;
        for (auto& p : model->named_parameters()) out.emplace_back(p.key(), p.value().grad());
        return out;
      };
      Calls plain_calls, checkpointed_calls;
      const auto plain = grads(false, &plain_calls);
      const auto checkpointed = grads(true, &checkpointed_calls);
      EXPECT_EQ(plain_calls, (Calls{{'b', 0}, {'a', 0}, {'b', 1}, {'a', 1}, {'b', 2}, {'a', 2}}));
      EXPECT_EQ(checkpointed_calls, plain_calls);
      ASSERT_EQ(plain.size(), checkpointed.size());
      for (size_t i = 0; i < plain.size(); ++i) {
        ASSERT_TRUE(plain[i].second.defined()) << plain[i].first;
        ASSERT_TRUE(checkpointed[i].second.defined()) << plain[i].first;
        EXPECT_TRUE(torch::equal(plain[i].second, checkpointed[i].second)) << plain[i].first;
      }
    }
  }
}

// Layer i's unit (blocks()[i], what ZeRO-3 gathers and frees around mixer i: Note [Fully
// sharded]) holds both directions' mixers of layer i: mamba_rev's own x_proj, dt_proj, conv1d,
// A_log and D as well as the projections it shares with mamba_fwd. Everything else (embeddings,
// norms, head) is in no unit: the root.
TEST(Caduceus, EachLayersUnitHoldsBothDirectionsOfItsMixer) {
  for (const bool rcps : {false, true}) {
    SCOPED_TRACE(rcps ? "ps" : "ph");
    CaduceusOptions o;
    o.d_model = 16, o.n_layer = 3, o.d_state = 4, o.dt_rank = 2, o.vocab_size = 16;
    o.rcps = rcps;
    o.complement = {0, 1, 2, 3, 4, 5, 6, 10, 9, 8, 7, 11, 12, 13, 14, 15};
    auto model = std::make_shared<CaduceusModelImpl>(CaduceusLM(o), 12);
    const auto blocks = model->blocks();
    ASSERT_EQ(blocks.size(), 3u);
    std::map<const void*, size_t> unit_of;
    for (size_t b = 0; b < blocks.size(); ++b) {
      for (const auto& p : blocks[b]->parameters()) unit_of[p.unsafeGetTensorImpl()] = b;
    }
    int64_t rev = 0;
    for (const auto& p : model->named_parameters()) {
      const auto it = unit_of.find(p.value().unsafeGetTensorImpl());
      const auto at = p.key().find("mamba_");
      if (at == std::string::npos) {
        EXPECT_EQ(it, unit_of.end()) << p.key() << " is in a unit";
        continue;
      }
      ASSERT_NE(it, unit_of.end()) << p.key() << " is in no unit (the root)";
      const auto layer = p.key().substr(p.key().find('_', at + 6) + 1);
      EXPECT_EQ(std::to_string(it->second), layer.substr(0, layer.find('.'))) << p.key();
      rev += p.key().find("mamba_rev_") != std::string::npos ? 1 : 0;
    }
    // mamba_rev_i owns x_proj.weight, dt_proj.{weight,bias}, conv1d.{weight,bias}, A_log, D.
    EXPECT_EQ(rev, 3 * 7);
  }
}

TEST(Caduceus, SelectiveScanIsTheRecurrence) {
  torch::manual_seed(7);
  const int64_t B = 2, D = 3, N = 4, L = 9;
  auto u = torch::randn({B, D, L}), delta = torch::randn({B, D, L}), z = torch::randn({B, D, L});
  auto A = -torch::rand({D, N}), Bm = torch::randn({B, N, L}), C = torch::randn({B, N, L});
  auto Dp = torch::randn({D}), bias = torch::randn({D});
  auto y = selective_scan(u, delta, A, Bm, C, Dp, z, bias);
  // Scalar loops, double precision.
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t d = 0; d < D; ++d) {
      std::vector<double> h(N, 0.0);
      for (int64_t t = 0; t < L; ++t) {
        const double x = delta[b][d][t].item<double>() + bias[d].item<double>();
        const double dt = x > 20 ? x : std::log1p(std::exp(x));
        double out = 0;
        for (int64_t n = 0; n < N; ++n) {
          h[n] = std::exp(dt * A[d][n].item<double>()) * h[n] +
                 dt * Bm[b][n][t].item<double>() * u[b][d][t].item<double>();
          out += h[n] * C[b][n][t].item<double>();
        }
        out += u[b][d][t].item<double>() * Dp[d].item<double>();
        const double zz = z[b][d][t].item<double>();
        out *= zz / (1 + std::exp(-zz));
        EXPECT_NEAR(y[b][d][t].item<double>(), out, 1e-4);
      }
    }
  }
}

TEST(Caduceus, FusedScanEqualsTheOpsInValuesAndGradients) {
  torch::manual_seed(11);
  const int64_t B = 2, D = 5, N = 4, L = 23;
  auto make = [](std::vector<int64_t> shape) { return torch::randn(shape).requires_grad_(true); };
  auto u = make({B, D, L}), delta = make({B, D, L}), z = make({B, D, L});
  auto A = (-torch::rand({D, N}) - 0.1).requires_grad_(true), Bm = make({B, N, L}),
       C = make({B, N, L}), Dp = make({D}), bias = make({D});
  // One delta past softplus's threshold (20): the linear branch.
  {
    torch::NoGradGuard no_grad;
    delta[0][0][3] = 25;
  }
  const std::vector<torch::Tensor> inputs = {u, delta, A, Bm, C, Dp, z, bias};
  auto weight = torch::randn({B, D, L});
  auto grads = [&](bool fused) {
    for (auto t : inputs) t.mutable_grad() = torch::Tensor();
    auto y = fused ? selective_scan_fused(u, delta, A, Bm, C, Dp, z, bias)
                   : selective_scan(u, delta, A, Bm, C, Dp, z, bias);
    (y * weight).sum().backward();
    std::vector<torch::Tensor> out = {y.detach()};
    for (auto& t : inputs) out.push_back(t.grad().clone());
    return out;
  };
  const auto ops = grads(false), fused = grads(true);
  for (size_t i = 0; i < ops.size(); ++i) {
    SCOPED_TRACE(i);  // 0: values, then the gradients of u, delta, A, B, C, D, z, bias
    const double scale = std::max(1.0, ops[i].abs().max().item<double>());
    EXPECT_LE((ops[i] - fused[i]).abs().max().item<double>() / scale, 1e-5);
  }
}

void expect_usage(const std::function<void(nlohmann::json&)>& edit, const std::string& needle) {
  const fs::path out =
      fs::temp_directory_path() / ("dnallm_caduceus_" + std::to_string(::getpid()));
  fs::remove_all(out);
  fs::copy(fixture("caduceus_ps_mlm"), out);
  nlohmann::json c = nlohmann::json::parse(std::ifstream(out / "config.json"));
  edit(c);
  std::ofstream(out / "config.json") << c.dump();
  expect_error([&] { load_hf_caduceus(out.string()); }, ExitCode::kUsage, {needle});
  fs::remove_all(out);
}

TEST(Caduceus, DamagedDirectoriesAreOneLineRefusals) {
  expect_usage([](auto& c) { c["n_layer"] = 3; }, "caduceus.backbone.layers.2.");
  expect_usage([](auto& c) { c["n_layer"] = 1; }, "unexpected tensor caduceus.backbone.layers.1.");
  expect_usage([](auto& c) { c["rcps"] = false; }, "unexpected tensor");
  // Note [Caduceus fused add+norm]: without the key, CaduceusConfig's default (fused) holds,
  // whose norms have other names than this unfused file's.
  expect_usage([](auto& c) { c.erase("fused_add_norm"); }, "fused_add_norm true");
  expect_usage([](auto& c) { c["bidirectional_strategy"] = "ew_multiply"; },
               "bidirectional_strategy");
  expect_usage([](auto& c) { c["complement_map"]["7"] = 99; }, "complement_map entry");
  expect_usage([](auto& c) { c["ssm_cfg"]["d_state"] = 5; }, "has shape");
  // A value of the wrong JSON type names its key (it was an "internal error" from the JSON
  // library before).
  expect_usage([](auto& c) { c["rcps"] = "yes"; }, "\"rcps\" = \"yes\" is not true or false");
  expect_usage([](auto& c) { c["rms_norm"] = 1; }, "\"rms_norm\" = 1 is not true or false");
  expect_usage([](auto& c) { c["bidirectional_strategy"] = 7; },
               "\"bidirectional_strategy\" = 7 is not a string");
  expect_usage([](auto& c) { c["tie_word_embeddings"] = "true"; }, "tie_word_embeddings");
}

}  // namespace
}  // namespace dnallm::models::caduceus
