// The model interface and registry (Note [Model interface], Note [Model registry]): unknown
// values are exit 2 naming them; HyenaDNA and Caduceus behind the interface train, export and
// load back exactly; a published checkpoint read in our token order (Note [Character
// vocabularies]) computes the reference's logits (tests/data/hf-fixtures, made by the
// reference code), and its export to the hub layout computes them again.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "core/config.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/hf_fixtures.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/caduceus/caduceus_model.hpp"
#include "worker/models/hyena/hyena_model.hpp"
#include "worker/models/lora_linear.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::models {
namespace {

using dnallm::testing::expect_error;

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return dnallm::testing::hf_fixture(name); }

fs::path temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("dnallm_model_interface_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

Config tiny(const std::string& arch, const std::string& task) {
  return parse_config(fmt::format("[model]\narch = \"{}\"\ntask = \"{}\"\nhidden = 16\nlayers = 2\n"
                                  "heads = 2\nffn = 32\nmax_seq_length = 64\nnum_labels = 3\n"
                                  "[training]\nseed = 7\n",
                                  arch, task),
                      "tiny");
}

ForwardInputs random_batch(int64_t rows, int64_t len, int64_t vocab, const Config& c) {
  ForwardInputs in;
  torch::manual_seed(3);
  in.input_ids = torch::randint(data::kFirstRegularId, vocab, {rows, len}, torch::kLong);
  in.attention_mask = torch::ones({rows, len}, torch::kLong);
  if (c.model.task == cfg::Task::kClassification) {
    in.labels = torch::randint(0, c.model.num_labels, {rows}, torch::kLong);
  } else if (c.model.arch == cfg::Arch::kHyena) {
    in.labels = in.input_ids.clone();
  } else {
    in.labels = torch::full({rows, len}, -100, torch::kLong);
    in.labels.index_put_({torch::indexing::Slice(), 3}, in.input_ids.select(1, 3));
    in.input_ids.index_put_({torch::indexing::Slice(), 3}, data::kMaskId);
  }
  return in;
}

TEST(ModelRegistry, UnknownValuesAreExit2NamingThem) {
  expect_error([] { tiny("mamba", "pretrain"); }, ExitCode::kUsage,
               {"model.arch", "mamba", "hyena", "caduceus-ps"});
  auto dir = temp_dir("unknown_type");
  std::ofstream(dir / "config.json") << R"({"model_type": "mamba2"})";
  expect_error([&] { load_exported_model(dir.string()); }, ExitCode::kUsage,
               {"mamba2", "dnallm-gpt", "hyenadna"});
  expect_error(
      [] {
        family_for_hf_config(nlohmann::json{{"model_type", "t5"}}, "x/config.json");
      },
      ExitCode::kUsage, {"x/config.json", "\"t5\"", "caduceus"});
}

TEST(ModelRegistry, AnExportWithAnUnknownTaskOrPoolingIsRefusedNotGuessed) {
  const auto tok = data::make_char_tokenizer();
  auto model = build_model_for(tiny("bert", "classification"), *tok, BuildContext{});
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"task", "regresion"}, {"pooling", "max"}, {"position_embedding_type", "relative"}}) {
    auto dir = temp_dir("bad_" + key);
    export_live_model(model, dir.string());
    auto c = nlohmann::json::parse(std::ifstream(dir / "config.json"));
    c[key] = value;
    std::ofstream(dir / "config.json") << c.dump();
    expect_error([&] { load_exported_model(dir.string()); }, ExitCode::kUsage, {key, value});
  }
}

