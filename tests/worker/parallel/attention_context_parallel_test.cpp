// Note [Attention context parallelism] with real Gloo groups of 2 and 4 ranks in one process:
// whole transformer models behind the model interface, each rank holding its positions of every
// sequence (contiguous for the bidirectional BERTs, zig-zag chunks r and 2C-1-r for the causal
// Llama), against one rank on the whole sequence: logits, the summed loss and every parameter's
// gradient (summed over the ranks). A key block in the wrong order, a causal mask by local instead
// of global positions, rotary or ALiBi by local positions, or a padding mask not gathered fails
// these.
#include "worker/models/transformer/context_attention.hpp"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/worker/parallel/context_ranks.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::models {
namespace {

using parallel::context_test::expect_no_errors;
using parallel::context_test::gloo_available;
using parallel::context_test::relative_error;
using parallel::context_test::run_on_ranks;
using torch::Tensor;

constexpr double kTolerance = 1e-5;

// This rank's global positions of a sequence of `length`: contiguous [r T / C, (r + 1) T / C),
// or zig-zag chunks r and 2C-1-r of 2C.
Tensor positions_of(int64_t length, int C, int r, bool zig_zag) {
  if (!zig_zag) return torch::arange(r * length / C, (r + 1) * length / C, torch::kLong);
  const int64_t chunk = length / (2 * C);
  return torch::cat({torch::arange(r * chunk, (r + 1) * chunk, torch::kLong),
                     torch::arange((2 * C - 1 - r) * chunk, (2 * C - r) * chunk, torch::kLong)});
}

std::map<std::string, Tensor> gradients(const torch::nn::Module& m) {
  std::map<std::string, Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out[p.key()] =
        p.value().grad().defined() ? p.value().grad().clone() : torch::zeros_like(p.value());
  }
  return out;
}

struct Case {
  std::string name;
  ModelOptions options;
  bool padded = false;  // the second row ends in padding (attention_mask 0, labels -100)
};

ModelOptions base(Arch arch) {
  ModelOptions o;
  o.arch = arch;
  o.vocab_size = 12;
  o.hidden = 16;
  o.layers = 2;
  o.heads = 4;
  o.ffn = 32;
  o.max_seq_length = 64;
  return o;
}

Case bert_learned() { return {"BERT learned positions", base(Arch::kBert), true}; }

Case dnabert2_alibi() {
  auto o = base(Arch::kBert);
  o.alibi = true;
  o.gated_mlp = true;
  o.gate_activation = ModelOptions::GateActivation::kGelu;
  o.ffn_in_bias = false;
  o.post_layer_norm = true;
  o.embedding_layer_norm = true;
  o.type_vocab_size = 2;
  return {"DNABERT-2 ALiBi", o, true};
}

Case llama_rotary() {
  auto o = base(Arch::kGpt);
  o.rotary = true;
  o.rms_norm = true;
  o.gated_mlp = true;
  o.linear_bias = false;
  o.kv_heads = 2;  // grouped-query attention: the gathered keys are the shared heads
  o.tie_embeddings = false;
  return {"Llama rotary GQA", o, false};
}

Case gpt_learned_padded() { return {"GPT learned positions, padded", base(Arch::kGpt), true}; }

