#include "worker/optim/flat_adamw.hpp"

#include <torch/version.h>

#include <cmath>

#include "core/enum_names.hpp"
#include "core/error.hpp"

namespace dnallm::optim {

bool decays(const std::string& name) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("bias")) return false;
  if (name.find("LayerNorm") != std::string::npos || name.find("layer_norm") != std::string::npos ||
      name.find("norm.") != std::string::npos) {
    return false;
  }
  return true;
}

FlatParameters::FlatParameters(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    torch::Device device) {
  int64_t total = 0;
  for (const auto& [name, p] : named_parameters) {
    if (!p.requires_grad()) continue;
    entries_.push_back({name, total, p.numel(), p.sizes().vec()});
    total += p.numel();
  }
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  params_ = torch::empty({total}, opts);
  grads_ = torch::zeros({total}, opts);
  decay_mask_ = torch::empty({total}, opts);
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& [name, p] : named_parameters) {
    if (!p.requires_grad()) continue;
    const auto& e = entries_[i++];
    auto view = params_.narrow(0, e.offset, e.numel);
    view.copy_(p.detach().reshape({-1}));
    decay_mask_.narrow(0, e.offset, e.numel).fill_(decays(name) ? 1.0 : 0.0);
    // set_data keeps the Parameter object (and its autograd identity) but swaps storage.
    auto param = p;
    param.set_data(view.view(e.shape));
    param.mutable_grad() = grads_.narrow(0, e.offset, e.numel).view(e.shape);
  }
  global_numel_ = total;
  pieces_ = {{0, total, 0}};
}

FlatParameters::FlatParameters(std::vector<Entry> entries, int64_t global_numel,
                               torch::Tensor params, torch::Tensor grads, torch::Tensor decay_mask,
                               std::vector<Piece> pieces)
    : params_(std::move(params)),
      grads_(std::move(grads)),
      decay_mask_(std::move(decay_mask)),
      entries_(std::move(entries)),
      global_numel_(global_numel),
      sharded_(true),
      pieces_(std::move(pieces)) {
  for (const auto& p : pieces_) {
    DNALLM_CHECK(p.global_begin >= 0 && p.global_begin <= p.global_end &&
                     p.global_end <= global_numel_ && p.local_begin >= 0 &&
                     p.local_begin + (p.global_end - p.global_begin) <= params_.numel(),
                 ExitCode::kFailure, "shard piece [{}, {}) -> {} lies outside the buffers",
                 p.global_begin, p.global_end, p.local_begin);
  }
}

FlatAdamW::FlatAdamW(AdamWOptions options, int64_t begin, int64_t end,
                     torch::Tensor decay_mask_range)
    : options_(options), begin_(begin), end_(end), decay_mask_(std::move(decay_mask_range)) {
  DNALLM_CHECK(begin >= 0 && end >= begin && decay_mask_.numel() == end - begin, ExitCode::kFailure,
               "FlatAdamW range [{}, {}) does not match its decay mask ({})", begin, end,
               decay_mask_.numel());
  exp_avg_ = torch::zeros_like(decay_mask_);
  exp_avg_sq_ = torch::zeros_like(decay_mask_);
  scratch_ = torch::empty_like(decay_mask_);
  if (decay_mask_.is_cuda()) {
    // Runs of equal decay: the fused kernel takes one weight decay per call. Read once here
    // (construction, not a training step).
    auto mask = decay_mask_.to(torch::kCPU);
    const float* m = mask.data_ptr<float>();
    const int64_t n = mask.numel();
    for (int64_t i = 0; i < n;) {
      int64_t j = i;
      while (j < n && m[j] == m[i]) ++j;
      (m[i] != 0.0f ? decay_runs_ : plain_runs_).emplace_back(i, j);
      i = j;
    }
    step_tensor_ = torch::zeros({}, decay_mask_.options());
  }
}

void FlatAdamW::step(torch::Tensor params, const torch::Tensor& grads, double lr,
                     const torch::Tensor& grad_scale) {
  torch::NoGradGuard no_grad;
  ++step_;
  if (fused()) {
    fused_step(params, grads, lr, grad_scale);
    return;
  }
  const double b1 = options_.beta1, b2 = options_.beta2;
  // s g in the scratch buffer, then the moments as step(double) with s = 1.
  torch::mul_out(scratch_, grads, grad_scale);
  exp_avg_.mul_(b1).add_(scratch_, 1.0 - b1);
  exp_avg_sq_.mul_(b2).addcmul_(scratch_, scratch_, 1.0 - b2);
  apply_update(params, lr);
}

void FlatAdamW::step(torch::Tensor params, const torch::Tensor& grads, double lr,
                     double grad_scale) {
  torch::NoGradGuard no_grad;
  ++step_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  // m = b1 m + (1 - b1) s g ;  v = b2 v + (1 - b2) s^2 g^2
  exp_avg_.mul_(b1).add_(grads, (1.0 - b1) * grad_scale);
  exp_avg_sq_.mul_(b2).addcmul_(grads, grads, (1.0 - b2) * grad_scale * grad_scale);
  apply_update(params, lr);
}

