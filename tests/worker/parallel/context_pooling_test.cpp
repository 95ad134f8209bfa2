// Note [Context-parallel pooling]: sequence classifiers of every family with context parallelism
// (HyenaDNA: the last real token; Caduceus-Ph / -PS: the mean over every position; the
// transformer: [CLS] or the masked mean, BERT in contiguous chunks and GPT in zig-zag ones), run
// by C = 2 and 4 in-process gloo ranks (threads), each on its shard of the same classification
// batch through the trainer's own input path (ContextMesh::shard, to_inputs), against the same
// model on the whole batch in one process. Every rank's logits equal the whole batch's; the loss
// and its count are context rank 0's alone (the other ranks count nothing), and every parameter's
// gradient summed over the group equals the whole batch's: 1e-6 relative (HyenaDNA, Caduceus),
// 1e-5 (attention), fp32.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/worker/parallel/context_model_run.hpp"
#include "tests/worker/parallel/context_ranks.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/caduceus/caduceus_model.hpp"
#include "worker/models/hyena/hyena_model.hpp"
#include "worker/models/transformer/transformer.hpp"
#include "worker/parallel/context_mesh.hpp"
#include "worker/parallel/context_parallel.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::parallel {
namespace {

using context_test::expect_close;
using context_test::expect_no_errors;
using context_test::forward_backward;
using context_test::run_on_ranks;
using context_test::RunResult;
using models::LanguageModel;
using torch::Tensor;

constexpr int64_t kLabels = 3;

// A classification batch of `rows` x `length` regular tokens and a class a row, framed as the
// data path frames one (right padding: [PAD] ids, attention_mask 0); the last row `short_by`
// tokens shorter.
data::Batch classification_batch(int64_t rows, int64_t length, int64_t short_by, int64_t pad_id,
                                 int64_t vocab) {
  torch::manual_seed(5);
  const auto ids =
      torch::randint(data::kFirstRegularId, vocab, {rows, length}, torch::kInt64).contiguous();
  data::Batch b;
  b.rows = rows;
  b.seq_len = length;
  b.input_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + rows * length);
  b.attention_mask.assign(static_cast<size_t>(rows * length), 1);
  for (int64_t i = length - short_by; i < length; ++i) {
    const auto at = static_cast<size_t>((rows - 1) * length + i);
    b.input_ids[at] = pad_id;
    b.attention_mask[at] = 0;
  }
  for (int64_t r = 0; r < rows; ++r) b.labels.push_back((r * 2 + 1) % kLabels);
  b.num_label_tokens = rows;
  b.padded = short_by > 0;
  return b;
}

struct Family {
  std::string name;
  // A fresh model, the same weights at every call (the reference `whole`: the arithmetic the
  // context-parallel operators reproduce, e.g. Hyena's plain operator instead of the fused one).
  std::function<LanguageModel(bool whole)> make;
  int64_t vocab = 12;
  double tolerance = 1e-6;
  double gradient_floor = 0;  // see check_against_one_rank
};

