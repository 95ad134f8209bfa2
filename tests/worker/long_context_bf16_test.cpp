// bf16 compute for HyenaDNA and Caduceus (issue 24 item 5; Note [fp32 regions under autocast]):
// under training.precision = "bf16" (the trainer's AutocastGuard) the linear layers run in bf16
// while HyenaDNA's implicit filter and FFT long convolution and Caduceus's selective scan (fused
// CPU loop and tensor-op path) receive fp32 operands, checked by an operator observer on the
// regions' RECORD_FUNCTION scopes (every operator inside them); bf16 logits stay close to fp32
// ones; ten AdamW steps in bf16 keep a finite loss close to fp32's.
#include <gtest/gtest.h>

#include <ATen/record_function.h>

#include <map>
#include <set>

#include <fmt/format.h>

#include "core/config.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/caduceus/caduceus.hpp"
#include "worker/models/registry.hpp"
#include "worker/train/autocast.hpp"

namespace dnallm::models {
namespace {

// Note [fp32 regions under autocast]: per region scope ("dnallm::..."), the dtypes of the tensors
// every operator called inside it received (the scope's own inputs included); and whether any
// operator anywhere received a bf16 tensor (autocast really was on).
class DtypeProbe {
 public:
  DtypeProbe() {
    state() = State{};
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              auto& s = state();
              const std::string name = fn.name();
              if (name.rfind("dnallm::", 0) == 0) s.open.push_back(name);
              for (const auto& v : fn.inputs()) {
                if (!v.isTensor() || !v.toTensor().defined()) continue;
                // A scalar operand (x / 2.0) arrives as a 0-dim double "wrapped number".
                if (v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) continue;
                const auto type = v.toTensor().scalar_type();
                s.any_bf16 = s.any_bf16 || type == c10::kBFloat16;
                for (const auto& region : s.open) s.seen[region].insert(type);
              }
              return nullptr;
            },
            [](const at::RecordFunction& fn, at::ObserverContext*) {
              auto& s = state();
              if (std::string(fn.name()).rfind("dnallm::", 0) == 0 && !s.open.empty())
                s.open.pop_back();
            })
            .needsInputs(true));
  }
  ~DtypeProbe() { at::removeCallback(handle_); }
  DtypeProbe(const DtypeProbe&) = delete;
  DtypeProbe& operator=(const DtypeProbe&) = delete;

  // The dtypes the operators inside `region` received (empty: it never ran).
  std::set<c10::ScalarType> of(const std::string& region) const {
    auto it = state().seen.find(region);
    return it == state().seen.end() ? std::set<c10::ScalarType>{} : it->second;
  }
  bool any_bf16() const { return state().any_bf16; }

 private:
  struct State {
    std::vector<std::string> open;  // the region scopes entered and not yet left
    std::map<std::string, std::set<c10::ScalarType>> seen;
    bool any_bf16 = false;
  };
  // The callbacks are thread-local: only the test's thread touches this.
  static State& state() {
    static State s;
    return s;
  }
  at::CallbackHandle handle_;
};

// fp32 and nothing narrower: real tensors in fp32, the FFT's spectra in complex fp32, indices.
void expect_fp32_only(const std::set<c10::ScalarType>& types, const std::string& region) {
  EXPECT_TRUE(types.count(c10::kFloat) > 0) << region << " did not run";
  for (const auto t : types) {
    EXPECT_TRUE(t == c10::kFloat || t == c10::kComplexFloat || t == c10::kLong)
        << region << " received a " << c10::toString(t) << " tensor";
  }
}

Config tiny(const std::string& arch) {
  return parse_config(fmt::format("[model]\narch = \"{}\"\nhidden = 16\nlayers = 2\nheads = 2\n"
                                  "ffn = 32\nmax_seq_length = 64\n[training]\nseed = 7\n",
                                  arch),
                      "tiny");
}

