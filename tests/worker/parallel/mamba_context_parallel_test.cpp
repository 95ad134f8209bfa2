// Note [Mamba context parallelism] with real Gloo groups of 2 and 4 ranks in one process: the
// carried-state selective scan (the fused CPU kernels and the device-generic torch ops, over the
// group and its reversed twin), one Mamba mixer, and whole Caduceus models (Caduceus-Ph: BiMamba;
// Caduceus-PS: RCPS; with either scan) on sequence shards, gathered, against the same computation
// on the whole sequence in one process, forward and backward (every parameter's gradient summed
// over the ranks). A start state not carried, a halo from the wrong side, or a reverse direction
// over the ranks in the wrong order changes values near the shard boundaries and fails these.
#include "worker/models/caduceus/mamba_context.hpp"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/worker/parallel/context_model_run.hpp"
#include "tests/worker/parallel/context_ranks.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/caduceus/caduceus.hpp"
#include "worker/models/caduceus/caduceus_model.hpp"
#include "worker/parallel/device_group.hpp"

namespace dnallm::models::caduceus {
namespace {

using namespace parallel::context_test;  // NOLINT: context_ranks.hpp, context_model_run.hpp
using torch::Tensor;

constexpr double kMambaTolerance = 1e-6;

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  parallel::context_test::expect_close(got, want, what, kMambaTolerance);
}

class MambaContextParallel : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!gloo_available()) GTEST_SKIP() << "gloo was not built";
  }
  int world() const { return GetParam(); }
  std::string tag() const { return " C=" + std::to_string(GetParam()); }
};

// The selective scan's inputs on the whole sequence (u, delta, A, B, C, D, z, delta_bias) and
// the weight of the loss sum(y * weight).
struct ScanCase {
  std::vector<Tensor> inputs;
  Tensor weight;
};

ScanCase scan_case() {
  const int64_t B = 2, D = 6, N = 4, L = 48;
  torch::manual_seed(5);
  // Slow decay (small |A|, small delta): the state carries far past each shard boundary.
  const auto u = torch::randn({B, D, L}), delta = torch::randn({B, D, L}) - 2;
  const auto z = torch::randn({B, D, L});
  const auto A = -torch::rand({D, N}) * 0.3 - 0.01;
  const auto Bm = torch::randn({B, N, L}), Cm = torch::randn({B, N, L});
  const auto Dp = torch::randn({D}), bias = torch::randn({D});
  return {{u, delta, A, Bm, Cm, Dp, z, bias}, torch::randn({B, D, L})};
}

const char* const kScanInputs[] = {"u", "delta", "A", "B", "C", "D", "z", "delta_bias"};

// The output, then the gradient of each input, over the whole sequence.
using ScanResult = std::vector<Tensor>;

using ScanFn = Tensor (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, const Tensor&);

ScanResult whole_scan(const ScanCase& c, ScanFn scan) {
  std::vector<Tensor> in;
  for (const auto& t : c.inputs) in.push_back(leaf(t));
  const auto y = scan(in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7]);
  (y * c.weight).sum().backward();
  ScanResult out{y.detach()};
  for (const auto& t : in) out.push_back(t.grad());
  return out;
}

struct ScanRun {
  ContextScanKernel kernel = ContextScanKernel::kByDevice;
  bool reversed = false;  // over the group's reversed twin
  // Through the staging communicator (Note [Staged collectives]) that a GPU's gloo group is,
  // staging host buffers as it stages a GPU's: the collectives run on its thread, in issue order.
  bool staged = false;
};

// The context-parallel scan on C ranks, each holding the shard of the group's rank it runs
// as: over the group, or over its reversed twin (the flipped directions' group, Note [Mamba
// context parallelism]) where rank r holds shard C - 1 - r. Sharded inputs' gradients side by
// side, replicated ones' summed over the ranks.
ScanResult context_scan(const ScanCase& c, int C, const ScanRun& run) {
  std::vector<ScanResult> got(C);
  expect_no_errors(run_on_ranks(C, "scan", [&](int r, comm::Communicator& world) {
    std::unique_ptr<comm::Communicator> staged;
    if (run.staged) {
      parallel::StagingOptions o;
      o.stage_host_buffers = true;
      staged = parallel::stage_for_device(world.split(0, r), torch::kCPU, o);
    }
    const auto context = make_mamba_context(staged ? *staged : world);
    auto& group = run.reversed ? context->reversed_group() : *context->group;
    const int shard = group.rank();
    EXPECT_EQ(shard, run.reversed ? C - 1 - r : r);
    std::vector<Tensor> in;
    for (const auto& t : c.inputs) {
      in.push_back(leaf(t.dim() == 3 ? shard_of(t, 2, C, shard) : t));  // [.., L] sharded
    }
    auto out = context_parallel_selective_scan(in[0], in[1], in[2], in[3], in[4], in[5], in[6],
                                               in[7], group, run.kernel);
    (out * shard_of(c.weight, 2, C, shard)).sum().backward();
    got[shard].push_back(out.detach());
    for (const auto& t : in) got[shard].push_back(t.grad());
  }));
  if (::testing::Test::HasFailure()) return {};
  ScanResult merged;
  for (size_t i = 0; i <= c.inputs.size(); ++i) {
    std::vector<Tensor> parts;
    for (int q = 0; q < C; ++q) parts.push_back(got[q][i]);
    const bool sharded = i == 0 || c.inputs[i - 1].dim() == 3;
    merged.push_back(sharded ? torch::cat(parts, 2) : torch::stack(parts).sum(0));
  }
  return merged;
}

