// Note [Streamed build] (worker/models/block_hooks.hpp): a fresh model built under ZeRO-3 hands
// each block to the sync as it is built, so no rank ever holds more than one block of it whole.
// At 1 and 2 in-process gloo ranks, for every family: no block holds storage between the build
// and placement, the most block bytes whole at once is the largest block's, not the model's,
// and (one rank) the placed parameters are the whole build's, bit for bit (the same random
// numbers in the same order).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "context_ranks.hpp"
#include "core/config.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/lora_linear.hpp"
#include "worker/models/registry.hpp"
#include "worker/parallel/fully_sharded.hpp"

namespace dnallm::parallel {
namespace {

using context_test::expect_no_errors;
using context_test::run_on_ranks;

std::vector<std::pair<std::string, torch::Tensor>> trainable(models::LanguageModel& model) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& p : model->named_parameters()) {
    if (p.value().requires_grad()) named.emplace_back(p.key(), p.value());
  }
  return named;
}

// Bytes of each block's fp32 parameters, trainable or frozen (a LoRA base; a parameter counted
// with the first block that has it) and of its quantized base (QLoRA), and what their storage
// holds now.
struct BlockBytes {
  int64_t largest = 0, total = 0, allocated = 0;
};

BlockBytes block_bytes(models::LanguageModel& model) {
  BlockBytes b;
  std::set<const void*> seen;
  for (const auto& block : model->blocks()) {
    int64_t bytes = 0;
    for (const auto& p : block->parameters()) {
      if (p.scalar_type() != torch::kFloat32 || !seen.insert(p.unsafeGetTensorImpl()).second) {
        continue;
      }
      bytes += p.numel() * int64_t(p.element_size());
      b.allocated += int64_t(p.storage().nbytes());
    }
    for (const auto& t : models::quantized_storage(*block)) {
      bytes += t.numel() * int64_t(t.element_size());
      b.allocated += int64_t(t.storage().nbytes());
    }
    b.largest = std::max(b.largest, bytes);
    b.total += bytes;
  }
  return b;
}

TEST(StreamedBuild, ShardsAreTheWholeBuildsAndOneBlockIsWholeAtATime) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bert", ""},
      {"bert", "position = \"alibi\"\nmlp = \"geglu\"\npost_layer_norm = true\n"},  // DNABERT-2
      {"gpt", "position = \"rotary\"\n"},
      {"hyena", ""},
      {"caduceus", ""},
      {"caduceus-ps", ""}};
  for (const auto& [arch, keys] : cases) {
    for (const int world : {1, 2}) {
      const std::string what = fmt::format(
          "{}{}, {} rank(s)", arch, keys.empty() ? "" : " (" + keys.substr(0, 16) + "...)", world);
      const auto errors = run_on_ranks(
          world, fmt::format("streamed_build_{}_{}", arch, world),
          [&](int rank, comm::Communicator& comm) {
            const Config config = parse_config(
                fmt::format("[model]\narch = \"{}\"\ntask = \"pretrain\"\nhidden = 16\n"
                            "layers = 6\nheads = 2\nffn = 32\nmax_seq_length = 64\n{}"
                            "[training]\nseed = 11\n",
                            arch, keys),
                "streamed_build");
            ASSERT_TRUE(models::streams_blocks(config));
            const auto tokenizer = data::make_char_tokenizer();
            FullyShardedSync sync(comm, FullyShardedOptions{});
            models::BuildContext context;
            context.blocks = sync.block_sink(torch::kCPU);
            auto model = models::build_model_for(config, *tokenizer, context);
            // Between the build and placement no block holds its parameters' storage.
            const BlockBytes built = block_bytes(model);
            EXPECT_EQ(built.allocated, 0) << what;
            EXPECT_GT(built.total, 0) << what;
            auto flat = sync.place(model, trainable(model), torch::kCPU);
            const auto memory = *sync.memory();
            EXPECT_EQ(memory.build_held_peak, built.largest) << what;
            EXPECT_EQ(memory.build_whole, built.total) << what;
            if (rank == 0) {
              std::cout << "[ measured ] streamed build, " << what << ", 6 blocks: at most "
                        << memory.build_held_peak << " of the blocks' " << memory.build_whole
                        << " bytes whole at once\n";
            }
            if (world > 1) return;
            // One rank: its shard is the whole model. In-process ranks share LibTorch's one
            // CPU generator, so only a lone rank's build draws the seeded sequence alone; more
            // ranks against DDP: the integration tests' ZeRO-3 runs, built this way.
            auto whole = models::build_model_for(config, *tokenizer, models::BuildContext{});
            const BlockBytes whole_bytes = block_bytes(whole);
            EXPECT_EQ(whole_bytes.allocated, whole_bytes.total) << what;
            EXPECT_EQ(whole_bytes.total, built.total) << what;
            FullyShardedSync whole_sync(comm, FullyShardedOptions{});
            auto whole_flat = whole_sync.place(whole, trainable(whole), torch::kCPU);
            EXPECT_EQ(whole_sync.memory()->build_whole, 0) << what;
            EXPECT_TRUE(torch::equal(flat->params(), whole_flat->params())) << what;
            ASSERT_EQ(flat->entries().size(), whole_flat->entries().size()) << what;
            for (size_t i = 0; i < flat->entries().size(); ++i) {
              EXPECT_EQ(flat->entries()[i].name, whole_flat->entries()[i].name) << what;
              EXPECT_EQ(flat->entries()[i].offset, whole_flat->entries()[i].offset) << what;
            }
          });
      expect_no_errors(errors);
    }
  }
}

