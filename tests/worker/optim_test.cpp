// Optimiser: flat buffers, AdamW vs torch::optim::AdamW, ranges, schedules, clipping, scaler.
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/optim/flat_adamw.hpp"

namespace dnallm::optim {
namespace {

using dnallm::testing::expect_error;

struct TinyNet : torch::nn::Module {
  TinyNet() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 5));
    norm = register_module("LayerNorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({5})));
    fc2 = register_module("fc2", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(norm(fc1(x)))); }
  std::vector<std::pair<std::string, torch::Tensor>> named() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& p : named_parameters()) out.emplace_back(p.key(), p.value());
    return out;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};

TEST(OptimTest, DecayPolicy) {
  EXPECT_TRUE(decays("bert.encoder.layer.0.attention.self.query.weight"));
  EXPECT_FALSE(decays("bert.encoder.layer.0.attention.self.query.bias"));
  EXPECT_FALSE(decays("bert.encoder.layer.0.output.LayerNorm.weight"));
  EXPECT_FALSE(decays("bert.encoder.final_layer_norm.weight"));
  EXPECT_TRUE(decays("bert.embeddings.word_embeddings.weight"));
}

TEST(OptimTest, ParametersAndGradsAreViewsOfFlatBuffers) {
  torch::manual_seed(0);
  TinyNet net;
  auto before = net.fc1->weight.detach().clone();
  FlatParameters flat(net.named());
  EXPECT_EQ(flat.numel(), 6 * 5 + 5 + 5 + 5 + 5 * 3 + 3);
  EXPECT_TRUE(torch::equal(net.fc1->weight.detach(), before));
  // Writing the flat buffer changes the parameter.
  flat.params().narrow(0, 0, 1).fill_(42.0);
  EXPECT_EQ(net.fc1->weight[0][0].item<float>(), 42.0f);
  // Backward lands in the flat grad buffer, accumulating across calls until zeroed.
  auto x = torch::randn({4, 6});
  net.forward(x).sum().backward();
  auto g1 = flat.grads().clone();
  EXPECT_GT(g1.abs().sum().item<double>(), 0.0);
  net.forward(x).sum().backward();
  EXPECT_TRUE(torch::allclose(flat.grads(), 2 * g1, 1e-5, 1e-6));
  flat.zero_grad();
  EXPECT_EQ(net.fc1->weight.grad().abs().sum().item<double>(), 0.0);
  net.forward(x).sum().backward();
  EXPECT_TRUE(torch::allclose(flat.grads(), g1, 1e-5, 1e-6));
  // Decay mask: fc1.weight yes, fc1.bias no, LayerNorm no.
  const auto& e = flat.entries();
  ASSERT_EQ(e[0].name, "fc1.weight");
  EXPECT_EQ(flat.decay_mask()[e[0].offset].item<float>(), 1.0f);
  EXPECT_EQ(flat.decay_mask()[e[1].offset].item<float>(), 0.0f);
  EXPECT_EQ(flat.decay_mask()[e[2].offset].item<float>(), 0.0f);
}

TEST(OptimTest, FlatAdamWMatchesTorchAdamW) {
  torch::manual_seed(1);
  TinyNet a, b;
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < a.parameters().size(); ++i) b.parameters()[i].copy_(a.parameters()[i]);
  }
  const double lr = 1e-2, wd = 0.1;
  // Reference: two param groups, decay / no decay.
  std::vector<torch::Tensor> dec, nodec;
  for (auto& [name, p] : b.named()) (decays(name) ? dec : nodec).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(dec, std::make_unique<torch::optim::AdamWOptions>(
                               torch::optim::AdamWOptions(lr).weight_decay(wd)));
  groups.emplace_back(nodec, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(lr).weight_decay(0.0)));
  torch::optim::AdamW reference(groups, torch::optim::AdamWOptions(lr));

  FlatParameters flat(a.named());
  FlatAdamW adamw({0.9, 0.999, 1e-8, wd}, 0, flat.numel(), flat.decay_mask());
  for (int step = 0; step < 4; ++step) {
    auto x = torch::randn({8, 6});
    flat.zero_grad();
    a.forward(x).pow(2).mean().backward();
    adamw.step(flat.params(), flat.grads(), lr);
    reference.zero_grad();
    b.forward(x).pow(2).mean().backward();
    reference.step();
  }
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(a.parameters()[i], b.parameters()[i], 1e-5, 1e-6)) << i;
  }
}

TEST(OptimTest, TwoRangesEqualTheWholeBuffer) {
  torch::manual_seed(2);
  const int64_t n = 101, mid = 37;
  auto params = torch::randn({n});
  auto mask = (torch::rand({n}) > 0.5).to(torch::kFloat32);
  auto whole_p = params.clone(), split_p = params.clone();
  FlatAdamW whole({}, 0, n, mask);
  FlatAdamW lo({}, 0, mid, mask.narrow(0, 0, mid));
  FlatAdamW hi({}, mid, n, mask.narrow(0, mid, n - mid));
  for (int step = 0; step < 3; ++step) {
    auto g = torch::randn({n});
    whole.step(whole_p, g, 1e-2, 0.5);
    lo.step(split_p.narrow(0, 0, mid), g.narrow(0, 0, mid), 1e-2, 0.5);
    hi.step(split_p.narrow(0, mid, n - mid), g.narrow(0, mid, n - mid), 1e-2, 0.5);
  }
  EXPECT_TRUE(torch::allclose(whole_p, split_p, 1e-6, 1e-7));
  EXPECT_FALSE(torch::allclose(whole_p, params, 1e-6, 1e-7));
}