void expect_same_scan(const ScanResult& got, const ScanResult& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  expect_close(got[0], want[0], what + ": output");
  for (size_t i = 1; i < want.size(); ++i) {
    expect_close(got[i], want[i], what + ": gradient of " + kScanInputs[i - 1]);
  }
}

TEST_P(MambaContextParallel, SelectiveScanCarriesTheStateAcrossRanks) {
  const auto c = scan_case();
  const auto want = whole_scan(c, selective_scan_fused);
  for (const bool reversed : {false, true}) {
    ScanRun run;
    run.reversed = reversed;
    const auto got = context_scan(c, world(), run);
    if (HasFailure()) return;
    expect_same_scan(got, want, std::string("fused scan") + (reversed ? " reversed" : "") + tag());
  }
}

// The device-generic scan (torch ops, what a GPU runs) against the whole-sequence generic scan
// on one rank and against the fused context-parallel scan, over the group and its reversed twin,
// and over a staging communicator (a GPU's gloo group).
TEST_P(MambaContextParallel, GenericScanMatchesTheWholeSequenceAndTheFusedScan) {
  const auto c = scan_case();
  const auto whole = whole_scan(c, selective_scan);
  for (const bool reversed : {false, true}) {
    const std::string how = reversed ? " reversed" : "";
    ScanRun run;
    run.reversed = reversed;
    const auto fused = context_scan(c, world(), run);
    run.kernel = ContextScanKernel::kGeneric;
    const auto generic = context_scan(c, world(), run);
    if (HasFailure()) return;
    expect_same_scan(generic, whole, "generic scan vs one rank" + how + tag());
    expect_same_scan(generic, fused, "generic scan vs fused" + how + tag());
    run.staged = true;
    const auto staged = context_scan(c, world(), run);
    if (HasFailure()) return;
    expect_same_scan(staged, generic, "generic scan staged vs unstaged" + how + tag());
  }
}

CaduceusOptions tiny(bool rcps, bool bidirectional) {
  return parallel::context_test::tiny_caduceus(rcps, bidirectional);
}

TEST_P(MambaContextParallel, MambaMixerMatchesTheWholeSequence) {
  const int C = world();
  const int64_t B = 2, T = 32;
  const auto o = tiny(false, false);
  // One copy of the same weights per rank, and the reference (built here: one RNG, in order).
  std::vector<Mamba> copies;
  for (int r = 0; r <= C; ++r) {
    torch::manual_seed(9);
    copies.emplace_back(o, nullptr);
  }
  const auto x = torch::randn({B, T, o.d_model}), weight = torch::randn({B, T, o.d_model});
  auto& reference = copies[C];
  const auto whole_x = leaf(x);
  const auto y = reference->forward(whole_x);
  (y * weight).sum().backward();
  const auto want = gradients(*reference);

  std::vector<Tensor> ys(C), dx(C);
  std::vector<std::map<std::string, Tensor>> grads(C);
  expect_no_errors(run_on_ranks(C, "mixer", [&](int r, comm::Communicator& group) {
    auto mine = leaf(shard_of(x, 1, C, r));
    ys[r] = mamba_context_parallel(*copies[r], mine, group);
    (ys[r] * shard_of(weight, 1, C, r)).sum().backward();
    dx[r] = mine.grad();
    grads[r] = gradients(*copies[r]);
  }));
  if (HasFailure()) return;
  expect_close(torch::cat(ys, 1), y.detach(), "mixer output" + tag());
  expect_close(torch::cat(dx, 1), whole_x.grad(), "mixer input gradient" + tag());
  for (const auto& [name, g] : want) {
    std::vector<Tensor> parts;
    for (int r = 0; r < C; ++r) parts.push_back(grads[r].at(name));
    expect_close(torch::stack(parts).sum(0), g, "mixer gradient of " + name + tag());
  }
}

