#include "worker/models/hyena/hyena_mixer.hpp"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <vector>

#include "worker/models/fp32_region.hpp"

// Note [OpenMP in our kernels] (worker/CMakeLists.txt): at::parallel_for is serial in a file
// compiled without OpenMP.
#if defined(AT_PARALLEL_OPENMP) && AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile this file with -fopenmp: at::parallel_for would run its loops on one thread"
#endif

namespace dnallm::models::hyena {

using torch::Tensor;

namespace {

// The blocks the layout changes go by: 64 positions x 64 channels, so that a block's rows on the
// channel-major side are 256 contiguous bytes (4 cache lines) and the block fits L1.
inline constexpr int64_t kBlock = 64;

// Row kernels: the innermost loops over the channels of one position, on restrict pointers so
// that they vectorise, compiled for AVX-512, AVX2 and the baseline and picked at load time (GCC's
// target_clones; Note [Hyena fused mixer]).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DNALLM_ROW_KERNEL \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) static
#else
#define DNALLM_ROW_KERNEL static
#endif

// Tap pointers of channels [first, first + n): tap 0 multiplies u[t - 2], tap 2 u[t].
template <typename scalar_t>
struct Taps {
  const scalar_t *w0, *w1, *w2, *bias;
  Taps at(int64_t first) const { return {w0 + first, w1 + first, w2 + first, bias + first}; }
};

// out[c] = the short filter's value (x0, x1 or v) of channel c at a position with rows r0 = u[t],
// r1 = u[t - 1], r2 = u[t - 2] (offset to the first channel).
#define DNALLM_FILTERED(i) (bias[i] + w2[i] * r0[i] + w1[i] * r1[i] + w0[i] * r2[i])

// The row pointers r0, r1, r2 and the taps are offset to the first channel of the part the
// kernel reads first; `stride` is the distance to the next part (d), `count` the channels.
// out[i] = x1[i] * v[i] (pointers at x1).
template <typename scalar_t>
inline void gate_row_impl(const scalar_t* __restrict__ r0, const scalar_t* __restrict__ r1,
                          const scalar_t* __restrict__ r2, const scalar_t* __restrict__ w0,
                          const scalar_t* __restrict__ w1, const scalar_t* __restrict__ w2,
                          const scalar_t* __restrict__ bias, int64_t stride, int64_t count,
                          scalar_t* __restrict__ out) {
  for (int64_t i = 0; i < count; ++i) out[i] = DNALLM_FILTERED(i) * DNALLM_FILTERED(stride + i);
}

// out[i] = a[i] * x0[i]; copy[i] = a[i] (pointers at x0).
template <typename scalar_t>
inline void times_x0_row_impl(const scalar_t* __restrict__ r0, const scalar_t* __restrict__ r1,
                              const scalar_t* __restrict__ r2, const scalar_t* __restrict__ w0,
                              const scalar_t* __restrict__ w1, const scalar_t* __restrict__ w2,
                              const scalar_t* __restrict__ bias, int64_t count,
                              const scalar_t* __restrict__ a, scalar_t* __restrict__ out,
                              scalar_t* __restrict__ copy) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = a[i] * DNALLM_FILTERED(i);
    copy[i] = a[i];
  }
}

// ds[i] = g[i] * x0[i]; dx0[i] = g[i] * s[i] (pointers at x0).
template <typename scalar_t>
inline void output_backward_row_impl(
    const scalar_t* __restrict__ r0, const scalar_t* __restrict__ r1,
    const scalar_t* __restrict__ r2, const scalar_t* __restrict__ w0,
    const scalar_t* __restrict__ w1, const scalar_t* __restrict__ w2,
    const scalar_t* __restrict__ bias, int64_t count, const scalar_t* __restrict__ g,
    const scalar_t* __restrict__ s, scalar_t* __restrict__ ds, scalar_t* __restrict__ dx0) {
  for (int64_t i = 0; i < count; ++i) {
    ds[i] = g[i] * DNALLM_FILTERED(i);
    dx0[i] = g[i] * s[i];
  }
}