void FlatAdamW::apply_update(torch::Tensor& params, double lr) {
  const double bc1 = 1.0 - std::pow(options_.beta1, double(step_));
  const double bc2 = 1.0 - std::pow(options_.beta2, double(step_));
  // Decoupled decay, as torch.optim.AdamW: p -= lr * wd * mask * p (before the Adam update).
  if (options_.weight_decay != 0.0) {
    params.addcmul_(params, decay_mask_, -lr * options_.weight_decay);
  }
  // p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
  torch::sqrt_out(scratch_, exp_avg_sq_);
  scratch_.div_(std::sqrt(bc2)).add_(options_.eps);
  params.addcdiv_(exp_avg_, scratch_, -lr / bc1);
}

void FlatAdamW::fused_step(torch::Tensor& params, const torch::Tensor& grads, double lr,
                           const torch::Tensor& grad_scale) {
  step_tensor_.add_(1.0);
  // The kernel divides the gradients by grad_scale (and writes them back unscaled).
  const auto divisor = grad_scale.reciprocal();
  auto run = [&](const std::vector<std::pair<int64_t, int64_t>>& runs, double wd) {
    if (runs.empty()) return;
    std::vector<torch::Tensor> p, g, m, v;
    for (const auto& [a, b] : runs) {
      p.push_back(params.narrow(0, a, b - a));
      g.push_back(grads.narrow(0, a, b - a));
      m.push_back(exp_avg_.narrow(0, a, b - a));
      v.push_back(exp_avg_sq_.narrow(0, a, b - a));
    }
    const std::vector<torch::Tensor> steps(runs.size(), step_tensor_);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, options_.beta1, options_.beta2,
                      wd, options_.eps, /*amsgrad=*/false, /*maximize=*/false, divisor,
                      /*found_inf=*/c10::nullopt);
  };
  run(decay_runs_, options_.weight_decay);
  run(plain_runs_, 0.0);
}

double grad_sq_sum(const torch::Tensor& grads) {
  torch::NoGradGuard no_grad;
  return grads.dot(grads).item<double>();
}

torch::Tensor grad_sq_sum_tensor(const torch::Tensor& grads) {
  torch::NoGradGuard no_grad;
  return grads.dot(grads);
}

double clip_coefficient(double total_norm, double max_norm) {
  if (max_norm <= 0.0 || !std::isfinite(total_norm)) return 1.0;
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

torch::Tensor clip_coefficient(const torch::Tensor& total_norm, double max_norm) {
  auto one = torch::ones_like(total_norm);
  if (max_norm <= 0.0) return one;
  return torch::where(torch::isfinite(total_norm), (max_norm / (total_norm + 1e-6)).clamp_max(1.0),
                      one);
}

namespace {

// training.lr_scheduler as the schedule's kind. See Note [Enum tables] (core/enum_names.hpp).
constexpr EnumName<cfg::LrScheduler, ScheduleKind> kScheduleKinds[] = {
    {cfg::LrScheduler::kConstant, ScheduleKind::kConstant},
    {cfg::LrScheduler::kLinear, ScheduleKind::kLinear},
    {cfg::LrScheduler::kCosine, ScheduleKind::kCosine}};
static_assert(lists_each_in_order<cfg::LrScheduler::kCosine>(kScheduleKinds));

}  // namespace

Schedule schedule_from_config(const TrainingConfig& t, int64_t total_steps) {
  Schedule s;
  s.kind = name_of(kScheduleKinds, t.lr_scheduler, ScheduleKind::kLinear);
  DNALLM_CHECK(t.lr > 0, ExitCode::kUsage, "training.lr = {} must be positive", t.lr);
  DNALLM_CHECK(t.warmup_ratio >= 0 && t.warmup_ratio <= 1, ExitCode::kUsage,
               "training.warmup_ratio = {} must be in [0, 1]", t.warmup_ratio);
  s.base_lr = t.lr;
  s.total_steps = std::max<int64_t>(1, total_steps);
  s.warmup_steps = t.warmup_steps > 0
                       ? t.warmup_steps
                       : static_cast<int64_t>(std::ceil(t.warmup_ratio * double(s.total_steps)));
  return s;
}

double lr_at(const Schedule& s, int64_t step) {
  if (step < s.warmup_steps)
    return s.base_lr * double(step) / double(std::max<int64_t>(1, s.warmup_steps));
  if (s.kind == ScheduleKind::kConstant) return s.base_lr;
  const double span = double(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
  const double progress = std::min(1.0, double(step - s.warmup_steps) / span);
  if (s.kind == ScheduleKind::kLinear) return s.base_lr * std::max(0.0, 1.0 - progress);
  return s.base_lr * 0.5 * (1.0 + std::cos(M_PI * progress));
}

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(options.init_scale) {}

bool LossScaler::update(bool found_inf) {
  if (!options_.enabled) return !found_inf;
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    clean_steps_ = 0;
    ++skipped_;
    return false;
  }
  if (++clean_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    clean_steps_ = 0;
  }
  return true;
}

}  // namespace dnallm::optim