// Note [Memory predicted] (worker/models/transformer/family.cpp): 1.6e6 parameters at 4 ranks
// under ZeRO-3 need about 10 MB a rank (a quarter of 16 bytes a parameter, the root and two
// blocks gathered with their gradients, activations); offloading the optimizer from a GPU takes
// the moments (3.2 MB) out of the device's 8 MB budget, and on the CPU it takes nothing out.
TEST(ModelRegistry, OptimizerOffloadFromAGpuLeavesTheMomentsOutOfTheBudget) {
  const auto tok = data::make_char_tokenizer();
  const auto config = [](bool offload) {
    return parse_config(fmt::format("[model]\narch = \"bert\"\nhidden = 128\nlayers = 8\n"
                                    "heads = 2\nffn = 512\nmax_seq_length = 32\n"
                                    "[training]\nmicro_batch_size = 1\nmemory_limit_gb = 0.008\n"
                                    "optimizer_offload = {}\n[parallel]\nzero_stage = 3\n",
                                    offload),
                        "big");
  };
  BuildContext gpu{/*on_cpu=*/false, /*world_size=*/4, /*local_world_size=*/4};
  BuildContext cpu{/*on_cpu=*/true, /*world_size=*/4, /*local_world_size=*/4};
  expect_error([&] { build_model_for(config(false), *tok, gpu); }, ExitCode::kUsage,
               {"more than training.memory_limit_gb = 0.008", "AdamW moments 0.0032"});
  expect_error([&] { build_model_for(config(true), *tok, cpu); }, ExitCode::kUsage,
               {"more than training.memory_limit_gb = 0.008"});
  auto model = build_model_for(config(true), *tok, gpu);
  EXPECT_EQ(model->blocks().size(), 8u);
}

TEST(ModelRegistry, EveryFamilyBuildsTrainsExportsAndLoadsBackExactly) {
  const auto tok = data::make_char_tokenizer();
  for (const auto& [arch, task] :
       std::vector<std::pair<std::string, std::string>>{{"bert", "pretrain"},
                                                        {"gpt", "classification"},
                                                        {"hyena", "pretrain"},
                                                        {"hyena", "classification"},
                                                        {"caduceus", "pretrain"},
                                                        {"caduceus-ps", "classification"}}) {
    SCOPED_TRACE(arch + " " + task);
    const auto config = tiny(arch, task);
    auto model = build_model_for(config, *tok, BuildContext{});
    EXPECT_EQ(model->spec().family, family_for_arch(config.model.arch).name);
    EXPECT_EQ(model->spec().vocab_size, tok->vocab_size());
    EXPECT_FALSE(model->blocks().empty());
    EXPECT_GT(model->flops_per_token(64), 6.0 * 16 * 16);
    // One optimiser step moves the loss: the loss reaches every parameter through forward().
    auto in = random_batch(2, 24, tok->vocab_size(), config);
    model->train();
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
    auto out = model->forward(in);
    ASSERT_TRUE(out.loss_sum.defined());
    EXPECT_GT(out.loss_count, 0);
    const double before = out.loss_sum.item<double>() / double(out.loss_count);
    EXPECT_TRUE(std::isfinite(before));
    out.loss_sum.backward();
    int64_t with_grad = 0;
    for (const auto& p : model->parameters()) with_grad += p.grad().defined() ? 1 : 0;
    EXPECT_GT(with_grad, int64_t(model->parameters().size()) / 2);
    sgd.step();
    model->eval();
    torch::NoGradGuard no_grad;
    in.labels = torch::Tensor();
    const auto logits = model->forward(in).logits;
    const auto hidden = model->encode(in);
    EXPECT_EQ(hidden.size(-1), model->spec().hidden_size);

    auto dir = temp_dir("roundtrip_" + arch + "_" + task);
    export_live_model(model, dir.string());
    auto loaded = load_exported_model(dir.string());
    EXPECT_EQ(loaded->spec().family, model->spec().family);
    EXPECT_EQ(loaded->spec().task, model->spec().task);
    EXPECT_EQ(loaded->spec().vocab_size, model->spec().vocab_size);
    EXPECT_TRUE(torch::equal(loaded->forward(in).logits, logits));
  }
}

// Their ids (Note [Character vocabularies]) -> ours, for inputs of the fixtures.
torch::Tensor to_our_ids(const torch::Tensor& theirs, const std::vector<int64_t>& map) {
  std::map<int64_t, int64_t> back;
  for (size_t i = 0; i < map.size(); ++i) back[map[i]] = int64_t(i);
  auto out = theirs.clone();
  auto* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < out.numel(); ++i) {
    EXPECT_TRUE(back.count(p[i])) << "their id " << p[i];
    p[i] = back[p[i]];
  }
  return out;
}

// Logits in our token order [.., ours] against the reference's [.., theirs] through `map`.
double max_mapped_diff(const torch::Tensor& ours, const torch::Tensor& theirs,
                       const std::vector<int64_t>& map) {
  double worst = 0;
  for (size_t i = 0; i < map.size(); ++i) {
    const auto a = ours.select(-1, int64_t(i));
    const auto b = theirs.select(-1, map[i]);
    worst = std::max(worst, (a - b).abs().max().item<double>());
  }
  return worst;
}