void check(const Case& c, int C) {
  const int64_t B = 2, T = 32;
  const bool causal = c.options.arch == Arch::kGpt;
  const std::string tag = " " + c.name + " C=" + std::to_string(C);
  std::vector<TransformerLM> copies;
  for (int r = 0; r <= C; ++r) {
    torch::manual_seed(21);
    copies.emplace_back(c.options);
  }
  torch::manual_seed(22);
  const auto ids = torch::randint(5, c.options.vocab_size, {B, T}, torch::kLong);
  auto mask = torch::ones({B, T}, torch::kLong);
  if (c.padded) mask[1].narrow(0, T - 7, 7).fill_(0);
  // Labels as the data path gives them under context parallelism (already shifted for a causal
  // LM: position i's target is token i + 1); the reference shifts the ids itself.
  Tensor labels;
  if (causal) {
    labels = torch::full({B, T}, -100, torch::kLong);
    labels.narrow(1, 0, T - 1).copy_(ids.narrow(1, 1, T - 1));
    labels.masked_fill_(
        torch::cat({mask.narrow(1, 1, T - 1), torch::zeros({B, 1}, torch::kLong)}, 1).eq(0), -100);
  } else {
    labels = torch::where(torch::rand({B, T}) < 0.3, ids, torch::full({B, T}, -100, torch::kLong));
    labels.masked_fill_(mask.eq(0), -100);
  }

  auto& reference = copies[C];
  ForwardInputs whole;
  whole.input_ids = ids;
  if (c.padded) whole.attention_mask = mask;
  const auto want_logits = [&] {
    torch::NoGradGuard no_grad;
    return reference->forward(whole).logits;
  }();
  if (causal) {
    whole.labels = ids.masked_fill(mask.eq(0), -100);  // shifted inside the model
  } else {
    whole.labels = labels;
  }
  const auto want = reference->forward(whole);
  want.loss_sum.backward();
  const auto want_grads = gradients(*reference);

  std::vector<Tensor> logits(C), losses(C), positions(C);
  std::vector<std::map<std::string, Tensor>> grads(C);
  expect_no_errors(run_on_ranks(C, "attention", [&](int r, comm::Communicator& group) {
    auto cp = std::make_shared<ContextParallel>();
    cp->group = &group;
    cp->full_length = T;
    cp->positions = positions[r] = positions_of(T, C, r, causal);
    auto& model = copies[r];
    model->set_context_parallel(cp);
    EXPECT_FALSE(model->spec().shift_labels);
    EXPECT_EQ(model->spec().context_layout,
              causal ? ContextLayout::kZigZag : ContextLayout::kContiguous);
    ForwardInputs in;
    in.input_ids = ids.index_select(1, positions[r]);
    if (c.padded) in.attention_mask = mask.index_select(1, positions[r]);
    {
      torch::NoGradGuard no_grad;
      logits[r] = model->forward(in).logits;
    }
    in.labels = labels.index_select(1, positions[r]);
    const auto out = model->forward(in);
    out.loss_sum.backward();
    losses[r] = out.loss_sum.detach();
    grads[r] = gradients(*model);
  }));
  if (::testing::Test::HasFailure()) return;
  // Logits at the real positions (Note [Attention context parallelism]: a padding query's row
  // is nobody's output).
  const auto order = torch::cat(positions);
  const auto real = mask.index_select(1, order).to(torch::kBool).unsqueeze(-1);
  const auto got = torch::cat(logits, 1).masked_fill(real.logical_not(), 0);
  const auto expected = want_logits.index_select(1, order).masked_fill(real.logical_not(), 0);
  double err = relative_error(got, expected);
  std::cout << "[ measured ]" << tag << ": logits max relative error " << err << "\n";
  EXPECT_LE(err, kTolerance) << "logits" << tag;
  err = relative_error(torch::stack(losses).sum(), want.loss_sum.detach());
  std::cout << "[ measured ]" << tag << ": loss relative error " << err << "\n";
  EXPECT_LE(err, kTolerance) << "loss" << tag;
  // The key biases' gradients are zero up to rounding (a softmax ignores a score added to every
  // key of a query), so each gradient is measured against at least 1e-3 of the largest one.
  double largest = 0;
  for (const auto& [name, g] : want_grads)
    largest = std::max(largest, g.abs().max().item<double>());
  double worst = 0;
  for (const auto& [name, g] : want_grads) {
    std::vector<Tensor> parts;
    for (int r = 0; r < C; ++r) parts.push_back(grads[r].at(name));
    const double scale = std::max(g.abs().max().item<double>(), 1e-3 * largest);
    const double e = (torch::stack(parts).sum(0) - g).abs().max().item<double>() / scale;
    EXPECT_LE(e, kTolerance) << "gradient of " << name << tag;
    worst = std::max(worst, e);
  }
  std::cout << "[ measured ]" << tag << ": " << want_grads.size()
            << " parameter gradients, largest relative error " << worst << "\n";
}

class AttentionContextParallel : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!gloo_available()) GTEST_SKIP() << "gloo was not built";
  }
};

TEST_P(AttentionContextParallel, BertWithLearnedPositionsMatchesOneRank) {
  check(bert_learned(), GetParam());
}
TEST_P(AttentionContextParallel, Dnabert2WithAlibiMatchesOneRank) {
  check(dnabert2_alibi(), GetParam());
}
TEST_P(AttentionContextParallel, LlamaWithRotaryOnZigZagChunksMatchesOneRank) {
  check(llama_rotary(), GetParam());
}
TEST_P(AttentionContextParallel, PaddedGptOnZigZagChunksMatchesOneRank) {
  check(gpt_learned_padded(), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Ranks, AttentionContextParallel, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "C" + std::to_string(info.param);
                         });

TEST(PositionRuns, SplitsPositionsIntoConsecutiveRuns) {
  const auto runs = position_runs({0, 1, 2, 9, 10, 3});
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].first, 0);
  EXPECT_EQ(runs[0].length, 3);
  EXPECT_EQ(runs[1].first, 9);
  EXPECT_EQ(runs[1].offset, 3);
  EXPECT_EQ(runs[2].length, 1);
}

}  // namespace
}  // namespace dnallm::models