// `config` built under ZeRO-3's sink: no block holds storage before placement, one block was
// whole at a time, and the placed shard is the one of the model built whole (every value from
// the file, so at any number of in-process ranks; LoRA's adapters are drawn, so at one). With
// LoRA also the frozen base's shards, and each adapter's start.
void expect_streamed_is_whole(const Config& config, const data::Tokenizer& tokenizer,
                              comm::Communicator& comm, const std::string& what) {
  auto whole = models::build_model_for(config, tokenizer, models::BuildContext{});
  FullyShardedSync whole_sync(comm, FullyShardedOptions{});
  auto whole_flat = whole_sync.place(whole, trainable(whole), torch::kCPU);

  FullyShardedSync sync(comm, FullyShardedOptions{});
  models::BuildContext context;
  context.blocks = sync.block_sink(torch::kCPU);
  auto model = models::build_model_for(config, tokenizer, context);
  const BlockBytes built = block_bytes(model);
  EXPECT_EQ(built.allocated, 0) << what;
  auto flat = sync.place(model, trainable(model), torch::kCPU);
  EXPECT_TRUE(torch::equal(flat->params(), whole_flat->params()))
      << what << ", rank " << comm.rank();
  EXPECT_EQ(sync.memory()->build_held_peak, built.largest) << what;
  EXPECT_EQ(sync.memory()->build_whole, built.total) << what;
  EXPECT_LT(built.largest, built.total) << what;  // more than one block
  if (config.lora.r == 0) return;
  // Every frozen base parameter is this rank's shard of the whole build's (Note [Fully sharded
  // frozen base]), and so is a QLoRA base's every code and scale (Note [Fully sharded quantized
  // base]): gathered, they are equal. The adapters trained are the same ones.
  const auto names = [](models::LanguageModel& m) {
    std::vector<std::string> out;
    for (const auto& [name, p] : trainable(m)) out.push_back(name);
    return out;
  };
  EXPECT_EQ(names(model), names(whole)) << what;
  EXPECT_GT(names(model).size(), 0u) << what;
  auto gathered = [](FullyShardedSync& s, models::LanguageModel& m) {
    FullParameters all(s);
    std::vector<torch::Tensor> out;
    for (const auto& p : m->parameters()) {
      if (!p.requires_grad()) out.push_back(p.detach().clone());
    }
    for (const auto& block : m->blocks()) {
      for (const auto& t : models::quantized_storage(*block)) out.push_back(t.clone());
    }
    return out;
  };
  const auto a = gathered(sync, model), b = gathered(whole_sync, whole);
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_GT(a.size(), 0u) << what;
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(torch::equal(a[k], b[k])) << what << " " << k;
}

// The [model] table of a pretraining BERT of 2 heads and up to 64 positions.
std::string bert_shape(int hidden, int layers, int ffn) {
  return fmt::format(
      "[model]\narch = \"bert\"\ntask = \"pretrain\"\nhidden = {}\nlayers = {}\nheads = 2\n"
      "ffn = {}\nmax_seq_length = 64\n",
      hidden, layers, ffn);
}