TEST(ModelRegistry, PublishedCheckpointsFineTuneInOurTokenOrderWithTheReferenceLogits) {
  const auto tok = data::make_char_tokenizer();
  for (const auto& [name, arch] :
       std::vector<std::pair<std::string, std::string>>{{"hyenadna_causal", "hyena"},
                                                        {"caduceus_ps_mlm", "caduceus-ps"},
                                                        {"caduceus_ps_fused_mlm", "caduceus-ps"},
                                                        {"caduceus_ph_mlm", "caduceus"}}) {
    SCOPED_TRACE(name);
    auto config = tiny(arch, "pretrain");
    config.model.init_from = fixture(name);
    auto model = build_model_for(config, *tok, BuildContext{});
    model->eval();
    const auto expected = load_safetensors(fixture(name) + "/expected.safetensors");
    const auto& their_ids = expected.at("input_ids");
    const auto map =
        character_vocabulary_map(*tok, fixture(name), /*their_vocab=*/12, model->spec().family);
    ForwardInputs in;
    in.input_ids = to_our_ids(their_ids, map);
    torch::NoGradGuard no_grad;
    const auto logits = model->forward(in).logits;
    const double diff = max_mapped_diff(logits, expected.at("logits"), map);
    EXPECT_LE(diff, 1e-4);
    std::cout << name << " in our token order: max |ours - reference| = " << diff << "\n";
    // Back to the hub's layout and ids: the reference's logits again, every row.
    auto dir = temp_dir("hub_" + name);
    ASSERT_TRUE(export_hf_directory(model, *tok, dir.string(), fixture(name)));
    const auto hub = arch == "hyena" ? hyena::load_hf_hyena(dir.string())->forward(their_ids)
                                     : caduceus::load_hf_caduceus(dir.string())->forward(their_ids);
    const double back = (hub - expected.at("logits")).abs().max().item<double>();
    EXPECT_LE(back, 1e-4);
    std::cout << name << " exported back to the hub layout: max diff = " << back << "\n";
  }
}

// model.chunk_positions / chunk_channels reach HyenaDNA's blocks (Note [Hyena chunked block]):
// with checkpointing, chunked in pieces that divide nothing computes the same loss and
// gradients as the plain blocks, also with LoRA (in_proj's adapter folded into the rows the
// chunks take: its lora_B gradient comes through them alone).
TEST(ModelRegistry, HyenaChunkingFromTheConfigComputesThePlainBlocks) {
  const auto tok = data::make_char_tokenizer();
  for (const int64_t lora_r : {0, 4}) {
    SCOPED_TRACE(lora_r);
    auto plain_config = tiny("hyena", "pretrain");
    plain_config.model.gradient_checkpointing = true;
    plain_config.lora.r = lora_r;
    auto chunked_config = plain_config;
    chunked_config.model.chunk_positions = 7;
    chunked_config.model.chunk_channels = 5;
    auto plain = build_model_for(plain_config, *tok, BuildContext{});
    auto chunked = build_model_for(chunked_config, *tok, BuildContext{});
    auto in = random_batch(2, 45, tok->vocab_size(), plain_config);
    std::vector<double> losses;
    std::vector<std::vector<torch::Tensor>> grads;
    for (auto* model : {&plain, &chunked}) {
      (*model)->train();
      auto out = (*model)->forward(in);
      out.loss_sum.backward();
      losses.push_back(out.loss_sum.item<double>());
      grads.emplace_back();
      for (const auto& p : (*model)->parameters()) {
        if (!p.requires_grad()) continue;
        ASSERT_TRUE(p.grad().defined());
        grads.back().push_back(p.grad().clone());
      }
    }
    EXPECT_NEAR(losses[1], losses[0], 1e-5 * std::abs(losses[0]));
    ASSERT_EQ(grads[0].size(), grads[1].size());
    double worst = 0;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      const double scale = grads[0][i].abs().max().item<double>() + 1e-12;
      worst = std::max(worst, (grads[1][i] - grads[0][i]).abs().max().item<double>() / scale);
    }
    EXPECT_LT(worst, 1e-4);
    std::cout << "chunked (7 positions, 5 channels) vs plain, lora.r = " << lora_r
              << ": worst relative gradient difference " << worst << "\n";
  }
}

