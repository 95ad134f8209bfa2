// Note [Data x context mesh] and Note [Context parallelism in a model] for HyenaDNA: the mesh's
// pure policy (coordinates, positions, the batch cut), then a HyenaDNA model run by C = 2 and 4
// in-process gloo ranks (threads), each on its shard of the same batch through the trainer's
// own input path (context_shard, to_inputs), against the same model on the whole batch in one
// process: logits, the loss sum and every parameter's gradient summed over the group, within
// 1e-6 relative in fp32.
#include "worker/parallel/context_mesh.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "comm/make_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/worker/parallel/context_model_run.hpp"
#include "tests/worker/parallel/context_ranks.hpp"
#include "worker/models/hyena/hyena_model.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::parallel {
namespace {

using dnallm::testing::expect_error;

using models::ContextLayout;
using torch::Tensor;

constexpr double kMeshTolerance = 1e-6;

using context_test::expect_no_errors;
using context_test::forward_backward;
using context_test::relative_error;
using context_test::run_on_ranks;
using context_test::RunResult;

// ---------------------------------------------------------------------------------------------
// The mesh's policy

TEST(MeshCoordinates, ContextGroupsAreConsecutiveRanksAndDataRanksCountGroups) {
  const auto c = mesh_coordinates(5, 8, 2);
  EXPECT_EQ(c.context_rank, 1);
  EXPECT_EQ(c.context_size, 2);
  EXPECT_EQ(c.data_rank, 2);
  EXPECT_EQ(c.data_world, 4);
  const auto one = mesh_coordinates(3, 4, 1);
  EXPECT_EQ(one.data_rank, 3);
  EXPECT_EQ(one.data_world, 4);
  EXPECT_EQ(one.context_rank, 0);
}

TEST(MeshCoordinates, ADegreeThatDoesNotDivideTheWorldIsOneUsageError) {
  expect_error([&] { mesh_coordinates(0, 6, 4); }, ExitCode::kUsage,
               {"parallel.context_parallel = 4 does not divide the "
                "world size 6"});
  EXPECT_THROW(mesh_coordinates(0, 1, 2), Error);
  EXPECT_THROW(mesh_coordinates(0, 2, 0), Error);
}

TEST(ContextPositions, ContiguousAndZigZagChunks) {
  EXPECT_EQ(context_positions(ContextLayout::kContiguous, 8, 2, 1),
            (std::vector<int64_t>{4, 5, 6, 7}));
  // 2C = 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(context_positions(ContextLayout::kZigZag, 8, 2, 0), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(context_positions(ContextLayout::kZigZag, 8, 2, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  // Every position exactly once over the group.
  for (auto layout : {ContextLayout::kContiguous, ContextLayout::kZigZag}) {
    std::vector<int> seen(24, 0);
    for (int r = 0; r < 3; ++r) {
      for (auto p : context_positions(layout, 24, 3, r)) ++seen[static_cast<size_t>(p)];
    }
    EXPECT_EQ(seen, std::vector<int>(24, 1));
  }
  EXPECT_EQ(context_length_multiple(ContextLayout::kZigZag, 4), 8);
  EXPECT_EQ(context_length_multiple(ContextLayout::kContiguous, 4), 4);
}

// Two rows of 5 tokens: ids 10.., labels = ids but the first (-100), the second row padded.
data::Batch small_batch() {
  data::Batch b;
  b.rows = 2;
  b.seq_len = 5;
  b.input_ids = {10, 11, 12, 13, 14, 20, 21, 22, 4, 4};
  b.attention_mask = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
  b.labels = {-100, 11, 12, 13, 14, -100, 21, 22, -100, -100};
  b.sample_ids = {7, 8};
  b.num_label_tokens = 6;
  b.num_bases = 6;
  return b;
}

// What context ranks 0 and 1 of a group of two hold of `whole` under `o`.
std::pair<data::Batch, data::Batch> two_shards(const data::Batch& whole, ContextShardOptions o) {
  o.context_size = 2;
  o.context_rank = 0;
  data::Batch first = context_shard(whole, o);
  o.context_rank = 1;
  return {std::move(first), context_shard(whole, o)};
}

TEST(ContextShard, CausalLabelsAreShiftedOnTheWholeSequenceThenCut) {
  ContextShardOptions o;
  o.shift_labels = true;
  o.pad_id = 4;
  // T = 5 padded to 6: rank 0 holds positions 0..2, rank 1 positions 3..5.
  const auto [first, second] = two_shards(small_batch(), o);
  EXPECT_EQ(first.seq_len, 3);
  EXPECT_EQ(first.input_ids, (std::vector<int64_t>{10, 11, 12, 20, 21, 22}));
  // Position 2 predicts token 3, which lives on the next rank.
  EXPECT_EQ(first.labels, (std::vector<int64_t>{11, 12, 13, 21, 22, -100}));
  EXPECT_EQ(second.input_ids, (std::vector<int64_t>{13, 14, 4, 4, 4, 4}));
  EXPECT_EQ(second.attention_mask, (std::vector<int64_t>{1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(second.labels, (std::vector<int64_t>{14, -100, -100, -100, -100, -100}));
  // Counts are the shard's own: summed over the group, the whole batch's (after the shift).
  EXPECT_EQ(first.num_label_tokens + second.num_label_tokens, 6);
  EXPECT_EQ(first.num_bases + second.num_bases, 6);
  EXPECT_FALSE(*first.padded);
  EXPECT_TRUE(*second.padded);
  EXPECT_EQ(second.sample_ids, (std::vector<uint64_t>{7, 8}));
}

TEST(ContextShard, ZigZagChunksTakeTheirShiftedLabelsAlong) {
  ContextShardOptions o;
  o.layout = ContextLayout::kZigZag;
  o.shift_labels = true;
  o.pad_id = 4;
  // T = 5 padded to 8 (2C = 4 chunks of 2): rank 0 holds positions 0, 1, 6, 7, rank 1 2..5.
  const auto [first, second] = two_shards(small_batch(), o);
  EXPECT_EQ(first.seq_len, 4);
  EXPECT_EQ(first.input_ids, (std::vector<int64_t>{10, 11, 4, 4, 20, 21, 4, 4}));
  EXPECT_EQ(first.labels, (std::vector<int64_t>{11, 12, -100, -100, 21, 22, -100, -100}));
  EXPECT_EQ(second.input_ids, (std::vector<int64_t>{12, 13, 14, 4, 22, 4, 4, 4}));
  EXPECT_EQ(second.labels, (std::vector<int64_t>{13, 14, -100, -100, -100, -100, -100, -100}));
  EXPECT_EQ(second.attention_mask, (std::vector<int64_t>{1, 1, 1, 0, 1, 0, 0, 0}));
  EXPECT_EQ(first.num_label_tokens + second.num_label_tokens, 6);
}

TEST(ContextShard, PackedOrRegressionBatchesAreOneUsageError) {
  ContextShardOptions o;
  o.context_size = 2;
  auto packed = small_batch();
  packed.segment_ids.assign(10, 1);
  expect_error([&] { context_shard(packed, o); }, ExitCode::kUsage, {"data.packing = false"});
  auto regression = small_batch();
  regression.labels.clear();
  regression.targets = {0.5F, 1.5F};
  EXPECT_THROW(context_shard(regression, o), Error);
}

// Note [Context-parallel pooling]: a classification batch's positions are cut as a language
// model's, its labels (one a row) stay on context rank 0, and only there are they counted.
TEST(ContextShard, ClassificationLabelsStayOnContextRankZero) {
  auto classification = small_batch();
  classification.labels = {0, 1};
  classification.num_label_tokens = 2;
  const auto [first, second] = two_shards(classification, ContextShardOptions{});
  EXPECT_EQ(first.labels, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(second.labels, (std::vector<int64_t>{data::kIgnoreIndex, data::kIgnoreIndex}));
  EXPECT_EQ(first.num_label_tokens, 2);
  EXPECT_EQ(second.num_label_tokens, 0);
  // 5 positions padded to 6: [0, 3) and [3, 6).
  EXPECT_EQ(first.input_ids, (std::vector<int64_t>{10, 11, 12, 20, 21, 22}));
  EXPECT_EQ(second.input_ids, (std::vector<int64_t>{13, 14, 0, 4, 4, 0}));
  EXPECT_EQ(second.attention_mask, (std::vector<int64_t>{1, 1, 0, 0, 0, 0}));
}

// ---------------------------------------------------------------------------------------------
// HyenaDNA, C ranks vs 1

using context_test::tiny_hyena;

// `fused`: Note [Hyena fused mixer] on the CPU (the default); false runs the plain operator, the
// arithmetic of the context-parallel one, so that a whole-sequence reference isolates the context
// parallelism to float rounding of the same operations.
models::LanguageModel make_hyena(const models::hyena::HyenaOptions& o, bool checkpointing,
                                 bool fused = true) {
  torch::manual_seed(11);
  models::hyena::HyenaLM lm(o);
  for (auto& block : lm->blocks) block->mixer->fused = fused;
  models::LanguageModel model(std::make_shared<models::hyena::HyenaModelImpl>(lm));
  model->set_activation_checkpointing(checkpointing);
  model->train();
  return model;
}

// A causal LM batch of `rows` x `length` random regular tokens, framed as the data path does
// (the first label ignored); the last row `short_by` tokens shorter (padded).
data::Batch random_batch(int64_t rows, int64_t length, int64_t short_by = 0) {
  torch::manual_seed(5);
  const auto ids = torch::randint(5, 12, {rows, length}, torch::kInt64).contiguous();
  data::Batch b;
  b.rows = rows;
  b.seq_len = length;
  b.input_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + rows * length);
  b.attention_mask.assign(static_cast<size_t>(rows * length), 1);
  b.labels = b.input_ids;
  for (int64_t r = 0; r < rows; ++r) b.labels[static_cast<size_t>(r * length)] = data::kIgnoreIndex;
  for (int64_t i = length - short_by; i < length; ++i) {
    const auto at = static_cast<size_t>((rows - 1) * length + i);
    b.input_ids[at] = 4;
    b.attention_mask[at] = 0;
    b.labels[at] = data::kIgnoreIndex;
  }
  for (auto l : b.labels) b.num_label_tokens += l != data::kIgnoreIndex;
  b.padded = short_by > 0;
  return b;
}

struct CpCase {
  int context = 2;
  bool checkpointing = false;
  int64_t length = 32;   // whole length of the batch
  int64_t short_by = 0;  // padding of the last row
};

void check_hyena_against_one_rank(const CpCase& c) {
  const auto options = tiny_hyena();
  const auto batch = random_batch(2, c.length, c.short_by);
  auto whole_model = make_hyena(options, c.checkpointing, /*fused=*/false);
  const auto want = forward_backward(whole_model, batch);

  const int C = c.context;
  std::vector<models::LanguageModel> models;
  for (int r = 0; r < C; ++r) models.push_back(make_hyena(options, c.checkpointing));
  std::vector<RunResult> got(static_cast<size_t>(C));
  expect_no_errors(run_on_ranks(C, "hyena_cp", [&](int r, comm::Communicator& world) {
    ContextMesh mesh(world, C, ContextLayout::kContiguous, /*shift_labels=*/true, 4);
    auto& model = models[static_cast<size_t>(r)];
    model->set_context_parallel(mesh.model_view());
    EXPECT_FALSE(model->spec().shift_labels);  // the data path shifted them
    const auto shard = mesh.shard(batch);
    mesh.select(shard.seq_len, torch::kCPU);
    got[static_cast<size_t>(r)] = forward_backward(model, shard);
  }));
  if (::testing::Test::HasFailure()) return;

  const std::string tag = " C=" + std::to_string(C) + (c.checkpointing ? " checkpointed" : "") +
                          " T=" + std::to_string(c.length);
  std::vector<Tensor> logits;
  double loss_sum = 0;
  int64_t loss_count = 0;
  for (const auto& g : got) {
    logits.push_back(g.logits);
    loss_sum += g.loss_sum;
    loss_count += g.loss_count;
  }
  const auto all_logits = torch::cat(logits, 1).narrow(1, 0, c.length);
  double worst = relative_error(all_logits, want.logits);
  std::cout << "[ measured ] logits" << tag << ": max relative error " << worst << "\n";
  EXPECT_LE(worst, kMeshTolerance) << "logits" << tag;
  EXPECT_EQ(loss_count, want.loss_count);
  EXPECT_NEAR(loss_sum, want.loss_sum, kMeshTolerance * std::abs(want.loss_sum)) << tag;
  worst = 0;
  for (const auto& [name, grad] : want.grads) {
    Tensor sum = torch::zeros_like(grad);
    for (const auto& g : got) sum += g.grads.at(name);
    const double err = relative_error(sum, grad);
    EXPECT_LE(err, kMeshTolerance) << name << tag;
    worst = std::max(worst, err);
  }
  std::cout << "[ measured ] " << want.grads.size() << " parameter gradients" << tag
            << ": max relative error " << worst << "\n";
}

class HyenaContextParallel : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!comm::backend_available("gloo")) GTEST_SKIP() << "gloo was not built";
  }
};

TEST_P(HyenaContextParallel, LogitsLossAndGradientsEqualOneRank) {
  check_hyena_against_one_rank({GetParam(), false, 32, 0});
}

TEST_P(HyenaContextParallel, WithActivationCheckpointingToo) {
  check_hyena_against_one_rank({GetParam(), true, 32, 0});
}

TEST_P(HyenaContextParallel, ALengthNotDivisibleByTheGroupIsPaddedAtTheEnd) {
  // 30 = 4 x 7 + 2 and 2 x 15: padded to 32 (C = 4) or not at all (C = 2); a padded row too.
  check_hyena_against_one_rank({GetParam(), false, 30, 3});
}

INSTANTIATE_TEST_SUITE_P(Ranks, HyenaContextParallel, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "C" + std::to_string(info.param);
                         });