// dx1[i] = dw[i] * v[i]; dv[i] = dw[i] * x1[i] (pointers at x1).
template <typename scalar_t>
inline void gate_backward_row_impl(const scalar_t* __restrict__ r0, const scalar_t* __restrict__ r1,
                                   const scalar_t* __restrict__ r2, const scalar_t* __restrict__ w0,
                                   const scalar_t* __restrict__ w1, const scalar_t* __restrict__ w2,
                                   const scalar_t* __restrict__ bias, int64_t stride, int64_t count,
                                   const scalar_t* __restrict__ dw, scalar_t* __restrict__ dx1,
                                   scalar_t* __restrict__ dv) {
  for (int64_t i = 0; i < count; ++i) {
    dx1[i] = dw[i] * DNALLM_FILTERED(stride + i);
    dv[i] = dw[i] * DNALLM_FILTERED(i);
  }
}
#undef DNALLM_FILTERED

// The short filter's backward at one position: du = w2 g0 + w1 g1 + w0 g2 (g1, g2: the filtered
// gradient one and two positions later), and the taps' and bias's sums.
template <typename scalar_t>
inline void filter_backward_row_impl(
    const scalar_t* __restrict__ g0, const scalar_t* __restrict__ g1,
    const scalar_t* __restrict__ g2, const scalar_t* __restrict__ u0,
    const scalar_t* __restrict__ u1, const scalar_t* __restrict__ u2,
    const scalar_t* __restrict__ w0, const scalar_t* __restrict__ w1,
    const scalar_t* __restrict__ w2, int64_t n, scalar_t* __restrict__ du,
    scalar_t* __restrict__ a0, scalar_t* __restrict__ a1, scalar_t* __restrict__ a2,
    scalar_t* __restrict__ ab) {
  for (int64_t c = 0; c < n; ++c) {
    du[c] = w2[c] * g0[c] + w1[c] * g1[c] + w0[c] * g2[c];
    a0[c] += u2[c] * g0[c];
    a1[c] += u1[c] * g0[c];
    a2[c] += u0[c] * g0[c];
    ab[c] += g0[c];
  }
}

// Spectra as interleaved (real, imaginary) pairs, m of them.
// out = conj(a) * b, or out += conj(a) * b.
template <typename scalar_t>
inline void conj_mul_row_impl(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                              int64_t m, scalar_t* __restrict__ out, bool accumulate) {
  if (accumulate) {
    for (int64_t i = 0; i < m; ++i) {
      out[2 * i] += a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1];
      out[2 * i + 1] += a[2 * i] * b[2 * i + 1] - a[2 * i + 1] * b[2 * i];
    }
  } else {
    for (int64_t i = 0; i < m; ++i) {
      out[2 * i] = a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1];
      out[2 * i + 1] = a[2 * i] * b[2 * i + 1] - a[2 * i + 1] * b[2 * i];
    }
  }
}

// a *= conj(k).
template <typename scalar_t>
inline void mul_conj_row_impl(scalar_t* __restrict__ a, const scalar_t* __restrict__ k, int64_t m) {
  for (int64_t i = 0; i < m; ++i) {
    const scalar_t re = a[2 * i] * k[2 * i] + a[2 * i + 1] * k[2 * i + 1];
    const scalar_t im = a[2 * i + 1] * k[2 * i] - a[2 * i] * k[2 * i + 1];
    a[2 * i] = re;
    a[2 * i + 1] = im;
  }
}

// Parseval for the spectrum p (m = n / 2 + 1 bins) of a product of two real signals of length n:
// their dot product, (p_0 + 2 (p_1 + ... + p_{m-2}) + p_{m-1}) / n on the real parts.
template <typename scalar_t>
inline double parseval_row_impl(const scalar_t* __restrict__ p, int64_t m, int64_t n) {
  scalar_t part[8] = {};
  int64_t i = 1;
  for (; i + 8 <= m - 1; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += p[2 * (i + j)];
  }
  double inner = 0;
  for (; i < m - 1; ++i) inner += double(p[2 * i]);
  for (int j = 0; j < 8; ++j) inner += double(part[j]);
  return (double(p[0]) + 2 * inner + double(p[2 * (m - 1)])) / double(n);
}

