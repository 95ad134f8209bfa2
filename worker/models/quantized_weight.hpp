// Quantized weights for the linear layers (LoraLinear): INT8 dynamic quantisation for
// inference (what PyTorch's quantize_dynamic does to nn.Linear) and 4-bit NormalFloat (NF4)
// with block scales and double quantisation for QLoRA (Dettmers et al., 2023).
//
// A LoraLinear holding a QuantizedWeight computes its base product through it and keeps no
// full-precision weight (its `weight` parameter becomes an empty tensor), so the memory of
// the frozen base is the quantized bytes alone. Adapters (lora_A, lora_B), biases and task
// heads stay in full precision and train as usual. See Note [NF4 layout]. Which layers are
// converted: quantize_linears (worker/models/transformer/quantized_linear.hpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace dnallm::models {

// A frozen weight [out, in] in a compact format. Thread-compatible: const methods may be
// called concurrently.
class QuantizedWeight {
 public:
  virtual ~QuantizedWeight() = default;
  // y = x W^T + b for x [..., in]; `bias` may be undefined. The result has x's dtype.
  virtual torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& bias) const = 0;
  // The weight in full precision (fp32) on the storage device.
  virtual torch::Tensor dequantize() const = 0;
  // Bytes the weight occupies (codes, scales and constants; no bias).
  virtual int64_t bytes() const = 0;
  virtual const char* format() const = 0;  // "int8" | "nf4"
  // Its full-precision shape [out, in], read without dequantising (a ZeRO-3 rank may hold no
  // codes at that moment).
  virtual std::vector<int64_t> shape() const = 0;
  // The tensors that hold the weight, frozen and dense (NF4: its codes, block scales and their
  // scales; none for INT8, whose packed weight is opaque). Note [Fully sharded quantized base]:
  // ZeRO-3 points them (set_data) into its gathered buffer and releases it between uses, so
  // every use reads them through these same tensors.
  virtual std::vector<torch::Tensor> storage() const { return {}; }
};

// Note [NF4 layout]: the weight is flattened row-major and cut into blocks of
// kNf4BlockSize values. Each block stores one absmax; each value the index (4 bits, two per
// byte, the first value in the high nibble as bitsandbytes does) of the nearest of the 16
// NF4 levels (quantiles of N(0, 1) scaled to [-1, 1], exact 0 included) to value / absmax.
// Double quantisation: the fp32 absmaxes (one per 64 values = 0.5 bit per value) are
// themselves quantised: their mean is subtracted and the rest is stored as int8 in blocks
// of kNf4ScaleBlockSize with one fp32 scale each (the paper uses an 8-bit float code there;
// linear int8 is used here), bringing the constants to 8/64 + 32/(64*256) = 0.127 bit per
// value. Storage per value: 4.127 bits (0.258x bf16).
inline constexpr int64_t kNf4BlockSize = 64;
inline constexpr int64_t kNf4ScaleBlockSize = 256;

// The 16 NF4 levels, ascending (bitsandbytes' table).
const float* nf4_levels();

struct Nf4Tensor {
  torch::Tensor codes;         // uint8 [ceil(numel / 2)] two 4-bit indices per byte
  torch::Tensor absmax_q;      // int8 [blocks]
  torch::Tensor absmax_scale;  // fp32 [ceil(blocks / kNf4ScaleBlockSize)]
  double absmax_offset = 0.0;  // mean of the block absmaxes
  torch::Tensor levels;        // fp32 [16] the code book, on the codes' device
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t bytes() const;
};

// Pure functions: quantise any float tensor, and back (fp32, `shape`).
Nf4Tensor nf4_quantize(const torch::Tensor& weight);
torch::Tensor nf4_dequantize(const Nf4Tensor& q);
// The per-block absmax after double quantisation (fp32 [blocks]): what dequantize scales by.
torch::Tensor nf4_block_absmax(const Nf4Tensor& q);

std::shared_ptr<QuantizedWeight> make_nf4_weight(const torch::Tensor& weight);
// Per-tensor symmetric int8 weight, activations quantised per call (dynamic). CPU only:
// throws Error(kUsage) on another device or when LibTorch lacks the quantized CPU kernels.
std::shared_ptr<QuantizedWeight> make_int8_weight(const torch::Tensor& weight,
                                                  const torch::Tensor& bias);

enum class WeightFormat { kFull, kInt8, kNf4 };
// "none" | "fp32" -> kFull, "int8", "nf4"; throws Error(kUsage) naming `what` otherwise.
WeightFormat parse_weight_format(const std::string& name, const std::string& what);
// lora.quantize_base: none -> kFull, nf4 -> kNf4.
WeightFormat weight_format_of(cfg::QuantizeBase base);

}  // namespace dnallm::models
