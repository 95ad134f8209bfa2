// Note [Fully sharded exports] (worker/parallel/fully_sharded.hpp): a ZeRO-3 model exported unit
// by unit at 2 in-process gloo ranks writes the same files, byte for byte, as the same model
// gathered whole (FullParameters) and exported by rank 0, for BERT, BERT with LoRA, HyenaDNA
// and Caduceus-PS, with fp32 and bf16 gathers; and the gathered bytes peak at one unit, not the
// whole model, as the predicted peak says.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
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

struct Case {
  std::string arch;
  int lora_r = 0;
  cfg::Precision precision = cfg::Precision::kFp32;
};

std::string case_name(const Case& c) {
  return fmt::format("{}{}_{}", c.arch, c.lora_r > 0 ? "_lora" : "",
                     c.precision == cfg::Precision::kBf16 ? "bf16" : "fp32");
}

// The gathered bytes of each export, rank 0's.
struct Peaks {
  int64_t streamed = 0, whole = 0, predicted = 0;
};

Peaks export_both_ways(const Case& c, const fs::path& dir) {
  Peaks peaks;
  const auto errors =
      run_on_ranks(2, "z3export_" + case_name(c), [&](int rank, comm::Communicator& comm) {
        const Config config = parse_config(
            fmt::format("[model]\narch = \"{}\"\ntask = \"pretrain\"\nhidden = 16\nlayers = 8\n"
                        "heads = 2\nffn = 32\nmax_seq_length = 64\n[lora]\nr = {}\n"
                        "[training]\nseed = 7\n",
                        c.arch, c.lora_r),
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
        models::export_live_model(
            model, (dir / "streamed").string(),
            [&](const auto& visit) { sync.visit_parameter_units(visit); }, rank == 0);
        const int64_t streamed = sync.memory()->gathered_peak;
        // (before a FullParameters adds the whole model to the prediction)
        const int64_t predicted = sync.memory()->gathered_predicted;
        {
          FullParameters full(sync);
          if (rank == 0) models::export_live_model(model, (dir / "whole").string());
        }
        if (rank == 0) peaks = {streamed, sync.memory()->gathered_peak, predicted};
      });
  expect_no_errors(errors);
  return peaks;
}

TEST(FullyShardedExport, UnitByUnitWritesTheWholeModelsFilesAndHoldsOneUnit) {
  const std::vector<Case> cases = {{"bert"},
                                   {"bert", 4},
                                   {"hyena"},
                                   {"caduceus-ps"},
                                   {"bert", 0, cfg::Precision::kBf16},
                                   {"bert", 4, cfg::Precision::kBf16},
                                   {"caduceus-ps", 0, cfg::Precision::kBf16}};
  for (const auto& c : cases) {
    const std::string what = case_name(c);
    const fs::path dir = fs::temp_directory_path() / ("dnallm_z3_export_" + what);
    fs::remove_all(dir);
    const Peaks peaks = export_both_ways(c, dir);
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

}  // namespace
}  // namespace dnallm::parallel