#define DNALLM_ROW_KERNELS(T)                                                                      \
  DNALLM_ROW_KERNEL void gate_row(const T* r0, const T* r1, const T* r2, Taps<T> w,                \
                                  int64_t stride, int64_t count, T* out) {                         \
    gate_row_impl(r0, r1, r2, w.w0, w.w1, w.w2, w.bias, stride, count, out);                       \
  }                                                                                                \
  DNALLM_ROW_KERNEL void times_x0_row(const T* r0, const T* r1, const T* r2, Taps<T> w,            \
                                      int64_t count, const T* a, T* out, T* copy) {                \
    times_x0_row_impl(r0, r1, r2, w.w0, w.w1, w.w2, w.bias, count, a, out, copy);                  \
  }                                                                                                \
  DNALLM_ROW_KERNEL void output_backward_row(const T* r0, const T* r1, const T* r2, Taps<T> w,     \
                                             int64_t count, const T* g, const T* s, T* ds,         \
                                             T* dx0) {                                             \
    output_backward_row_impl(r0, r1, r2, w.w0, w.w1, w.w2, w.bias, count, g, s, ds, dx0);          \
  }                                                                                                \
  DNALLM_ROW_KERNEL void gate_backward_row(const T* r0, const T* r1, const T* r2, Taps<T> w,       \
                                           int64_t stride, int64_t count, const T* dw, T* dx1,     \
                                           T* dv) {                                                \
    gate_backward_row_impl(r0, r1, r2, w.w0, w.w1, w.w2, w.bias, stride, count, dw, dx1, dv);      \
  }                                                                                                \
  DNALLM_ROW_KERNEL void filter_backward_row(const T* g0, const T* g1, const T* g2, const T* u0,   \
                                             const T* u1, const T* u2, Taps<T> w, int64_t n,       \
                                             T* du, T* acc) {                                      \
    filter_backward_row_impl(g0, g1, g2, u0, u1, u2, w.w0, w.w1, w.w2, n, du, acc, acc + n,        \
                             acc + 2 * n, acc + 3 * n);                                            \
  }                                                                                                \
  DNALLM_ROW_KERNEL void conj_mul_row(const T* a, const T* b, int64_t m, T* out,                   \
                                      bool accumulate) {                                           \
    conj_mul_row_impl(a, b, m, out, accumulate);                                                   \
  }                                                                                                \
  DNALLM_ROW_KERNEL void mul_conj_row(T* a, const T* k, int64_t m) { mul_conj_row_impl(a, k, m); } \
  DNALLM_ROW_KERNEL double parseval_row(const T* p, int64_t m, int64_t n) {                        \
    return parseval_row_impl(p, m, n);                                                             \
  }
DNALLM_ROW_KERNELS(float)
DNALLM_ROW_KERNELS(double)
#undef DNALLM_ROW_KERNELS
#undef DNALLM_ROW_KERNEL

// The shape of one call: u [B, L, 3d], the padded transforms of length n = 2L.
struct Shape {
  int64_t B, L, d, n;
  static Shape of(const Tensor& u) { return {u.size(0), u.size(1), u.size(2) / 3, 2 * u.size(1)}; }
};

// A block of positions [t0, t1) and channels [c0, c1) of sequence b.
struct Block {
  int64_t b, t0, t1, c0, c1;
  int64_t positions() const { return t1 - t0; }
  int64_t channels() const { return c1 - c0; }
};

// The causal depthwise filter of Note [Hyena fused mixer]: value c of position t is
// bias[c] + w2[c] u[t, c] + w1[c] u[t - 1, c] + w0[c] u[t - 2, c] (zero before the sequence).
template <typename scalar_t>
struct ShortFilter {
  const scalar_t* u;                // [B, L, 3d]
  Taps<scalar_t> taps;              // each [3d]
  int64_t L, width;                 // width = 3d
  std::vector<scalar_t> zero_row_;  // [3d]: the rows before the sequence

  ShortFilter(const Tensor& u_, const Tensor& taps_, const Tensor& bias)
      : u(u_.data_ptr<scalar_t>()), L(u_.size(1)), width(u_.size(2)), zero_row_(width) {
    const scalar_t* t = taps_.data_ptr<scalar_t>();  // [3, 3d]
    taps = {t, t + width, t + 2 * width, bias.data_ptr<scalar_t>()};
  }
  ShortFilter(const ShortFilter&) = delete;
  ShortFilter& operator=(const ShortFilter&) = delete;
  const scalar_t* zeros() const { return zero_row_.data(); }
  // Row t of sequence b (zeros before the sequence).
  const scalar_t* row(int64_t b, int64_t t) const {
    return t < 0 ? zeros() : u + (b * L + t) * width;
  }
};

