#include "worker/models/lora_linear.hpp"

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "worker/models/quantized_weight.hpp"

namespace dnallm::models {

using torch::Tensor;

LoraLinearImpl::LoraLinearImpl(int64_t in, int64_t out, bool with_bias) {
  weight = register_parameter("weight", torch::empty({out, in}));
  torch::NoGradGuard no_grad;
  weight.normal_(0.0, 0.02);
  if (with_bias) bias = register_parameter("bias", torch::zeros({out}));
}

void LoraLinearImpl::enable_lora(int64_t r, double alpha, double dropout) {
  weight.set_requires_grad(false);
  if (bias.defined()) bias.set_requires_grad(false);
  if (has_lora() && scaling_ != 0.0) {  // enabled while its block was built: trainable again
    lora_a_.set_requires_grad(true);
    lora_b_.set_requires_grad(true);
    return;
  }
  const int64_t out = weight.size(0), in = weight.size(1);
  auto opts = weight.options();
  lora_a_ = register_parameter("lora_A", torch::empty({r, in}, opts));
  lora_b_ = register_parameter("lora_B", torch::zeros({out, r}, opts));
  {
    torch::NoGradGuard no_grad;
    // PEFT's default: A Kaiming-uniform, B zero, so the adapter starts as the identity.
    lora_a_.uniform_(-1.0 / std::sqrt(double(in)), 1.0 / std::sqrt(double(in)));
  }
  scaling_ = alpha / double(r);
  lora_dropout_ = dropout;
}

void LoraLinearImpl::set_quantized(std::shared_ptr<QuantizedWeight> q) {
  quantized_ = std::move(q);
  torch::NoGradGuard no_grad;
  weight.set_data(torch::empty({0}, weight.options()));
}

Tensor LoraLinearImpl::full_weight() const {
  return quantized_ ? quantized_->dequantize().to(weight.dtype()) : weight;
}

void LoraLinearImpl::merge_lora() {
  if (!has_lora()) return;
  torch::NoGradGuard no_grad;
  if (quantized_) {  // merging needs the full-precision base back
    weight.set_data(full_weight());
    quantized_.reset();
  }
  weight.add_(torch::matmul(lora_b_, lora_a_), scaling_);
  // LibTorch cannot unregister a parameter; zeroing B makes the adapter a no-op and the
  // export skips lora_* tensors. Mark merged so forward skips the adapter path.
  lora_b_.zero_();
  lora_a_.set_requires_grad(false);
  lora_b_.set_requires_grad(false);
  scaling_ = 0.0;
}

// Note [at::linear, not nn::functional::linear]: LibTorch's C++ frontend
// torch::nn::functional::linear fuses the bias into the GEMM (addmm) only for 2-D input; for
// [B, T, H] it runs matmul and then `+= bias`, one more pass over every activation, and its
// backward a separate reduction for the bias gradient. torch::linear (at::linear, what
// Python's F.linear calls) flattens a contiguous 3-D input and runs addmm. Found by
// profiling bench/train against PyTorch (docs/benchmarks.md).
Tensor LoraLinearImpl::forward(const Tensor& x) {
  // See Note [at::linear, not nn::functional::linear].
  auto y = quantized_ ? quantized_->linear(x, bias) : torch::linear(x, weight, bias);
  if (has_lora() && scaling_ != 0.0) {
    auto xd = lora_dropout_ > 0 && is_training() ? torch::dropout(x, lora_dropout_, true) : x;
    y = y + torch::linear(torch::linear(xd, lora_a_), lora_b_) * scaling_;
  }
  return y;
}

LoraLinearImpl::LoraLinearImpl(const torch::nn::Linear& base) {
  weight = register_parameter("weight", base->weight);
  if (base->bias.defined()) bias = register_parameter("bias", base->bias);
}

Tensor LoraLinearImpl::effective_weight() const {
  if (!has_lora() || scaling_ == 0.0) return weight;
  return weight + torch::matmul(lora_b_, lora_a_) * scaling_;
}

bool is_lora_parameter(const std::string& name) {
  const auto ends = [&](const char* tail) {
    const std::string t(tail);
    return name.size() > t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
  };
  return ends(".lora_A") || ends(".lora_B");
}

std::vector<Tensor> quantized_storage(torch::nn::Module& module) {
  std::vector<Tensor> out;
  const auto take = [&](torch::nn::Module& m) {
    const auto* linear = m.as<LoraLinearImpl>();
    if (linear == nullptr || !linear->quantized()) return;
    for (auto& t : linear->quantized()->storage()) out.push_back(std::move(t));
  };
  // (the module itself apart: modules() can list it only when a shared_ptr holds it, which a
  // block being built need not be)
  take(module);
  for (const auto& m : module.modules(/*include_self=*/false)) take(*m);
  return out;
}

std::map<std::string, std::shared_ptr<LoraLinearImpl>> lora_or_quantized_linears(
    torch::nn::Module& model) {
  std::map<std::string, std::shared_ptr<LoraLinearImpl>> out;
  for (const auto& item : model.named_modules()) {
    auto lin = std::dynamic_pointer_cast<LoraLinearImpl>(item.value());
    if (lin == nullptr || (!lin->has_lora() && !lin->quantized())) continue;
    out[item.key() + ".weight"] = lin;
  }
  return out;
}

Tensor full_linear_weight(const LoraLinearImpl& linear, bool merge_adapters) {
  torch::NoGradGuard no_grad;
  auto w = linear.full_weight();
  if (merge_adapters && linear.has_lora()) {
    auto params = linear.named_parameters(false);
    w = w + torch::matmul(params["lora_B"], params["lora_A"]) * linear.lora_scaling();
  }
  return w.detach();
}

}  // namespace dnallm::models