TEST(OptimTest, Schedules) {
  TrainingConfig t;
  t.lr = 1.0;
  t.warmup_steps = 10;
  t.lr_scheduler = cfg::LrScheduler::kLinear;
  auto s = schedule_from_config(t, 110);
  EXPECT_DOUBLE_EQ(lr_at(s, 0), 0.0);
  EXPECT_DOUBLE_EQ(lr_at(s, 5), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(s, 10), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(s, 60), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(s, 110), 0.0);
  t.lr_scheduler = cfg::LrScheduler::kCosine;
  s = schedule_from_config(t, 110);
  EXPECT_NEAR(lr_at(s, 60), 0.5, 1e-12);
  EXPECT_NEAR(lr_at(s, 35), 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-12);
  t.lr_scheduler = cfg::LrScheduler::kConstant;
  s = schedule_from_config(t, 110);
  EXPECT_DOUBLE_EQ(lr_at(s, 100), 1.0);
  t.warmup_steps = 0;
  t.warmup_ratio = 0.1;
  s = schedule_from_config(t, 200);
  EXPECT_EQ(s.warmup_steps, 20);
  t.lr = 0;
  expect_error([&] { schedule_from_config(t, 10); }, ExitCode::kUsage);
}

// The device coefficient (Note [Sync-free step]) is the host one, also for no clipping and a
// non-finite norm.
TEST(OptimTest, DeviceClipCoefficientEqualsTheHostOne) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double max_norm : {0.0, 1.0, 2.5}) {
    for (double norm : {0.0, 0.5, 1.0, 13.0, inf, std::nan("")}) {
      const auto device = clip_coefficient(torch::scalar_tensor(norm, torch::kFloat32), max_norm);
      EXPECT_EQ(device.dim(), 0);
      EXPECT_FLOAT_EQ(device.item<float>(), static_cast<float>(clip_coefficient(norm, max_norm)))
          << "norm " << norm << " max " << max_norm;
    }
  }
}

TEST(OptimTest, ClippingByGlobalNorm) {
  auto g = torch::tensor({3.0f, 4.0f, 0.0f, 12.0f});  // norm 13
  const double norm = std::sqrt(grad_sq_sum(g.narrow(0, 0, 2)) + grad_sq_sum(g.narrow(0, 2, 2)));
  EXPECT_NEAR(norm, 13.0, 1e-9);
  const double coef = clip_coefficient(norm, 1.0);
  EXPECT_NEAR(torch::norm(g * coef).item<double>(), 1.0, 1e-5);
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_EQ(clip_coefficient(100.0, 0.0), 1.0);
  // The optimiser applies the coefficient on the fly: Adam is scale-invariant only after
  // the first step's moments, so compare against pre-scaled gradients instead.
  auto p1 = torch::zeros({4}), p2 = torch::zeros({4});
  FlatAdamW a({}, 0, 4, torch::ones({4})), b({}, 0, 4, torch::ones({4}));
  a.step(p1, g, 0.1, coef);
  b.step(p2, g * coef, 0.1, 1.0);
  EXPECT_TRUE(torch::allclose(p1, p2, 1e-6, 1e-7));
}

// Dynamic loss scaling from 1024, growing after `growth_interval` clean steps.
LossScalerOptions scaling_from_1024(int64_t growth_interval) {
  LossScalerOptions o;
  o.enabled = true;
  o.init_scale = 1024;
  o.growth_interval = growth_interval;
  return o;
}

TEST(OptimTest, LossScalerSkipsOverflowAndBacksOff) {
  LossScaler scaler(scaling_from_1024(2));
  auto p = torch::ones({3});
  FlatAdamW adamw({}, 0, 3, torch::ones({3}));
  auto g = torch::tensor({1.0f, std::numeric_limits<float>::infinity(), 1.0f});
  const bool found_inf = !std::isfinite(grad_sq_sum(g));
  EXPECT_TRUE(found_inf);
  if (scaler.update(found_inf)) adamw.step(p, g, 0.1, 1.0 / scaler.scale());
  EXPECT_TRUE(torch::equal(p, torch::ones({3})));  // skipped
  EXPECT_EQ(scaler.skipped_steps(), 1);
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_TRUE(scaler.update(false));
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 1024.0);  // grew after growth_interval clean steps
  LossScaler off;
  EXPECT_EQ(off.scale(), 1.0);
  EXPECT_FALSE(off.update(true));  // fp32: a non-finite step is still not applied
}

TEST(OptimTest, LossScalerRestoredStateContinuesLikeTheOriginal) {
  const LossScalerOptions o = scaling_from_1024(3);
  LossScaler original(o);
  original.update(true);   // skip: 512
  original.update(false);  // 1 clean step
  original.update(false);  // 2 clean steps
  LossScaler restored(o);
  restored.restore(original.raw_scale(), original.clean_steps(), original.skipped_steps());
  EXPECT_EQ(restored.scale(), 512.0);
  EXPECT_EQ(restored.skipped_steps(), 1);
  original.update(false);  // third clean step: grows
  restored.update(false);
  EXPECT_EQ(restored.scale(), original.scale());
  EXPECT_EQ(restored.scale(), 1024.0);
  EXPECT_EQ(restored.clean_steps(), original.clean_steps());
}

}  // namespace
}  // namespace dnallm::optim