// One of our directories, <temp>/<name> (returned): a model of `shape` (another seed), every
// weight moved off its initial value.
std::filesystem::path write_base(const std::string& name, const std::string& shape,
                                 const data::Tokenizer& tokenizer) {
  const auto dir = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(dir);
  auto base = models::build_model_for(parse_config(shape + "[training]\nseed = 3\n", "base"),
                                      tokenizer, models::BuildContext{});
  torch::NoGradGuard no_grad;
  for (auto& p : base->parameters()) p.add_(torch::randn_like(p) * 0.1);
  models::export_live_model(base, dir.string());
  return dir;
}

// model.init_from = one of our directories (the transformer family): each block is filled from
// the file as it is built, then sharded. Every value comes from the file, so at 2 ranks too the
// placed shards are those of the model built whole and loaded.
TEST(StreamedBuild, InitFromOurDirectoryFillsEachBlockAsItIsBuilt) {
  const auto tokenizer = data::make_char_tokenizer();
  const std::string shape = bert_shape(16, 6, 32);
  const auto dir = write_base("dnallm_streamed_build_init_from", shape, *tokenizer);
  const Config config =
      parse_config(shape + fmt::format("init_from = \"{}\"\n[training]\nseed = 11\n", dir.string()),
                   "init_from");
  ASSERT_TRUE(models::streams_blocks(config));
  expect_no_errors(run_on_ranks(2, "streamed_init_from", [&](int, comm::Communicator& comm) {
    expect_streamed_is_whole(config, *tokenizer, comm, "init_from our directory");
  }));
  // Note [LoRA block by block]: with LoRA and QLoRA, fresh and from the directory (one rank:
  // the adapters are drawn).
  for (const std::string& from : {std::string(), dir.string()}) {
    for (const std::string quantize : {"", "quantize_base = \"nf4\"\n"}) {
      const Config lora =
          parse_config(shape + (from.empty() ? "" : fmt::format("init_from = \"{}\"\n", from)) +
                           "[lora]\nr = 4\ntarget_modules = [\"query\", \"value\", \"dense\"]\n" +
                           quantize + "[training]\nseed = 11\n",
                       "lora");
      ASSERT_TRUE(models::streams_blocks(lora));
      const std::string what =
          fmt::format("{}, init_from \"{}\"", quantize.empty() ? "LoRA" : "QLoRA", from);
      expect_no_errors(run_on_ranks(1, "streamed_lora", [&](int, comm::Communicator& comm) {
        expect_streamed_is_whole(lora, *tokenizer, comm, what);
      }));
    }
  }
  std::filesystem::remove_all(dir);
}

