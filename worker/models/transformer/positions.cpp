#include "worker/models/transformer/positions.hpp"

#include <cmath>

#include "core/error.hpp"

namespace dnallm::models {

using torch::Tensor;

// Note [Rotary variants]: rotary positions as transformers' Llama and GPT-NeoX compute them.
// The frequencies are rope_theta^(-2i / d) for i < d / 2, d = rotary_dims() (base 10000 over
// the whole head unless the model says otherwise: Llama 3's rope_theta 500000, Pythia's
// rotary_pct 0.25); the tables hold [freqs, freqs] (d columns) and the first d channels of each
// query and key head rotate in the "rotate half" form, the others pass through unchanged
// (GPT-NeoX's apply_rotary_pos_emb: q[..., :d] rotated, then cat with q[..., d:]). With the
// defaults (10000, the whole head) the arithmetic is the one this project always did.

// Rotary embedding in the "rotate half" form: x * cos + rotate_half(x) * sin, on the first
// cos.size(-1) channels of x (Note [Rotary variants]); the others pass unchanged.
Tensor apply_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t rotated_dims = cos.size(-1);
  if (rotated_dims < x.size(-1)) {
    return torch::cat({apply_rope(x.narrow(-1, 0, rotated_dims), cos, sin),
                       x.narrow(-1, rotated_dims, x.size(-1) - rotated_dims)},
                      -1);
  }
  const int64_t half = x.size(-1) / 2;
  auto x1 = x.narrow(-1, 0, half);
  auto x2 = x.narrow(-1, half, half);
  auto rotated = torch::cat({-x2, x1}, -1);
  return x * cos.to(x.dtype()) + rotated * sin.to(x.dtype());
}

// cos/sin tables [T, dims] (dims: rotary_dims(), base `theta`: Note [Rotary variants]) for
// positions [start, start + T), or for the positions `at` (int64 [T]) when defined (context
// parallelism: global positions).
std::pair<Tensor, Tensor> rope_tables(int64_t start, int64_t len, int64_t dims, double theta,
                                      const torch::Device& device, const Tensor& at) {
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  auto inv_freq = torch::pow(theta, -torch::arange(0, dims, 2, opts) / double(dims));
  auto pos = at.defined() ? at.to(opts) : torch::arange(start, start + len, opts);
  auto freqs = torch::outer(pos, inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

// ---------------------------------------------------------------------------------------------
// ALiBi

std::vector<double> alibi_slopes(int64_t heads) {
  DNALLM_CHECK(heads > 0, ExitCode::kFailure, "alibi_slopes: {} heads", heads);
  auto power_of_two = [](int64_t n) {
    // 2^(-2^-(log2 n - 3)) = 2^(-8/n), raised to 1..n, as the reference computes it.
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(double(n)) - 3)));
    std::vector<double> s;
    for (int64_t i = 0; i < n; ++i) s.push_back(start * std::pow(start, double(i)));
    return s;
  };
  if ((heads & (heads - 1)) == 0) return power_of_two(heads);
  int64_t below = 1;
  while (below * 2 < heads) below *= 2;
  auto slopes = power_of_two(below);
  const auto twice = power_of_two(2 * below);
  for (size_t i = 0; i < twice.size() && int64_t(slopes.size()) < heads; i += 2) {
    slopes.push_back(twice[i]);
  }
  return slopes;
}

Tensor alibi_bias(int64_t heads, int64_t q_start, int64_t tq, int64_t tk,
                  const torch::Device& device) {
  const auto slopes64 = alibi_slopes(heads);
  std::vector<float> slopes(slopes64.begin(), slopes64.end());
  auto ints = torch::TensorOptions().dtype(torch::kInt64).device(device);
  auto distance = (torch::arange(0, tk, ints).unsqueeze(0) -
                   torch::arange(q_start, q_start + tq, ints).unsqueeze(1))
                      .abs();
  auto s = torch::tensor(slopes, torch::kFloat32).to(device).view({heads, 1, 1});
  return (s * distance.neg()).unsqueeze(0);  // fp32 [1, H, tq, tk]
}

}  // namespace dnallm::models
