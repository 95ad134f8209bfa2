// Note [Hyena fused mixer]: the Hyena operator between in_proj and out_proj on the CPU as one
// autograd function in the layout in_proj writes and out_proj reads (positions x channels), the
// reference's arithmetic without its transposes. The reference (and Note [Hyena]'s plain form)
// transposes in_proj's [B, L, 3d] output to [B, 3d, L] for the depthwise Conv1d, whose kernels
// copy a transposed input to a contiguous one in the forward and again in the backward (the
// largest single cost of a HyenaDNA layer on the CPU after the matrix products: 100 ms for
// 32k x 768 floats), pads for the FFT, and differentiates the FFTs through complex transforms
// of size 2L. Here:
//   forward   w = x1 * v written transposed into a zero-padded [B, d, 2L] buffer by blocks of
//             64 positions x 64 channels (the short filter computed on the fly: 3
//             multiply-adds a value), y = irfft(rfft(w) * rfft(k)) (real transforms of the padded
//             buffers, 1/2L in the inverse), s = y + D * w and o = s * x0 written back as
//             [B, L, d] by the same blocks (x0 again on the fly).
//   saved     u (in_proj's output), s [B, L, d], rfft(k) and rfft(w): 4d floats a position and
//             two spectra of L + 1 complex values a channel; x0, x1 and v are recomputed from u
//             (3 multiply-adds a value).
//   backward  ds = do * x0 (transposed into a padded buffer), dx0 = do * s; dw = irfft(rfft(ds)
//             * conj(rfft(k))) + D * ds, dk = irfft(sum over the batch of rfft(ds) *
//             conj(rfft(w))) (the correlations the convolution's adjoint is; the padding keeps
//             them linear), dD = sum ds * w (by Parseval, from dk's spectrum); dx1 = dw * v,
//             dv = dw * x1; then the short filter's backward in the same layout. Six real FFTs a
//             layer where autograd's form runs three real and two complex ones of twice the
//             size, plus the copies.
// Parameter gradients are summed in fixed position chunks (the sums do not depend on the
// thread count). Equal to the plain form up to float rounding
// (worker_hyena_test FusedMixerGivesThePlainOutputAndGradients: in double within 1e-12 and in
// float within 1e-5, the output and every gradient).
// The loops: the innermost ones over channels on restrict pointers, compiled for AVX-512, AVX2
// and the baseline (GCC target_clones); the outer ones over 64 x 64 blocks by at::parallel_for,
// which needs the file compiled with OpenMP (Note [OpenMP in our kernels], worker/CMakeLists.txt).
// At 32k tokens (d 256, one sequence, 2 threads) the mixer's forward takes 95 ms and its backward
// 140 ms where the plain form takes about 330 ms in all, and a 2-layer HyenaDNA step is 1.46-1.51x
// the reference's (bench/hyena/bench_hyena.sh, both with tcmalloc: Note [CPU allocator]).
// CPU only: on other devices, under context parallelism and in the chunked block (Note [Hyena
// chunked block]) the plain form runs.
#pragma once

#include <torch/torch.h>

namespace dnallm::models::hyena {

// Whether fused_mixer runs for in_proj's output `u`: a CPU tensor [B, L, 3d].
bool fused_mixer_applies(const torch::Tensor& u);

// The Hyena operator from in_proj's output to out_proj's input, Note [Hyena fused mixer]:
//   u [B, L, 3d]; short_weight [3d, 1, 3] and short_bias [3d] (the depthwise causal Conv1d,
//   padding 2); k [L, d] (the implicit filter, position-major); skip [d] (the filter's bias D).
// Returns v * x0 as [B, L, d] in u's dtype when that is double, else float32.
torch::Tensor fused_mixer(const torch::Tensor& u, const torch::Tensor& short_weight,
                          const torch::Tensor& short_bias, const torch::Tensor& k,
                          const torch::Tensor& skip);

}  // namespace dnallm::models::hyena
