// Note [Attention context parallelism] with real Gloo groups of 2 and 4 ranks in one process:
// whole transformer models behind the model interface, each rank holding its positions of every
// sequence (contiguous for the bidirectional BERTs, zig-zag chunks r and 2C-1-r for the causal
// Llama), against one rank on the whole sequence: logits, the summed loss and every parameter's
// gradient (summed over the ranks). A key block in the wrong order, a causal mask by local instead
// of global positions, rotary or ALiBi by local positions, or a padding mask not gathered fails
// these. ContextAttentionOverlap checks, at the function, that the K/V exchange overlaps the local
// blocks (forward and backward) and changes no number.
#include "worker/models/transformer/context_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/worker/parallel/context_model_run.hpp"
#include "tests/worker/parallel/context_ranks.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::models {
namespace {

using namespace parallel::context_test;  // NOLINT: context_ranks.hpp, context_model_run.hpp
using torch::Tensor;

constexpr double kAttentionTolerance = 1e-5;

// This rank's global positions of a sequence of `length`: contiguous [r T / C, (r + 1) T / C),
// or zig-zag chunks r and 2C-1-r of 2C.
Tensor positions_of(int64_t length, int C, int r, bool zig_zag) {
  if (!zig_zag) return torch::arange(r * length / C, (r + 1) * length / C, torch::kLong);
  const int64_t chunk = length / (2 * C);
  return torch::cat({torch::arange(r * chunk, (r + 1) * chunk, torch::kLong),
                     torch::arange((2 * C - 1 - r) * chunk, (2 * C - r) * chunk, torch::kLong)});
}

struct Case {
  std::string name;
  ModelOptions options;
  bool padded = false;  // the second row ends in padding (attention_mask 0, labels -100)
};

ModelOptions base(Arch arch) { return parallel::context_test::tiny_transformer(arch); }

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

// Note [Activation checkpointing]: the blocks' backward recomputes the forward, K/V exchange
// included, inside the outer backward (a nested backward through the exchange's autograd nodes).
Case llama_checkpointed() {
  auto c = llama_rotary();
  c.name += ", checkpointed";
  c.options.gradient_checkpointing = true;
  return c;
}

Case gpt_learned_padded() { return {"GPT learned positions, padded", base(Arch::kGpt), true}; }

// Pythia-style GPT-NeoX (Note [Rotary variants], Note [Parallel residual]): rotary on half of
// each head at its global positions, another base, both sublayers reading the block's input.
Case pythia_partial_rotary_padded() {
  auto o = base(Arch::kGpt);
  o.rotary = true;
  o.rotary_fraction = 0.5;  // 2 of the 4 channels of each head
  o.rope_theta = 500000.0;
  o.parallel_residual = true;
  return {"Pythia partial rotary, parallel residual, padded", o, true};
}

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
  EXPECT_LE(err, kAttentionTolerance) << "logits" << tag;
  err = relative_error(torch::stack(losses).sum(), want.loss_sum.detach());
  std::cout << "[ measured ]" << tag << ": loss relative error " << err << "\n";
  EXPECT_LE(err, kAttentionTolerance) << "loss" << tag;
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
    EXPECT_LE(e, kAttentionTolerance) << "gradient of " << name << tag;
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
TEST_P(AttentionContextParallel, CheckpointedLlamaRecomputesTheExchangeInBackward) {
  check(llama_checkpointed(), GetParam());
}
TEST_P(AttentionContextParallel, PaddedGptOnZigZagChunksMatchesOneRank) {
  check(gpt_learned_padded(), GetParam());
}
TEST_P(AttentionContextParallel, PythiaPartialRotaryParallelResidualMatchesOneRank) {
  check(pythia_partial_rotary_padded(), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Ranks, AttentionContextParallel, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "C" + std::to_string(info.param);
                         });

// Note [Attention context parallelism]'s overlap, at the function: context_attention on each
// rank's q, k, v (grouped-query heads) against softmax attention over the whole sequence, its
// output and the gradients of q, k and v. With the overlap, the blocks of the local keys must have
// been computed while the all-gather was in flight and the local blocks' backward while the
// reduce-scatter was; without it (the bench's baseline) none, and the same numbers bit for bit.
// A causal contiguous layout leaves rank 0 no remote key (its reduce-scatter is launched with
// zeros: without it the other ranks would wait out the timeout).
enum class Layout { kCausalZigZag, kBidirectional, kCausalContiguous };

void check_overlap(int C, Layout layout) {
  const int64_t B = 2, H = 4, Hkv = 2, T = 32, D = 8;
  const bool causal = layout != Layout::kBidirectional;
  const std::string tag = " C=" + std::to_string(C) + " layout " + std::to_string(int(layout));
  torch::manual_seed(31);
  const auto q = torch::randn({B, H, T, D}), k = torch::randn({B, Hkv, T, D}),
             v = torch::randn({B, Hkv, T, D}), g = torch::randn({B, H, T, D});
  // The whole sequence on one rank: dense softmax attention, query head i on key head i / 2.
  const auto wq = leaf(q), wk = leaf(k), wv = leaf(v);
  auto repeat = [&](const Tensor& x) {
    return x.unsqueeze(2).expand({B, Hkv, H / Hkv, T, D}).reshape({B, H, T, D});
  };
  auto scores = torch::matmul(wq, repeat(wk).transpose(-2, -1)) / std::sqrt(double(D));
  if (causal) scores = scores.masked_fill(torch::ones({T, T}).triu(1).to(torch::kBool), -1e9);
  const auto want = torch::matmul(torch::softmax(scores, -1), repeat(wv));
  (want * g).sum().backward();

  std::vector<Tensor> positions(C);
  std::vector<int64_t> keys;
  for (int r = 0; r < C; ++r) {
    positions[r] = positions_of(T, C, r, layout == Layout::kCausalZigZag);
    keys.insert(keys.end(), positions[r].data_ptr<int64_t>(),
                positions[r].data_ptr<int64_t>() + positions[r].numel());
  }
  struct Result {
    Tensor out, dq, dk, dv;
    ContextAttentionCounts counts;
  };
  std::vector<Result> overlapped(C), waited(C);
  for (const bool overlap : {true, false}) {
    auto& results = overlap ? overlapped : waited;
    expect_no_errors(run_on_ranks(C, "overlap", [&](int r, comm::Communicator& group) {
      const auto& pos = positions[r];
      AttentionContext context;
      context.group = &group;
      context.query_positions.assign(pos.data_ptr<int64_t>(),
                                     pos.data_ptr<int64_t>() + pos.numel());
      context.key_positions = keys;
      context.causal = causal;
      context.overlap_exchange = overlap;
      auto& result = results[r];
      context.counts = &result.counts;
      const auto qr = leaf(q.index_select(2, pos)), kr = leaf(k.index_select(2, pos)),
                 vr = leaf(v.index_select(2, pos));
      const auto out = context_attention(qr, kr, vr, context, 0.0);
      (out * g.index_select(2, pos)).sum().backward();
      result.out = out.detach();
      result.dq = qr.grad();
      result.dk = kr.grad();
      result.dv = vr.grad();
    }));
  }
  if (::testing::Test::HasFailure()) return;
  for (int r = 0; r < C; ++r) {
    const auto& pos = positions[r];
    const auto& got = overlapped[r];
    const std::string at = tag + " rank " + std::to_string(r);
    EXPECT_LE(relative_error(got.out, want.detach().index_select(2, pos)), kAttentionTolerance)
        << at;
    EXPECT_LE(relative_error(got.dq, wq.grad().index_select(2, pos)), kAttentionTolerance) << at;
    EXPECT_LE(relative_error(got.dk, wk.grad().index_select(2, pos)), kAttentionTolerance) << at;
    EXPECT_LE(relative_error(got.dv, wv.grad().index_select(2, pos)), kAttentionTolerance) << at;
    const auto& baseline = waited[r];
    EXPECT_TRUE(torch::equal(got.out, baseline.out) && torch::equal(got.dq, baseline.dq) &&
                torch::equal(got.dk, baseline.dk) && torch::equal(got.dv, baseline.dv))
        << "the overlap changed the numbers" << at;

    const auto& n = got.counts;
    std::cout << "[ measured ]" << at << ": " << n.blocks_before_wait << " blocks before the wait, "
              << n.blocks_after_wait << " after; " << n.local_backward_before_wait
              << " local blocks' backward before the gradients' wait\n";
    EXPECT_EQ(n.exchanges, 1) << at;
    EXPECT_EQ(n.gradient_exchanges, 1) << at;
    EXPECT_GE(n.blocks_before_wait, 1) << "no local block overlapped the all-gather" << at;
    // Every rank but rank 0 of the causal contiguous layout reads remote keys.
    const bool remote = !(layout == Layout::kCausalContiguous && r == 0);
    EXPECT_EQ(n.blocks_after_wait > 0, remote) << at;
    if (remote) {
      EXPECT_GE(n.local_backward_before_wait, 1)
          << "no local block's backward overlapped the reduce-scatter" << at;
    }
    const auto& m = baseline.counts;
    EXPECT_EQ(m.blocks_before_wait, 0) << at;
    EXPECT_EQ(m.local_backward_before_wait, 0) << at;
    EXPECT_EQ(m.blocks_after_wait, n.blocks_before_wait + n.blocks_after_wait) << at;
  }
}

class ContextAttentionOverlap : public AttentionContextParallel {};

TEST_P(ContextAttentionOverlap, CausalZigZagLocalBlocksRunWhileTheExchangeIsInFlight) {
  check_overlap(GetParam(), Layout::kCausalZigZag);
}
TEST_P(ContextAttentionOverlap, BidirectionalLocalBlocksRunWhileTheExchangeIsInFlight) {
  check_overlap(GetParam(), Layout::kBidirectional);
}
TEST_P(ContextAttentionOverlap, CausalContiguousRankZeroWithoutRemoteKeysStillExchanges) {
  check_overlap(GetParam(), Layout::kCausalContiguous);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ContextAttentionOverlap, ::testing::Values(2, 4),
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