// Runs f(block, tile) for every block of positions and channels of every sequence, in parallel
// (the channel blocks of a position block one after the other, so u's rows stay in cache);
// `tile` is the thread's [kBlock, kBlock] scratch.
template <typename scalar_t, typename F>
void for_blocks(int64_t B, int64_t L, int64_t d, F&& f) {
  const int64_t tb = (L + kBlock - 1) / kBlock, cb = (d + kBlock - 1) / kBlock;
  at::parallel_for(0, B * tb * cb, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> tile(kBlock * kBlock);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (tb * cb), t0 = (i / cb % tb) * kBlock, c0 = (i % cb) * kBlock;
      f(Block{b, t0, std::min(L, t0 + kBlock), c0, std::min(d, c0 + kBlock)}, tile.data());
    }
  });
}

// dst[j * dst_ld + i] = src[i * src_ld + j] for i < rows, j < cols (contiguous writes).
template <typename scalar_t>
void transpose_block(const scalar_t* src, int64_t src_ld, scalar_t* dst, int64_t dst_ld,
                     int64_t rows, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    scalar_t* out = dst + j * dst_ld;
    for (int64_t i = 0; i < rows; ++i) out[i] = src[i * src_ld + j];
  }
}

// tile[t][c] = a[c][t] + D[c] * b[c][t] over a block (a and b at the block's first channel and
// position, rows of length ld; D at its first channel).
template <typename scalar_t>
void channels_to_tile(const scalar_t* a, const scalar_t* b, const scalar_t* D, int64_t ld,
                      const Block& k, scalar_t* tile) {
  const int64_t C = k.channels();
  for (int64_t c = 0; c < C; ++c) {
    const scalar_t *ra = a + c * ld, *rb = b + c * ld;
    for (int64_t t = 0; t < k.positions(); ++t) tile[t * C + c] = ra[t] + D[c] * rb[t];
  }
}

// Zeroes positions [L, n) of every row of a [rows, n] buffer.
template <typename scalar_t>
void zero_tail(scalar_t* p, int64_t rows, int64_t L, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::fill(p + r * n + L, p + (r + 1) * n, scalar_t(0));
  });
}

// Element (b, c, t) of a [B, d, n] buffer.
inline int64_t channel_major(const Shape& s, int64_t b, int64_t c, int64_t t) {
  return (b * s.d + c) * s.n + t;
}

// w = x1 * v of every position, transposed into a zero-padded [B, d, n] buffer.
template <typename scalar_t>
Tensor gated_input(const ShortFilter<scalar_t>& f, const Shape& s, const Tensor& like) {
  auto out = torch::empty({s.B, s.d, s.n}, like.options());
  scalar_t* w = out.data_ptr<scalar_t>();
  for_blocks<scalar_t>(s.B, s.L, s.d, [&](const Block& k, scalar_t* tile) {
    const int64_t C = k.channels(), at = s.d + k.c0;  // x1's channel c0
    for (int64_t t = k.t0; t < k.t1; ++t) {
      gate_row(f.row(k.b, t) + at, f.row(k.b, t - 1) + at, f.row(k.b, t - 2) + at, f.taps.at(at),
               s.d, C, tile + (t - k.t0) * C);
    }
    transpose_block(tile, C, w + channel_major(s, k.b, k.c0, k.t0), s.n, k.positions(), C);
  });
  zero_tail(w, s.B * s.d, s.L, s.n);
  return out;
}