ForwardInputs batch(const Config& c, int64_t vocab, int64_t len) {
  ForwardInputs in;
  torch::manual_seed(5);
  in.input_ids = torch::randint(data::kFirstRegularId, vocab, {2, len}, torch::kLong);
  if (c.model.arch == cfg::Arch::kHyena) {
    in.labels = in.input_ids.clone();
  } else {  // masked LM: every 4th position masked and scored
    in.labels = torch::full({2, len}, -100, torch::kLong);
    for (int64_t i = 1; i < len; i += 4) {
      in.labels.select(1, i).copy_(in.input_ids.select(1, i));
      in.input_ids.select(1, i).fill_(data::kMaskId);
    }
  }
  return in;
}

const std::map<std::string, std::vector<std::string>> kFp32Regions = {
    {"hyena", {"dnallm::hyena::filter", "dnallm::hyena::fft_long_conv"}},
    {"caduceus", {"dnallm::caduceus::selective_scan"}},
    {"caduceus-ps", {"dnallm::caduceus::selective_scan"}}};

// Largest |bf16 - fp32| over the largest |fp32| of the logits.
double relative_difference(const torch::Tensor& bf16, const torch::Tensor& fp32) {
  return (bf16.to(torch::kFloat32) - fp32).abs().max().item<double>() /
         fp32.abs().max().item<double>();
}

TEST(LongContextBf16, FilterFftAndScanReceiveFp32AndLogitsStayClose) {
  const auto tok = data::make_char_tokenizer();
  for (const auto& [arch, regions] : kFp32Regions) {
    SCOPED_TRACE(arch);
    const auto config = tiny(arch);
    auto model = build_model_for(config, *tok, BuildContext{});
    model->eval();
    auto in = batch(config, tok->vocab_size(), 48);
    in.labels = torch::Tensor();
    torch::NoGradGuard no_grad;
    const auto fp32 = model->forward(in).logits;
    DtypeProbe probe;
    torch::Tensor bf16;
    {
      train::AutocastGuard autocast(/*bf16=*/true, /*fp16=*/false, torch::kCPU);
      bf16 = model->forward(in).logits;
    }
    EXPECT_TRUE(probe.any_bf16()) << "autocast did not compute anything in bf16";
    for (const auto& region : regions) expect_fp32_only(probe.of(region), region);
    const double rel = relative_difference(bf16, fp32);
    EXPECT_GT(rel, 0.0) << "bf16 computed the fp32 logits exactly: autocast was not on";
    EXPECT_LT(rel, 2e-2);
    std::cout << arch << ": bf16 vs fp32 logits, max |difference| / max |fp32| = " << rel << "\n";
  }
}

// The tensor-op scan (other devices' path) under autocast with bf16 operands, as the mixer's
// projections hand them over: computed in fp32, and the fused CPU scan's result.
TEST(LongContextBf16, TheTensorOpScanComputesInFp32UnderAutocast) {
  torch::manual_seed(6);
  const int64_t B = 2, D = 6, L = 20, N = 4;
  const auto u = torch::randn({B, D, L}), delta = torch::randn({B, D, L}) * 0.5;
  const auto A = -torch::rand({D, N}) - 0.5, Bm = torch::randn({B, N, L});
  const auto C = torch::randn({B, N, L}), Dv = torch::randn({D}), z = torch::randn({B, D, L});
  const auto bias = torch::randn({D}) * 0.1;
  auto h = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  DtypeProbe probe;
  torch::Tensor tensor_ops, fused;
  {
    train::AutocastGuard autocast(/*bf16=*/true, /*fp16=*/false, torch::kCPU);
    tensor_ops = caduceus::selective_scan(h(u), h(delta), A, h(Bm), h(C), Dv, h(z), bias);
    fused = caduceus::selective_scan_fused(h(u), h(delta), A, h(Bm), h(C), Dv, h(z), bias);
  }
  expect_fp32_only(probe.of("dnallm::caduceus::selective_scan"), "the scan");
  EXPECT_EQ(tensor_ops.scalar_type(), torch::kFloat32);
  EXPECT_LT((tensor_ops - fused).abs().max().item<double>(), 1e-4);
}

