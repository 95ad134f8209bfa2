// Small pieces the blocks and the model share (implementation details of the transformer's
// .cpp files): Hugging Face-named module holders and the norms.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>

namespace dnallm::models::detail {

using torch::Tensor;

// The empty module `name` under `parent`: a level of Hugging Face's parameter names.
inline std::shared_ptr<torch::nn::Module> holder(torch::nn::Module& parent,
                                                 const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

// LayerNorm in fp32 (LibTorch 1.13's CPU autocast passes bf16 activations to layer_norm with
// fp32 weights, which it then rejects); a no-op without autocast. Its weight and bias are cast
// up too where they are bf16 (ZeRO-3's bf16 gathers, Note [Fully sharded mixed precision]):
// CPU layer_norm takes no fp32 input with bf16 weights; fp32 ones pass unchanged.
inline Tensor norm(torch::nn::LayerNorm& ln, const Tensor& x) {
  const auto xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  if (!ln->weight.defined() || ln->weight.scalar_type() == torch::kFloat32) return ln(xf);
  const auto& o = ln->options;
  return torch::layer_norm(xf, o.normalized_shape(), ln->weight.to(torch::kFloat32),
                           ln->bias.defined() ? ln->bias.to(torch::kFloat32) : Tensor(), o.eps());
}

// RMSNorm as Llama computes it: in fp32, x / sqrt(mean(x^2) + eps), times the weight.
inline Tensor rms_norm(const Tensor& weight, const Tensor& x, double eps) {
  auto xf = x.to(torch::kFloat32);
  return weight * (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps));
}

}  // namespace dnallm::models::detail