// A [L, d] position-major tensor into a zero-padded [d, n] channel-major buffer (to_channels),
// or the first L positions of such a buffer into a [L, d] tensor.
template <typename scalar_t>
Tensor change_layout(const Tensor& in, const Shape& s, bool to_channels) {
  auto out =
      to_channels ? torch::empty({s.d, s.n}, in.options()) : torch::empty({s.L, s.d}, in.options());
  const scalar_t* src = in.data_ptr<scalar_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  for_blocks<scalar_t>(1, s.L, s.d, [&](const Block& b, scalar_t*) {
    const int64_t positions = b.t0 * s.d + b.c0, channels = b.c0 * s.n + b.t0;
    if (to_channels) {
      transpose_block(src + positions, s.d, dst + channels, s.n, b.positions(), b.channels());
    } else {
      transpose_block(src + channels, s.n, dst + positions, s.d, b.channels(), b.positions());
    }
  });
  if (to_channels) zero_tail(dst, s.d, s.L, s.n);
  return out;
}

// The forward's second half: s = y + D * w and o = s * x0, both [B, L, d].
template <typename scalar_t>
void gated_output(const ShortFilter<scalar_t>& f, const Shape& sh, const Tensor& y, const Tensor& w,
                  const Tensor& skip, Tensor& s_out, Tensor& o_out) {
  const scalar_t *yp = y.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
  const scalar_t* D = skip.data_ptr<scalar_t>();
  scalar_t *sp = s_out.data_ptr<scalar_t>(), *op = o_out.data_ptr<scalar_t>();
  for_blocks<scalar_t>(sh.B, sh.L, sh.d, [&](const Block& k, scalar_t* tile) {
    const int64_t C = k.channels(), first = channel_major(sh, k.b, k.c0, k.t0);
    channels_to_tile(yp + first, wp + first, D + k.c0, sh.n, k, tile);
    for (int64_t t = k.t0; t < k.t1; ++t) {
      const int64_t at = (k.b * sh.L + t) * sh.d + k.c0;
      times_x0_row(f.row(k.b, t) + k.c0, f.row(k.b, t - 1) + k.c0, f.row(k.b, t - 2) + k.c0,
                   f.taps.at(k.c0), C, tile + (t - k.t0) * C, op + at, sp + at);
    }
  });
}

// The backward's first step: ds = do * x0 transposed into a zero-padded [B, d, n] buffer (the
// return value), and dx0 = do * s into columns [0, d) of du_filtered [B, L, 3d].
template <typename scalar_t>
Tensor output_backward(const ShortFilter<scalar_t>& f, const Shape& sh, const Tensor& grad,
                       const Tensor& s, Tensor& du_filtered) {
  auto out = torch::empty({sh.B, sh.d, sh.n}, grad.options());
  const scalar_t *gp = grad.data_ptr<scalar_t>(), *sp = s.data_ptr<scalar_t>();
  scalar_t *dp = out.data_ptr<scalar_t>(), *gu = du_filtered.data_ptr<scalar_t>();
  for_blocks<scalar_t>(sh.B, sh.L, sh.d, [&](const Block& k, scalar_t* tile) {
    const int64_t C = k.channels();
    for (int64_t t = k.t0; t < k.t1; ++t) {
      const int64_t at = (k.b * sh.L + t) * sh.d + k.c0;
      output_backward_row(f.row(k.b, t) + k.c0, f.row(k.b, t - 1) + k.c0, f.row(k.b, t - 2) + k.c0,
                          f.taps.at(k.c0), C, gp + at, sp + at, tile + (t - k.t0) * C,
                          gu + (k.b * sh.L + t) * 3 * sh.d + k.c0);
    }
    transpose_block(tile, C, dp + channel_major(sh, k.b, k.c0, k.t0), sh.n, k.positions(), C);
  });
  zero_tail(dp, sh.B * sh.d, sh.L, sh.n);
  return out;
}

// dx1 = dw * v and dv = dw * x1 (dw = dw_conv + D * ds, both [B, d, n]) into columns [d, 3d) of
// du_filtered.
template <typename scalar_t>
void gate_backward(const ShortFilter<scalar_t>& f, const Shape& sh, const Tensor& dw_conv,
                   const Tensor& ds, const Tensor& skip, Tensor& du_filtered) {
  const scalar_t *cp = dw_conv.data_ptr<scalar_t>(), *dsp = ds.data_ptr<scalar_t>();
  const scalar_t* D = skip.data_ptr<scalar_t>();
  scalar_t* gu = du_filtered.data_ptr<scalar_t>();
  for_blocks<scalar_t>(sh.B, sh.L, sh.d, [&](const Block& k, scalar_t* tile) {
    const int64_t C = k.channels(), first = channel_major(sh, k.b, k.c0, k.t0);
    const int64_t at = sh.d + k.c0;  // x1's channel c0
    channels_to_tile(cp + first, dsp + first, D + k.c0, sh.n, k, tile);
    for (int64_t t = k.t0; t < k.t1; ++t) {
      scalar_t* gurow = gu + (k.b * sh.L + t) * 3 * sh.d;
      gate_backward_row(f.row(k.b, t) + at, f.row(k.b, t - 1) + at, f.row(k.b, t - 2) + at,
                        f.taps.at(at), sh.d, C, tile + (t - k.t0) * C, gurow + at,
                        gurow + sh.d + at);
    }
  });
}

