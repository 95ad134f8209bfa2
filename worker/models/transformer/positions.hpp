// Positions: rotary (Note [Rotary variants]) and ALiBi (Note [ALiBi]); learned positions are
// the model's position_embeddings table (transformer.cpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace dnallm::models {

// Rotary embedding in the "rotate half" form: x * cos + rotate_half(x) * sin, on the first
// cos.size(-1) channels of x (Note [Rotary variants] in positions.cpp); the others pass unchanged.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos,
                         const torch::Tensor& sin);

// cos/sin tables [T, dims] (dims: rotary_dims(), base `theta`: Note [Rotary variants]) for
// positions [start, start + T), or for the positions `at` (int64 [T]) when defined (context
// parallelism: global positions).
std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t start, int64_t len, int64_t dims,
                                                    double theta, const torch::Device& device,
                                                    const torch::Tensor& at = {});

// Note [ALiBi]: the per-head slopes (Press et al., as MosaicBERT/DNABERT-2 compute them): for
// n a power of two, 2^(-8 (i + 1) / n); otherwise the slopes of the power of two below n, then
// every second slope of twice that power, up to n.
std::vector<double> alibi_slopes(int64_t heads);
// The additive biases [1, H, Tq, Tk] = -slope_h * |q_i - k_j| for query positions
// [q_start, q_start + tq) and key positions [0, tk).
torch::Tensor alibi_bias(int64_t heads, int64_t q_start, int64_t tq, int64_t tk,
                         const torch::Device& device);

}  // namespace dnallm::models