// A whole model behind the model interface: masked-LM logits, the summed loss and every
// parameter's gradient, C ranks with set_context_parallel against one rank.
void check_model(int C, bool rcps, ContextScanKernel kernel = ContextScanKernel::kByDevice,
                 bool fused_add_norm = false) {
  const int64_t B = 2, T = 32, vocab = 14;
  auto o = tiny(rcps, /*bidirectional=*/true);
  o.fused_add_norm = fused_add_norm;  // Note [Caduceus fused add+norm]
  std::vector<CaduceusModel> copies;
  for (int r = 0; r <= C; ++r) {
    torch::manual_seed(13);
    copies.emplace_back(std::make_shared<CaduceusModelImpl>(CaduceusLM(o), vocab));
  }
  torch::manual_seed(14);
  const auto ids = torch::randint(data::kFirstRegularId, vocab, {B, T}, torch::kLong);
  auto labels = torch::full({B, T}, -100, torch::kLong);
  const auto scored = torch::rand({B, T}) < 0.3;
  labels.masked_scatter_(scored, ids.masked_select(scored));
  const std::string tag = std::string(rcps ? " Caduceus-PS" : " Caduceus-Ph") +
                          (fused_add_norm ? " fused_add_norm" : "") +
                          (kernel == ContextScanKernel::kGeneric ? " generic scan" : "") +
                          " C=" + std::to_string(C);

  auto& reference = copies[C];
  ForwardInputs whole;
  whole.input_ids = ids;
  whole.labels = labels;
  const auto want = reference->forward(whole);
  want.loss_sum.backward();
  const auto want_grads = gradients(*reference);

  std::vector<Tensor> logits(C), losses(C);
  std::vector<int64_t> counts(C);
  std::vector<std::map<std::string, Tensor>> grads(C);
  expect_no_errors(run_on_ranks(C, "model", [&](int r, comm::Communicator& group) {
    auto cp = std::make_shared<ContextParallel>();
    cp->group = &group;
    cp->full_length = T;
    cp->positions = torch::arange(r * T / C, (r + 1) * T / C, torch::kLong);
    copies[r]->set_context_parallel(cp);
    copies[r]->lm()->context->kernel = kernel;
    ForwardInputs in;
    in.input_ids = shard_of(ids, 1, C, r);
    in.labels = shard_of(labels, 1, C, r);
    const auto out = copies[r]->forward(in);
    out.loss_sum.backward();
    logits[r] = out.logits.detach();
    losses[r] = out.loss_sum.detach();
    counts[r] = out.loss_count;
    grads[r] = gradients(*copies[r]);
  }));
  if (::testing::Test::HasFailure()) return;
  expect_close(torch::cat(logits, 1), want.logits.detach(), "logits" + tag);
  expect_close(torch::stack(losses).sum(), want.loss_sum.detach(), "loss" + tag);
  int64_t count = 0;
  for (const auto c : counts) count += c;
  EXPECT_EQ(count, want.loss_count);
  double worst = 0;
  for (const auto& [name, g] : want_grads) {
    std::vector<Tensor> parts;
    for (int r = 0; r < C; ++r) parts.push_back(grads[r].at(name));
    const double err = parallel::context_test::relative_error(torch::stack(parts).sum(0), g);
    EXPECT_LE(err, kMambaTolerance) << "gradient of " << name << tag;
    worst = std::max(worst, err);
  }
  std::cout << "[ measured ]" << tag << ": " << want_grads.size()
            << " parameter gradients, largest relative error " << worst << "\n";
}

TEST_P(MambaContextParallel, CaduceusPhModelMatchesOneRank) { check_model(world(), false); }

TEST_P(MambaContextParallel, CaduceusPsModelMatchesOneRank) { check_model(world(), true); }

// The published Caduceus-PS configuration (Note [Caduceus fused add+norm]).
TEST_P(MambaContextParallel, CaduceusPsFusedAddNormModelMatchesOneRank) {
  check_model(world(), true, ContextScanKernel::kByDevice, /*fused_add_norm=*/true);
}

// The device-generic scan in the model, on the CPU: BiMamba's two directions and RCPS's two
// strands, forward and backward, through torch ops and gather_ranks.
TEST_P(MambaContextParallel, CaduceusPhModelWithTheGenericScanMatchesOneRank) {
  check_model(world(), false, ContextScanKernel::kGeneric);
}

TEST_P(MambaContextParallel, CaduceusPsModelWithTheGenericScanMatchesOneRank) {
  check_model(world(), true, ContextScanKernel::kGeneric);
}

// Classifiers pool over the group (Note [Context-parallel pooling]:
// tests/worker/parallel/context_pooling_test.cpp).
TEST_P(MambaContextParallel, AZigZagLayoutIsOneClearError) {
  const int C = world();
  const auto errors = run_on_ranks(C, "refuse", [&](int r, comm::Communicator& group) {
    auto cp = std::make_shared<ContextParallel>();
    cp->group = &group;
    cp->full_length = 8 * C;
    // Zig-zag: chunks r and 2C-1-r of 2C.
    cp->positions = torch::cat({torch::arange(r * 4, (r + 1) * 4, torch::kLong),
                                torch::arange((2 * C - 1 - r) * 4, (2 * C - r) * 4, torch::kLong)});
    CaduceusModel lm(std::make_shared<CaduceusModelImpl>(CaduceusLM(tiny(false, true)), 14));
    lm->set_context_parallel(cp);
  });
  for (int r = 0; r < C; ++r) {
    // Rank 0's zig-zag chunks are [0, 4) and [last]: not contiguous either.
    EXPECT_NE(errors[r].find("positions contiguous"), std::string::npos) << errors[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, MambaContextParallel, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "C" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace dnallm::models::caduceus
