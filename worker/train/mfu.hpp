// Model FLOPs utilisation: pure functions (no LibTorch), unit-tested.
//
// Note [Model FLOPs]: per token, a training step costs 6 FLOPs per trainable parameter
// (2 forward, 2 for the input gradients, 2 for the weight gradients) and 4 per frozen one
// (no weight gradient; LoRA's frozen base still back-propagates), plus attention's
// 12 x layers x hidden x sequence (QK^T and AV, forward and backward), as in the PaLM paper's
// appendix and the accounting. MFU = tokens/s x FLOPs/token / (devices x peak).
#pragma once

#include <cstdint>
#include <string>

namespace dnallm::train {

inline double model_flops_per_token(int64_t trainable, int64_t frozen, int64_t layers,
                                    int64_t hidden, int64_t sequence) {
  return 6.0 * double(trainable) + 4.0 * double(frozen) +
         12.0 * double(layers) * double(hidden) * double(sequence);
}

// Peak dense bf16 TFLOP/s of a device from its name ("NVIDIA H100 80GB HBM3"); 0 if unknown.
inline double known_peak_tflops(const std::string& device_name) {
  if (device_name.find("H100") != std::string::npos) return 989.0;
  if (device_name.find("H200") != std::string::npos) return 989.0;
  if (device_name.find("A100") != std::string::npos) return 312.0;
  return 0.0;
}

// Fraction of the peak (0..1); 0 when the peak is unknown (<= 0).
inline double mfu(double tokens_per_s, double flops_per_token, double peak_tflops, int devices) {
  if (peak_tflops <= 0.0 || devices <= 0) return 0.0;
  return tokens_per_s * flops_per_token / (double(devices) * peak_tflops * 1e12);
}

}  // namespace dnallm::train