// What HyenaDNA cannot do under context parallelism says so on every rank, before any
// communication, as Error(kUsage).
TEST(HyenaContextParallelRefusals, ChunkingAndIndivisibleWidth) {
  if (!comm::backend_available("gloo")) GTEST_SKIP() << "gloo was not built";
  struct Refusal {
    std::string what, message;
    std::function<void(models::hyena::HyenaOptions&)> change;
  };
  const std::vector<Refusal> refusals = {
      {"chunked", "model.chunk_positions", [](auto& o) { o.chunking.positions = 8; }},
      {"width", "model.hidden = 6", [](auto& o) { o.d_model = 6; }},
  };
  for (const auto& refusal : refusals) {
    auto options = tiny_hyena();
    refusal.change(options);
    std::vector<models::LanguageModel> models;
    for (int r = 0; r < 4; ++r) models.push_back(make_hyena(options, false));
    const auto errors =
        run_on_ranks(4, "refuse_" + refusal.what, [&](int r, comm::Communicator& w) {
          ContextMesh mesh(w, 4, ContextLayout::kContiguous, true, 4);
          try {
            models[static_cast<size_t>(r)]->set_context_parallel(mesh.model_view());
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ExitCode::kUsage);
            throw;
          }
        });
    for (const auto& e : errors) {
      EXPECT_NE(e.find(refusal.message), std::string::npos) << refusal.what << ": " << e;
      EXPECT_NE(e.find("parallel.context_parallel"), std::string::npos) << e;
    }
  }
}

}  // namespace
}  // namespace dnallm::parallel