// Note [Fully sharded quantized base]: under QLoRA a rank keeps its chunk of every block's NF4
// codes and scales, not all of them as DDP does. At 2 ranks: none of them holds storage between
// uses, the rank's frozen bytes count about half of the base, and gathered (FullParameters) they
// are bit for bit the codes of the model quantized whole (its values all come from the file).
TEST(StreamedBuild, QloraBaseIsShardedWithItsBlocks) {
  const auto tokenizer = data::make_char_tokenizer();
  const std::string shape = bert_shape(32, 4, 64);
  const auto dir = write_base("dnallm_streamed_build_qlora", shape, *tokenizer);
  const Config config = parse_config(
      shape + fmt::format("init_from = \"{}\"\n[lora]\nr = 4\nquantize_base = \"nf4\"\n"
                          "[training]\nseed = 11\n",
                          dir.string()),
      "qlora");
  ASSERT_TRUE(models::streams_blocks(config));
  const auto codes = [](models::LanguageModel& m) {
    std::vector<torch::Tensor> out;
    for (const auto& block : m->blocks()) {
      for (const auto& t : models::quantized_storage(*block)) out.push_back(t);
    }
    return out;
  };
  expect_no_errors(run_on_ranks(2, "streamed_qlora", [&](int rank, comm::Communicator& comm) {
    auto whole = models::build_model_for(config, *tokenizer, models::BuildContext{});
    const auto expected = codes(whole);
    int64_t base_bytes = 0;
    for (const auto& t : expected) base_bytes += t.numel() * int64_t(t.element_size());
    ASSERT_GT(expected.size(), 0u);
    ASSERT_GT(base_bytes, 0);

    FullyShardedSync sync(comm, FullyShardedOptions{});
    models::BuildContext context;
    context.blocks = sync.block_sink(torch::kCPU);
    auto model = models::build_model_for(config, *tokenizer, context);
    auto flat = sync.place(model, trainable(model), torch::kCPU);
    const auto sharded = codes(model);
    ASSERT_EQ(sharded.size(), expected.size());
    for (const auto& t : sharded) EXPECT_EQ(t.storage().nbytes(), 0u);
    const auto memory = *sync.memory();
    // Held: this rank's chunk of each block's frozen buffer (fp32 norms and biases, then the
    // NF4 bytes) and the root's frozen parameters whole.
    // Each piece is padded to 64 bytes in the buffer.
    int64_t root_frozen = 0, pieces = int64_t(expected.size());
    std::set<const void*> in_blocks;
    for (const auto& block : model->blocks()) {
      for (const auto& p : block->parameters()) {
        if (!p.requires_grad() && in_blocks.insert(p.unsafeGetTensorImpl()).second) ++pieces;
      }
    }
    for (const auto& p : model->parameters()) {
      if (!p.requires_grad() && !in_blocks.count(p.unsafeGetTensorImpl())) {
        root_frozen += p.numel() * int64_t(p.element_size());
      }
    }
    const int64_t block_frozen = memory.frozen_total - root_frozen;  // NF4 bytes included
    EXPECT_GT(block_frozen, base_bytes);
    EXPECT_GE(memory.frozen_held - root_frozen, block_frozen / 2);
    EXPECT_LE(memory.frozen_held - root_frozen, block_frozen / 2 + pieces * 64);
    if (rank == 0) {
      std::cout << "[ measured ] QLoRA, 2 ranks, 4 blocks: " << memory.frozen_held << " of "
                << memory.frozen_total << " frozen bytes held by a rank (NF4 base " << base_bytes
                << " bytes)\n";
    }
    {
      FullParameters all(sync);
      for (size_t k = 0; k < expected.size(); ++k) {
        EXPECT_TRUE(torch::equal(sharded[k], expected[k])) << k;
      }
    }
    for (const auto& t : sharded) EXPECT_EQ(t.storage().nbytes(), 0u);
  }));
  std::filesystem::remove_all(dir);
}

// model.init_from = a Hugging Face directory (Note [Lazy Hugging Face import]): each block is
// filled from the file as it is built (fused and split tensors read from the file's header
// positions), then sharded; the root after the build. The placed shards are those of the model
// imported whole. At 2 in-process ranks for the layouts whose every value comes from the file;
// at 1 rank also for those with fresh rows (a causal model has no [MASK]: both ranks' threads
// would draw those from LibTorch's one generator).
TEST(StreamedBuild, InitFromAHuggingFaceDirectoryFillsEachBlockAsItIsBuilt) {
  struct Case {
    const char* fixture;
    const char* arch;
    const char* tokenizer;
    int world;
  } cases[] = {
      {"bert_mlm", "bert", "kind = \"kmer\"\nk = 3\nstride = 1\n", 2},  // token-type weights
      {"esm_v2_mlm", "bert", "kind = \"nt\"\n", 2},       // NT-v2: gated dense split in halves
      {"esm_v1_mlm", "bert", "kind = \"nt\"\n", 2},       // positions after another pad id
      {"gptneox_causal", "gpt", "kind = \"char\"\n", 1},  // per-head fused query_key_value
      {"llama_gqa_causal", "gpt", "kind = \"char\"\n", 1}};
  for (const auto& c : cases) {
    const std::string dir = std::string(DNALLM_HF_FIXTURES) + "/" + c.fixture;
    const Config config = parse_config(
        fmt::format("[model]\narch = \"{}\"\ntask = \"pretrain\"\nmax_seq_length = 60\n"
                    "init_from = \"{}\"\n[tokenizer]\n{}[training]\nseed = 11\n",
                    c.arch, dir, c.tokenizer),
        "init_from_hf");
    ASSERT_TRUE(models::streams_blocks(config)) << c.fixture;
    const auto tokenizer = data::make_tokenizer(config);
    expect_no_errors(run_on_ranks(c.world, fmt::format("streamed_hf_{}", c.fixture),
                                  [&](int, comm::Communicator& comm) {
                                    expect_streamed_is_whole(config, *tokenizer, comm, c.fixture);
                                  }));
  }
}

}  // namespace
}  // namespace dnallm::parallel