void check_against_one_rank(const Family& f, int C, int64_t length, int64_t short_by) {
  auto reference = f.make(/*whole=*/true);
  const auto& spec = reference->spec();
  ASSERT_EQ(spec.task, models::Task::kClassification) << f.name;
  const auto batch = classification_batch(3, length, short_by, spec.pad_id, f.vocab);
  const auto want = forward_backward(reference, batch, /*labels_only=*/true);
  ASSERT_EQ(want.logits.sizes(), (std::vector<int64_t>{3, kLabels})) << f.name;

  std::vector<LanguageModel> models;
  for (int r = 0; r < C; ++r) models.push_back(f.make(/*whole=*/false));
  std::vector<RunResult> got(static_cast<size_t>(C));
  expect_no_errors(run_on_ranks(C, "pool", [&](int r, comm::Communicator& world) {
    auto& model = models[static_cast<size_t>(r)];
    ContextMesh mesh(world, C, model->spec().context_layout, /*shift_labels=*/false,
                     model->spec().pad_id);
    model->set_context_parallel(mesh.model_view());
    const auto shard = mesh.shard(batch);
    mesh.select(shard.seq_len, torch::kCPU);
    got[static_cast<size_t>(r)] = forward_backward(model, shard, /*labels_only=*/true);
  }));
  if (::testing::Test::HasFailure()) return;

  const std::string tag = " " + f.name + " C=" + std::to_string(C) +
                          " T=" + std::to_string(length) + (short_by > 0 ? " padded" : "");
  double loss_sum = 0;
  int64_t loss_count = 0;
  for (int r = 0; r < C; ++r) {
    const auto& g = got[static_cast<size_t>(r)];
    // The same pooled vector and head on every rank.
    expect_close(g.logits, want.logits, "logits of rank " + std::to_string(r) + tag, f.tolerance);
    loss_sum += g.loss_sum;
    loss_count += g.loss_count;
    if (r > 0) {  // the sequence's loss is context rank 0's
      EXPECT_EQ(g.loss_sum, 0.0) << tag;
      EXPECT_EQ(g.loss_count, 0) << tag;
    }
  }
  EXPECT_EQ(loss_count, want.loss_count) << tag;
  EXPECT_NEAR(loss_sum, want.loss_sum, f.tolerance * std::abs(want.loss_sum)) << tag;
  // Some gradients are sums that cancel: attention's key biases' are zero up to rounding (a
  // softmax ignores a score added to every key of a query), and under mean pooling the final
  // norm's bias gets the pooled gradient summed over rows of either class (measured 2e-5 against
  // a largest gradient of 2e-2): the forward's 1e-7 relative rounding (attention block by block)
  // in the rows' gradients (1e-2) leaves 3e-9 in that sum. Each gradient is measured against at
  // least gradient_floor (1/10 for attention) of the largest one (worker_attention_context_
  // parallel_test: 1e-3, for a language model); HyenaDNA's and Caduceus' each against itself.
  double largest = 0;
  for (const auto& [name, grad] : want.grads)
    largest = std::max(largest, grad.abs().max().item<double>());
  double worst = 0;
  for (const auto& [name, grad] : want.grads) {
    Tensor sum = torch::zeros_like(grad);
    for (const auto& g : got) sum += g.grads.at(name);
    const double scale = std::max(grad.abs().max().item<double>(), f.gradient_floor * largest);
    const double err = (sum - grad).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
    EXPECT_LE(err, f.tolerance) << name << tag;
    worst = std::max(worst, err);
  }
  std::cout << "[ measured ] loss sum" << tag << ": relative error "
            << std::abs(loss_sum - want.loss_sum) / std::abs(want.loss_sum) << "; "
            << want.grads.size() << " parameter gradients: max relative error " << worst << "\n";
}

Family hyena() {
  return {"HyenaDNA", [](bool whole) {
            auto o = context_test::tiny_hyena();
            o.classifier = true;
            o.num_labels = kLabels;
            torch::manual_seed(11);
            models::hyena::HyenaLM lm(o);
            // Note [Hyena fused mixer]: the reference runs the plain operator, as the
            // context-parallel one computes.
            for (auto& block : lm->blocks) block->mixer->fused = !whole;
            LanguageModel model(std::make_shared<models::hyena::HyenaModelImpl>(lm));
            model->train();
            return model;
          }};
}

Family caduceus(bool rcps) {
  return {rcps ? "Caduceus-PS" : "Caduceus-Ph",
          [rcps](bool /*whole*/) {
            auto o = context_test::tiny_caduceus(rcps, /*bidirectional=*/true);
            o.classifier = true;
            o.num_labels = kLabels;
            torch::manual_seed(13);
            LanguageModel model(std::make_shared<models::caduceus::CaduceusModelImpl>(
                models::caduceus::CaduceusLM(o), 14));
            model->train();
            return model;
          },
          14};
}

Family transformer(models::Arch arch, bool mean_pooling) {
  const std::string name = std::string(arch == models::Arch::kGpt ? "GPT" : "BERT") +
                           (mean_pooling ? " mean pooling" : " [CLS]");
  return {name,
          [arch, mean_pooling](bool /*whole*/) {
            auto o = context_test::tiny_transformer(arch);
            o.task = models::Task::kClassification;
            o.num_labels = kLabels;
            o.mean_pooling = mean_pooling;
            torch::manual_seed(21);
            LanguageModel model = models::TransformerLM(o);
            model->train();
            return model;
          },
          12, 1e-5, 0.1};
}