// LoRA on HyenaDNA and Caduceus (Note [Hyena LoRA targets], Note [Caduceus LoRA targets]): at
// initialisation (B = 0) the logits are the base model's, bit for bit; only the adapters and the
// classification head train (Caduceus: one adapter per tied linear, 2 a layer, not 4); the
// FLOPs count frozen parameters 4, not 6; after a step, our export (merged), the hub layout
// (merged) and the live model merged compute the unmerged logits within 1e-6, and the adapters
// are written apart under PEFT's names.
TEST(ModelRegistry, LoraOnHyenaAndCaduceusTrainsAdaptersAndHeadOnlyAndMergesExactly) {
  const auto tok = data::make_char_tokenizer();
  for (const std::string arch : {"hyena", "caduceus", "caduceus-ps"}) {
    SCOPED_TRACE(arch);
    const auto base_config = tiny(arch, "classification");
    auto config = base_config;
    config.lora.r = 4;
    config.lora.alpha = 8;
    auto base = build_model_for(base_config, *tok, BuildContext{});
    auto model = build_model_for(config, *tok, BuildContext{});
    EXPECT_EQ(model->spec().lora_r, 4);
    auto in = random_batch(2, 24, tok->vocab_size(), config);
    base->eval();
    model->eval();
    {
      torch::NoGradGuard no_grad;
      EXPECT_TRUE(torch::equal(model->forward(in).logits, base->forward(in).logits));
    }
    const std::string head = arch == "hyena" ? "score.weight" : "head_weight";
    int64_t adapters = 0;
    double adapter_numel = 0, frozen_numel = 0;
    for (const auto& p : model->named_parameters()) {
      const bool lora = is_lora_parameter(p.key());
      EXPECT_EQ(p.value().requires_grad(), lora || p.key() == head) << p.key();
      if (lora) adapter_numel += double(p.value().numel());
      if (!p.value().requires_grad()) frozen_numel += double(p.value().numel());
      adapters += p.key().size() > 7 && p.key().substr(p.key().size() - 7) == ".lora_A" ? 1 : 0;
    }
    EXPECT_EQ(adapters, arch == "hyena" ? 2 * 4 : 2 * 2);
    // Note [Model FLOPs]: frozen 4 a parameter, trainable 6; the mixers' own work unchanged.
    const double flops_difference = model->flops_per_token(64) - base->flops_per_token(64);
    EXPECT_NEAR(flops_difference, 6 * adapter_numel - 2 * frozen_numel, 1e-6 * frozen_numel);

    model->train();
    auto out = model->forward(in);
    out.loss_sum.backward();
    std::vector<torch::Tensor> trainable;
    for (const auto& p : model->named_parameters()) {
      if (!p.value().requires_grad()) {
        EXPECT_FALSE(p.value().grad().defined()) << p.key();
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      trainable.push_back(p.value());
    }
    torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.5));
    sgd.step();
    model->eval();
    torch::NoGradGuard no_grad;
    in.labels = torch::Tensor();
    const auto logits = model->forward(in).logits;

    auto dir = temp_dir("lora_" + arch);
    export_live_model(model, dir.string());
    // PEFT's names of the hub layout's modules: HyenaDNA's are ours; Caduceus' adapter is
    // written for mamba_fwd and for mamba_rev (Note [Caduceus PEFT names]).
    const auto adapter_file = load_safetensors((dir / "adapter_model.safetensors").string());
    EXPECT_EQ(int64_t(adapter_file.size()), (arch == "hyena" ? 2 : 4) * adapters);
    const std::string hub_prefix = arch == "hyena" ? "base_model.model.hyena.backbone.layers."
                                   : arch == "caduceus"
                                       ? "base_model.model.caduceus.backbone."
                                         "layers.1.mixer.mamba_rev.out_proj"
                                       : "base_model.model.caduceus.backbone."
                                         "layers.1.mixer.submodule.mamba_rev.in_proj";
    int64_t with_prefix = 0;
    for (const auto& [name, t] : adapter_file) {
      with_prefix += name.rfind(hub_prefix, 0) == 0 ? 1 : 0;
      EXPECT_TRUE(name.find(".lora_A.weight") != std::string::npos ||
                  name.find(".lora_B.weight") != std::string::npos)
          << name;
    }
    EXPECT_EQ(with_prefix, arch == "hyena" ? 2 * adapters : 2) << arch;
    auto loaded = load_exported_model(dir.string());
    const double exported = (loaded->forward(in).logits - logits).abs().max().item<double>();
    EXPECT_LE(exported, 1e-6);
    // Without the adapters (B zeroed for a moment) the logits differ by far more than that: the
    // comparison sees an export that leaves them out.
    {
      std::vector<std::pair<torch::Tensor, torch::Tensor>> saved_b;
      for (auto& p : model->named_parameters()) {
        if (p.key().size() > 7 && p.key().substr(p.key().size() - 7) == ".lora_B") {
          saved_b.emplace_back(p.value(), p.value().clone());
          p.value().zero_();
        }
      }
      const auto without = model->forward(in).logits;
      for (auto& [t, v] : saved_b) t.copy_(v);
      EXPECT_GT((without - logits).abs().max().item<double>(), 1e-4);
    }
    ASSERT_TRUE(export_hf_directory(model, *tok, (dir / "hf").string()));
    // A HyenaDNA export numbers the characters as the hub's CharacterTokenizer does (Note
    // [Character vocabularies]): the same sequence in its ids.
    const auto hub =
        arch == "hyena"
            ? hyena::load_hf_hyena((dir / "hf").string())
                  ->forward(torch::tensor(character_vocabulary_map(*tok, "", 12, "hyena"))
                                .index({in.input_ids}))
            : caduceus::load_hf_caduceus((dir / "hf").string())->forward(in.input_ids);
    const double hub_diff = (hub - logits).abs().max().item<double>();
    EXPECT_LE(hub_diff, 1e-6);
    model->merge_lora();
    const double merged = (model->forward(in).logits - logits).abs().max().item<double>();
    EXPECT_LE(merged, 1e-6);
    std::cout << arch << " LoRA: |export - unmerged| = " << exported
              << ", |hub layout - unmerged| = " << hub_diff << ", |merged - unmerged| = " << merged
              << "\n";
  }
}

