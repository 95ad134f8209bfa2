// Note [LoRA linear]: the low-rank adapter every family with LoRA puts on its target linears
// (Hu et al., 2021; PEFT's layout): y = x W^T + b + (alpha / r) B A x, with lora_A [r, in] and
// lora_B [out, r] registered beside the base weight and bias ("<linear>.lora_A", PEFT's shapes
// and initialisation: A Kaiming-uniform, B zero, so an adapter starts as the identity). With an
// adapter, W and b are frozen and only A and B train. A linear shared between two uses (BiMamba's
// tied projections, RCPS's two strands) is one module and so carries one adapter.
// The transformer's, HyenaDNA's and Caduceus' target linears are LoraLinears.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dnallm::models {

class QuantizedWeight;  // worker/models/quantized_weight.hpp

// [lora] as a family applies it: rank, scaling alpha / r, dropout on the adapter's input, and
// the names of the linears that get adapters.
struct LoraOptions {
  int64_t r = 0;
  double alpha = 16.0;
  double dropout = 0.0;
  std::vector<std::string> targets;
};

class LoraLinearImpl : public torch::nn::Module {
 public:
  // A fresh linear: W ~ N(0, 0.02), b = 0 (the transformer's initialisation).
  LoraLinearImpl(int64_t in, int64_t out, bool bias = true);
  // `base`'s weight and bias (torch::nn::Linear's initialisation, as the reference code of
  // HyenaDNA and Caduceus draws it), under the same names.
  explicit LoraLinearImpl(const torch::nn::Linear& base);
  // Again on an adapter already there: marks it trainable (and the base frozen), draws nothing.
  void enable_lora(int64_t r, double alpha, double dropout);
  // Folds B A into W and removes the adapter (export path).
  void merge_lora();
  bool has_lora() const { return lora_a_.defined(); }
  double lora_scaling() const { return scaling_; }  // alpha / r
  // Replaces the base weight by a quantized one (INT8/NF4, quantized_weight.hpp): `weight`
  // becomes an empty tensor and forward computes the base product through `q`.
  void set_quantized(std::shared_ptr<QuantizedWeight> q);
  const std::shared_ptr<QuantizedWeight>& quantized() const { return quantized_; }
  // The base weight in full precision (dequantized when quantized).
  torch::Tensor full_weight() const;
  // The weight forward() applies, W + (alpha / r) B A, in the autograd graph (for a caller that
  // takes rows of it); `weight` itself without an adapter. Not for a quantized base.
  torch::Tensor effective_weight() const;
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;

 private:
  torch::Tensor lora_a_, lora_b_;
  double scaling_ = 0.0;
  double lora_dropout_ = 0.0;
  std::shared_ptr<QuantizedWeight> quantized_;
};
TORCH_MODULE(LoraLinear);

// True for a parameter name of an adapter ("....lora_A" / "....lora_B"): what exports of the
// base leave out.
bool is_lora_parameter(const std::string& name);

// The tensors that hold the quantized base weights of every LoraLinear under `module` (a block),
// in module order (QuantizedWeight::storage(): a QLoRA base's NF4 codes and scales). Frozen and
// not parameters: what ZeRO-3 shards with the block's frozen base (Note [Fully sharded
// quantized base], worker/parallel/fully_sharded.hpp).
std::vector<torch::Tensor> quantized_storage(torch::nn::Module& module);

// Every LoRA or quantized linear of `model`, by parameter name ("<module>.weight"), and one such
// linear's full-precision weight: a quantized base dequantized, plus the adapter when
// `merge_adapters`. A copy: the live model keeps training with its adapters. Every export reads
// them so, one linear at a time (LiveWeights, Note [Exports unit by unit] in family_io.hpp).
std::map<std::string, std::shared_ptr<LoraLinearImpl>> lora_or_quantized_linears(
    torch::nn::Module& model);
torch::Tensor full_linear_weight(const LoraLinearImpl& linear, bool merge_adapters);

}  // namespace dnallm::models