class ContextPooling : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!context_test::gloo_available()) GTEST_SKIP() << "gloo was not built";
  }
};

// 30 positions: padded at the end to 32 by the mesh (C = 4; zig-zag: 2C = 8, C = 2 too), and a
// row padded by the batch itself.
TEST_P(ContextPooling, HyenaLastTokenClassifierEqualsOneRank) {
  check_against_one_rank(hyena(), GetParam(), 30, 5);
  check_against_one_rank(hyena(), GetParam(), 32, 0);  // no [PAD]: the last position
}

// Caduceus reads every position, padding included (as the reference): lengths the group
// divides, so that the mesh adds none.
TEST_P(ContextPooling, CaduceusMeanPoolingClassifiersEqualOneRank) {
  check_against_one_rank(caduceus(false), GetParam(), 32, 5);
  check_against_one_rank(caduceus(true), GetParam(), 32, 5);
}

TEST_P(ContextPooling, TransformerClsAndMeanPoolingClassifiersEqualOneRank) {
  for (const auto arch : {models::Arch::kBert, models::Arch::kGpt}) {
    check_against_one_rank(transformer(arch, false), GetParam(), 30, 5);
    check_against_one_rank(transformer(arch, true), GetParam(), 30, 5);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ContextPooling, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "C" + std::to_string(info.param);
                         });

// The pooling functions alone: a sum over the group whose backward sums the gradients, and the
// first position found over every rank.
TEST(ContextPoolingFunctions, AllReduceSumAndFirstPositionOverTheGroup) {
  if (!context_test::gloo_available()) GTEST_SKIP() << "gloo was not built";
  const int C = 3;
  expect_no_errors(run_on_ranks(C, "pool_fns", [&](int r, comm::Communicator& group) {
    auto x = torch::full({2}, double(r + 1), torch::kFloat64).requires_grad_(true);
    auto y = context_all_reduce_sum(x, group);
    EXPECT_TRUE(torch::allclose(y, torch::full({2}, 6.0, torch::kFloat64)));
    // d/dx_r of sum_s (s + 1) y = 1 + 2 + 3 on every rank.
    (y * double(r + 1)).sum().backward();
    EXPECT_TRUE(torch::allclose(x.grad(), torch::full({2}, 6.0, torch::kFloat64)));
    // Row 0 is set at global positions 4 and 7 (ranks 1 and 2), row 1 nowhere.
    const auto positions = torch::arange(r * 3, r * 3 + 3, torch::kInt64);
    auto where = torch::zeros({2, 3}, torch::kBool);
    if (r == 1) where[0][1] = true;
    if (r == 2) where[0][1] = true;
    const auto first = context_first_position(where, positions, 9, group);
    EXPECT_EQ(first[0].item<int64_t>(), 4);
    EXPECT_EQ(first[1].item<int64_t>(), 9);
  }));
}

// A regressor has no context-parallel form yet: one usage error on every rank.
TEST(ContextPoolingRefusals, RegressionIsOneUsageError) {
  if (!context_test::gloo_available()) GTEST_SKIP() << "gloo was not built";
  models::ModelOptions o;
  o.task = models::Task::kRegression;
  o.vocab_size = 12;
  o.hidden = 16;
  o.layers = 1;
  o.heads = 4;
  o.ffn = 32;
  o.max_seq_length = 64;
  const auto errors = run_on_ranks(2, "refuse_regression", [&](int, comm::Communicator& world) {
    ContextMesh mesh(world, 2, models::ContextLayout::kContiguous, false, 0);
    LanguageModel model = models::TransformerLM(o);
    try {
      model->set_context_parallel(mesh.model_view());
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      throw;
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("cannot train a regressor yet"), std::string::npos) << e;
  }
  data::Batch regression;
  regression.rows = 1;
  regression.seq_len = 4;
  regression.input_ids = {2, 5, 6, 7};
  regression.targets = {0.5F};
  ContextShardOptions so;
  so.context_size = 2;
  EXPECT_THROW(context_shard(regression, so), Error);
}

}  // namespace
}  // namespace dnallm::parallel