// Ten AdamW steps on one batch, fp32 master weights, the forward under the trainer's autocast:
// the loss stays finite and within a few percent of the fp32 run's at every step.
TEST(LongContextBf16, TenTrainingStepsKeepTheLossCloseToFp32) {
  const auto tok = data::make_char_tokenizer();
  for (const auto& arch : {"hyena", "caduceus-ps"}) {
    SCOPED_TRACE(arch);
    const auto config = tiny(arch);
    auto losses = [&](bool bf16) {
      auto model = build_model_for(config, *tok, BuildContext{});
      model->train();
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(3e-3));
      const auto in = batch(config, tok->vocab_size(), 24);
      std::vector<double> out;
      for (int step = 0; step < 10; ++step) {
        adamw.zero_grad();
        ModelOutput o;
        {
          train::AutocastGuard autocast(bf16, /*fp16=*/false, torch::kCPU);
          o = model->forward(in);
        }
        auto loss = o.loss_sum / double(o.loss_count);
        loss.backward();
        adamw.step();
        out.push_back(loss.item<double>());
      }
      return out;
    };
    const auto fp32 = losses(false), bf16 = losses(true);
    double worst = 0;
    for (size_t i = 0; i < fp32.size(); ++i) {
      ASSERT_TRUE(std::isfinite(bf16[i])) << "step " << i;
      worst = std::max(worst, std::abs(bf16[i] - fp32[i]) / fp32[i]);
    }
    EXPECT_LT(worst, 3e-2);
    EXPECT_LT(bf16.back(), bf16.front()) << "bf16 did not train";
    std::cout << arch << ": loss fp32 " << fp32.front() << " -> " << fp32.back() << ", bf16 "
              << bf16.front() << " -> " << bf16.back()
              << "; worst relative difference over 10 steps " << worst << "\n";
  }
}

// Note [Recompute under the forward's autocast]: a checkpointed block is recomputed in backward
// under the autocast of its forward, so bf16 gradients with activation checkpointing are those
// without, bit for bit, in every family (recomputed in fp32 they differ by about 1e-3).
TEST(LongContextBf16, CheckpointedBlocksRecomputeUnderTheForwardsAutocast) {
  const auto tok = data::make_char_tokenizer();
  for (const std::string arch : {"hyena", "caduceus-ps", "bert", "gpt"}) {
    SCOPED_TRACE(arch);
    const auto config = tiny(arch);
    auto in = batch(config, tok->vocab_size(), 48);
    if (arch == "gpt") in.labels = in.input_ids.clone();
    auto gradients = [&](bool checkpointing) {
      torch::manual_seed(11);
      auto model = build_model_for(config, *tok, BuildContext{});
      model->train();
      model->set_activation_checkpointing(checkpointing);
      ModelOutput o;
      {
        train::AutocastGuard autocast(/*bf16=*/true, /*fp16=*/false, torch::kCPU);
        o = model->forward(in);
      }
      o.loss_sum.backward();
      std::map<std::string, torch::Tensor> grads;
      for (const auto& p : model->named_parameters()) {
        if (p.value().grad().defined()) grads[p.key()] = p.value().grad().clone();
      }
      return grads;
    };
    const auto plain = gradients(false), checkpointed = gradients(true);
    ASSERT_EQ(plain.size(), checkpointed.size());
    ASSERT_FALSE(plain.empty());
    for (const auto& [name, g] : plain) {
      EXPECT_TRUE(torch::equal(g, checkpointed.at(name)))
          << name << ": max |diff| " << (g - checkpointed.at(name)).abs().max().item<double>();
    }
  }
}

}  // namespace
}  // namespace dnallm::models
