// Note [Fully sharded exports] (worker/parallel/fully_sharded.hpp): a ZeRO-3 model exported unit
// by unit at 2 in-process gloo ranks writes the same files, byte for byte, as the same model
// gathered whole (FullParameters) and exported by rank 0, for BERT, BERT with LoRA, HyenaDNA
// and Caduceus-PS, with fp32 and bf16 gathers; and the gathered bytes peak at one unit, not the
// whole model, as the predicted peak says. The same for each family's Hugging Face layout
// (final/hf: ESM, GPT-NeoX's fused QKV, DNABERT-2's fused Wqkv and GEGLU, PEFT's adapter and
// base, HyenaDNA, Caduceus with its tied reverse projections).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "context_ranks.hpp"
#include "core/config.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/registry.hpp"
#include "worker/parallel/fully_sharded.hpp"

namespace dnallm::parallel {
namespace {

namespace fs = std::filesystem;
using context_test::expect_no_errors;
using context_test::run_on_ranks;

std::vector<char> file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every regular file under `root`, by its path relative to it.
std::vector<std::string> files_under(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) out.push_back(fs::relative(e.path(), root).string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct Case {
  std::string arch;
  int lora_r = 0;
  cfg::Precision precision = cfg::Precision::kFp32;
  std::string model_keys;  // more [model] keys
  std::string label;       // for the name, with model_keys
};

Case make_case(std::string arch, int lora_r = 0, cfg::Precision precision = cfg::Precision::kFp32,
               std::string model_keys = "", std::string label = "") {
  return {std::move(arch), lora_r, precision, std::move(model_keys), std::move(label)};
}

std::string case_name(const Case& c) {
  return fmt::format("{}{}{}_{}", c.arch, c.label.empty() ? "" : "_" + c.label,
                     c.lora_r > 0 ? "_lora" : "",
                     c.precision == cfg::Precision::kBf16 ? "bf16" : "fp32");
}

// One way of exporting: collective over `units`, rank `write` writes into `dir`.
using Exporter =
    std::function<void(models::LanguageModel& model, const data::Tokenizer& tokenizer,
                       const std::string& dir, const models::ParameterUnits& units, bool write)>;

void export_ours(models::LanguageModel& model, const data::Tokenizer&, const std::string& dir,
                 const models::ParameterUnits& units, bool write) {
  models::export_live_model(model, dir, units, write);
}

void export_hf(models::LanguageModel& model, const data::Tokenizer& tokenizer,
               const std::string& dir, const models::ParameterUnits& units, bool write) {
  models::export_hf_directory(model, tokenizer, dir, "", units, write);
}

// The gathered bytes of each export, rank 0's.
struct Peaks {
  int64_t streamed = 0, whole = 0, predicted = 0;
};

Peaks export_both_ways(const Case& c, const fs::path& dir, const Exporter& exporter) {
  Peaks peaks;
  const auto errors =
      run_on_ranks(2, "z3export_" + case_name(c), [&](int rank, comm::Communicator& comm) {
        const Config config = parse_config(
            fmt::format("[model]\narch = \"{}\"\ntask = \"pretrain\"\nhidden = 16\nlayers = 8\n"
                        "heads = 2\nffn = 32\nmax_seq_length = 64\n{}[lora]\nr = {}\n"
                        "[training]\nseed = 7\n",
                        c.arch, c.model_keys, c.lora_r),
            "z3export");
        const auto tokenizer = data::make_char_tokenizer();
        auto model = models::build_model_for(config, *tokenizer, models::BuildContext{});
        std::vector<std::pair<std::string, torch::Tensor>> named;
        for (const auto& p : model->named_parameters()) {
          if (p.value().requires_grad()) named.emplace_back(p.key(), p.value());
        }
        FullyShardedOptions options;
        options.precision = c.precision;
        FullyShardedSync sync(comm, options);
        auto flat = sync.place(model, named, torch::kCPU);
        // As training would: every rank's shard moves (LoRA's B away from 0), so each unit's
        // gathered values come from both ranks.
        torch::manual_seed(100 + rank);
        flat->params().add_(torch::randn_like(flat->params()) * 0.05);
        ASSERT_EQ(sync.memory()->gathered_peak, 0);
        exporter(
            model, *tokenizer, (dir / "streamed").string(),
            [&](const auto& visit) { sync.visit_parameter_units(visit); }, rank == 0);
        const int64_t streamed = sync.memory()->gathered_peak;
        // (before a FullParameters adds the whole model to the prediction)
        const int64_t predicted = sync.memory()->gathered_predicted;
        {
          FullParameters full(sync);
          if (rank == 0) {
            exporter(model, *tokenizer, (dir / "whole").string(), models::whole_model_units(),
                     true);
          }
        }
        if (rank == 0) peaks = {streamed, sync.memory()->gathered_peak, predicted};
      });
  expect_no_errors(errors);
  return peaks;
}

TEST(FullyShardedExport, UnitByUnitWritesTheWholeModelsFilesAndHoldsOneUnit) {
  const std::vector<Case> cases = {make_case("bert"),
                                   make_case("bert", 4),
                                   make_case("hyena"),
                                   make_case("caduceus-ps"),
                                   make_case("bert", 0, cfg::Precision::kBf16),
                                   make_case("bert", 4, cfg::Precision::kBf16),
                                   make_case("caduceus-ps", 0, cfg::Precision::kBf16)};
  for (const auto& c : cases) {
    const std::string what = case_name(c);
    const fs::path dir = fs::temp_directory_path() / ("dnallm_z3_export_" + what);
    fs::remove_all(dir);
    const Peaks peaks = export_both_ways(c, dir, export_ours);
    std::vector<std::string> files = {"model.safetensors", "config.json"};
    if (c.lora_r > 0) files.push_back("adapter_model.safetensors");
    for (const auto& f : files) {
      const auto streamed = file_bytes(dir / "streamed" / f), whole = file_bytes(dir / "whole" / f);
      EXPECT_GT(streamed.size(), 0u) << what << " " << f;
      EXPECT_TRUE(streamed == whole) << what << ": " << f << " differs";
    }
    EXPECT_EQ(fs::exists(dir / "streamed" / "adapter_model.safetensors"), c.lora_r > 0) << what;
    for (const auto& e : fs::directory_iterator(dir / "streamed")) {
      EXPECT_NE(e.path().extension(), ".tmp") << what << ": " << e.path();
    }
    std::cout << "[ measured ] ZeRO-3 export, 8 blocks, 2 ranks, " << what
              << ": gathered peak unit by unit " << peaks.streamed << " bytes, whole model "
              << peaks.whole << " bytes; predicted peak (training, no evaluation) "
              << peaks.predicted << "\n";
    // One unit of 9 (8 blocks and the root, the blocks alike): well under a third of the whole.
    EXPECT_GT(peaks.streamed, 0) << what;
    EXPECT_LT(peaks.streamed * 3, peaks.whole) << what;
    // The prediction covers the export and no longer counts the whole model for it.
    EXPECT_GE(peaks.predicted, peaks.streamed) << what;
    EXPECT_LT(peaks.predicted, peaks.whole) << what;
    fs::remove_all(dir);
  }
}

// final/hf: each family's Hugging Face layout, its fused and renamed tensors computed from one
// block at a time, LoRA merged (and PEFT's adapter and base) likewise.
TEST(FullyShardedExport, HuggingFaceLayoutUnitByUnitIsTheWholeModelsAndHoldsOneUnit) {
  const std::string dnabert2 = "position = \"alibi\"\nmlp = \"geglu\"\npost_layer_norm = true\n";
  const auto fp32 = cfg::Precision::kFp32;
  const std::vector<Case> cases = {make_case("bert"),
                                   make_case("bert", 4),
                                   make_case("gpt", 0, fp32, "position = \"rotary\"\n", "rotary"),
                                   make_case("bert", 0, fp32, dnabert2, "dnabert2"),
                                   make_case("bert", 4, fp32, dnabert2, "dnabert2"),
                                   make_case("hyena"),
                                   make_case("hyena", 4),
                                   make_case("caduceus"),
                                   make_case("caduceus-ps", 4),
                                   make_case("bert", 4, cfg::Precision::kBf16),
                                   make_case("caduceus-ps", 0, cfg::Precision::kBf16)};
  for (const auto& c : cases) {
    const std::string what = "hf_" + case_name(c);
    const fs::path dir = fs::temp_directory_path() / ("dnallm_z3_export_" + what);
    fs::remove_all(dir);
    const Peaks peaks = export_both_ways(c, dir, export_hf);
    const auto files = files_under(dir / "whole");
    ASSERT_EQ(files, files_under(dir / "streamed")) << what;
    // The layout was written, not skipped: its weights (and PEFT's, with LoRA outside DNABERT-2).
    ASSERT_TRUE(fs::exists(dir / "whole" / "model.safetensors")) << what;
    ASSERT_TRUE(fs::exists(dir / "whole" / "config.json")) << what;
    EXPECT_EQ(fs::exists(dir / "whole" / "adapter" / "adapter_model.safetensors"),
              c.lora_r > 0 && (c.arch == "bert" && c.label.empty()))
        << what;
    for (const auto& f : files) {
      if (f == "adapter/adapter_config.json") continue;  // names its base by absolute path
      const auto streamed = file_bytes(dir / "streamed" / f), whole = file_bytes(dir / "whole" / f);
      EXPECT_GT(streamed.size(), 0u) << what << " " << f;
      EXPECT_TRUE(streamed == whole) << what << ": " << f << " differs";
    }
    std::cout << "[ measured ] ZeRO-3 Hugging Face export, 8 blocks, 2 ranks, " << what << " ("
              << files.size() << " files): gathered peak unit by unit " << peaks.streamed
              << " bytes, whole model " << peaks.whole << " bytes\n";
    EXPECT_GT(peaks.streamed, 0) << what;
    EXPECT_LT(peaks.streamed * 3, peaks.whole) << what;
    EXPECT_GE(peaks.predicted, peaks.streamed) << what;
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace dnallm::parallel