// The spectrum of dk: P[c] = sum over sequences of conj(W[b, c]) * DS[b, c] ([B, d, m] each, m =
// L + 1 bins of the padded transforms; [d, m] out), and dD from it: dD[c] = sum over sequences
// and positions of ds * w, by Parseval (both are zero past L, so the transforms are exact).
template <typename scalar_t>
Tensor filter_spectrum(const Shape& sh, const Tensor& w_f, const Tensor& ds_f, Tensor& dskip) {
  const int64_t m = sh.L + 1;
  auto out = torch::empty({sh.d, m}, w_f.options());
  dskip = torch::empty({sh.d}, torch::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>()));
  const auto* a = reinterpret_cast<const scalar_t*>(w_f.data_ptr());
  const auto* b = reinterpret_cast<const scalar_t*>(ds_f.data_ptr());
  auto* p = reinterpret_cast<scalar_t*>(out.data_ptr());
  scalar_t* D = dskip.data_ptr<scalar_t>();
  at::parallel_for(0, sh.d, 4, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t s = 0; s < sh.B; ++s) {
        const int64_t row = (s * sh.d + c) * 2 * m;
        conj_mul_row(a + row, b + row, m, p + c * 2 * m, s > 0);
      }
      D[c] = scalar_t(parseval_row(p + c * 2 * m, m, sh.n));
    }
  });
  return out;
}

// spectra [B, d, m] *= conj(k_f [d, m]), in place.
template <typename scalar_t>
void times_conj(const Shape& sh, Tensor& spectra, const Tensor& k_f) {
  const int64_t m = sh.L + 1;
  auto* a = reinterpret_cast<scalar_t*>(spectra.data_ptr());
  const auto* k = reinterpret_cast<const scalar_t*>(k_f.data_ptr());
  at::parallel_for(0, sh.B * sh.d, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) mul_conj_row(a + r * 2 * m, k + (r % sh.d) * 2 * m, m);
  });
}

// The short filter's backward from du_filtered [B, L, 3d]: du [B, L, 3d], the taps' gradient
// [3, 3d] and the bias's [3d]. Tap and bias gradients are summed per fixed chunk of rows (at most
// 64 chunks, whatever the thread count), then over the chunks in order.
template <typename scalar_t>
void short_filter_backward(const ShortFilter<scalar_t>& f, const Shape& sh, const Tensor& gf,
                           Tensor& du, Tensor& dtaps, Tensor& dbias) {
  const int64_t width = 3 * sh.d, rows = sh.B * sh.L;
  const int64_t chunks = std::min<int64_t>(64, (rows + 511) / 512);
  const int64_t per = (rows + chunks - 1) / chunks;
  std::vector<scalar_t> partial(chunks * 4 * width, scalar_t(0));
  const scalar_t* g = gf.data_ptr<scalar_t>();
  scalar_t* out = du.data_ptr<scalar_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      scalar_t* acc = partial.data() + k * 4 * width;  // taps 0, 1, 2, then the bias
      for (int64_t r = k * per; r < std::min(rows, (k + 1) * per); ++r) {
        const int64_t b = r / sh.L, t = r % sh.L;
        const scalar_t* g0 = g + r * width;
        const scalar_t* g1 = t + 1 < sh.L ? g0 + width : f.zeros();
        const scalar_t* g2 = t + 2 < sh.L ? g0 + 2 * width : f.zeros();
        filter_backward_row(g0, g1, g2, f.row(b, t), f.row(b, t - 1), f.row(b, t - 2), f.taps,
                            width, out + r * width, acc);
      }
    }
  });
  std::vector<double> total(4 * width, 0.0);
  for (int64_t k = 0; k < chunks; ++k) {
    for (int64_t i = 0; i < 4 * width; ++i) total[i] += double(partial[k * 4 * width + i]);
  }
  scalar_t* dt = dtaps.data_ptr<scalar_t>();
  scalar_t* db = dbias.data_ptr<scalar_t>();
  for (int64_t i = 0; i < 3 * width; ++i) dt[i] = scalar_t(total[i]);
  for (int64_t c = 0; c < width; ++c) db[c] = scalar_t(total[3 * width + c]);
}