// lora.target_modules selects among a family's linears (Note [Family LoRA targets]); a name of
// another family's, or QLoRA, is exit 2 naming it.
TEST(ModelRegistry, FamilyLoraTargetsAreChosenOrRefusedByName) {
  const auto tok = data::make_char_tokenizer();
  auto config = tiny("hyena", "classification");
  config.lora.r = 2;
  config.lora.target_modules = {"fc1"};
  auto model = build_model_for(config, *tok, BuildContext{});
  int64_t adapters = 0;
  for (const auto& p : model->named_parameters()) {
    if (!is_lora_parameter(p.key())) continue;
    EXPECT_NE(p.key().find(".mlp.fc1."), std::string::npos) << p.key();
    ++adapters;
  }
  EXPECT_EQ(adapters, 2 * 2);
  config = tiny("caduceus-ps", "classification");
  config.lora.r = 2;
  config.lora.target_modules = {"in_proj", "x_proj"};
  expect_error([&] { build_model_for(config, *tok, BuildContext{}); }, ExitCode::kUsage,
               {"lora.target_modules", "x_proj", "Caduceus", "\"in_proj\", \"out_proj\""});
  config.lora.target_modules = LoraConfig().target_modules;
  config.lora.quantize_base = cfg::QuantizeBase::kNf4;
  expect_error([&] { build_model_for(config, *tok, BuildContext{}); }, ExitCode::kUsage,
               {"lora.quantize_base", "nf4", "Caduceus"});
  config = tiny("hyena", "pretrain");
  config.lora.quantize_base = cfg::QuantizeBase::kNf4;
  expect_error([&] { build_model_for(config, *tok, BuildContext{}); }, ExitCode::kUsage,
               {"lora.quantize_base", "nf4", "HyenaDNA"});
}

TEST(ModelRegistry, AModelDirectoryOfAnotherFamilyIsRefusedForModelArch) {
  const auto tok = data::make_char_tokenizer();
  auto config = tiny("bert", "pretrain");
  config.model.init_from = fixture("hyenadna_causal");
  expect_error([&] { build_model_for(config, *tok, BuildContext{}); }, ExitCode::kUsage,
               {"hyenadna_causal", "hyena", "model.arch"});
  config = tiny("hyena", "pretrain");
  config.tokenizer.kind = cfg::TokenizerKind::kKmer;
  config.model.init_from = fixture("hyenadna_causal");
  expect_error([&] { build_model_for(config, *data::make_kmer_tokenizer(3, 1), BuildContext{}); },
               ExitCode::kUsage, {"tokenizer.kind", "char"});
}

}  // namespace
}  // namespace dnallm::models