struct FusedMixer : public torch::autograd::Function<FusedMixer> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& u_in,
                        const Tensor& weight, const Tensor& bias, const Tensor& k_in,
                        const Tensor& skip_in) {
    const auto type = fp32_or_double(u_in.scalar_type());
    const auto u = u_in.to(type).contiguous();
    const auto taps = weight.to(type).reshape({-1, 3}).t().contiguous();  // [3, 3d]
    const auto b = bias.to(type).contiguous();
    const auto k = k_in.to(type).contiguous();
    const auto skip = skip_in.to(type).contiguous();
    RECORD_FUNCTION("dnallm::hyena::fft_long_conv", std::vector<c10::IValue>({u, k}));
    const auto sh = Shape::of(u);
    Tensor s = torch::empty({sh.B, sh.L, sh.d}, u.options()), o = torch::empty_like(s);
    Tensor k_f, w_f;
    AT_DISPATCH_FLOATING_TYPES(type, "hyena_fused_mixer", [&] {
      const ShortFilter<scalar_t> f(u, taps, b);
      const auto w = gated_input(f, sh, u);
      k_f = torch::fft::rfft(change_layout<scalar_t>(k, sh, /*to_channels=*/true));  // [d, L + 1]
      w_f = torch::fft::rfft(w);                          // [B, d, L + 1]
      const auto y = torch::fft::irfft(w_f * k_f, sh.n);  // 1/n: the circular convolution
      gated_output(f, sh, y, w, skip, s, o);
    });
    ctx->save_for_backward({u, taps, b, skip, k_f, s, w_f});
    return o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &u = saved[0], &taps = saved[1], &b = saved[2], &skip = saved[3], &k_f = saved[4],
               &s = saved[5], &w_f = saved[6];
    const auto grad = grads[0].to(u.scalar_type()).contiguous();
    const auto sh = Shape::of(u);
    auto du_filtered = torch::empty_like(u), du = torch::empty_like(u);
    auto dtaps = torch::empty_like(taps), dbias = torch::empty_like(b);
    Tensor dk, dskip;
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "hyena_fused_mixer_backward", [&] {
      const ShortFilter<scalar_t> f(u, taps, b);
      const auto ds = output_backward(f, sh, grad, s, du_filtered);
      auto ds_f = torch::fft::rfft(ds);
      // dk: the correlation of ds with w, summed over the sequences; dD beside it.
      dk = change_layout<scalar_t>(
          torch::fft::irfft(filter_spectrum<scalar_t>(sh, w_f, ds_f, dskip), sh.n), sh,
          /*to_channels=*/false);
      // dw: the correlation of ds with k.
      times_conj<scalar_t>(sh, ds_f, k_f);
      const auto dw_conv = torch::fft::irfft(ds_f, sh.n);
      ds_f = Tensor();
      gate_backward(f, sh, dw_conv, ds, skip, du_filtered);
      short_filter_backward(f, sh, du_filtered, du, dtaps, dbias);
    });
    return {du, dtaps.t().reshape({-1, 1, 3}), dbias, dk, dskip};
  }
};

}  // namespace

bool fused_mixer_applies(const Tensor& u) {
  return u.device().is_cpu() && u.dim() == 3 && u.size(2) % 3 == 0 && u.size(1) > 0;
}

Tensor fused_mixer(const Tensor& u, const Tensor& short_weight, const Tensor& short_bias,
                   const Tensor& k, const Tensor& skip) {
  return FusedMixer::apply(u, short_weight, short_bias, k, skip);
}

}  // namespace dnallm::models::hyena
