#include "worker/models/caduceus/mamba.hpp"

#include <cmath>
#include <vector>

#include "worker/models/fp32_region.hpp"

// Note [OpenMP in our kernels] (worker/CMakeLists.txt): at::parallel_for is serial in a file
// compiled without OpenMP.
#if defined(AT_PARALLEL_OPENMP) && AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile this file with -fopenmp: at::parallel_for would run its loops on one thread"
#endif

namespace dnallm::models::caduceus {

using torch::Tensor;

ScanFromZero selective_scan_from_zero(const Tensor& u_in, const Tensor& delta_in,
                                      const Tensor& A_in, const Tensor& Bm_in, const Tensor& C_in,
                                      const Tensor& D_in, const Tensor& z_in,
                                      const Tensor& delta_bias_in) {
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  auto f = [](const Tensor& t) { return t.to(torch::kFloat32); };
  ScanFromZero s;
  s.u = f(u_in);
  s.A = f(A_in);
  s.C = f(C_in);
  s.D = f(D_in);
  s.z = f(z_in);
  const auto dt = f(delta_in), Bm = f(Bm_in), delta_bias = f(delta_bias_in);
  const auto &u = s.u, &A = s.A, &C = s.C;
  RECORD_FUNCTION("dnallm::caduceus::selective_scan", std::vector<c10::IValue>({u, dt, A, Bm, C}));
  s.delta = torch::softplus(dt + delta_bias.unsqueeze(-1));
  const auto& delta = s.delta;
  const int64_t L = u.size(2);
  // [B, D, L, N]: exp(delta A) and delta B u, as the reference forms them.
  const auto dA = torch::exp(delta.unsqueeze(-1) * A.view({1, A.size(0), 1, A.size(1)}));
  const auto dBu = (delta * u).unsqueeze(-1) * Bm.transpose(1, 2).unsqueeze(1);
  auto h = torch::zeros({u.size(0), u.size(1), A.size(1)}, u.options());
  std::vector<Tensor> ys;
  ys.reserve(static_cast<size_t>(L));
  for (int64_t t = 0; t < L; ++t) {
    h = dA.select(2, t) * h + dBu.select(2, t);
    ys.push_back((h * C.select(2, t).unsqueeze(1)).sum(-1));
  }
  s.y = torch::stack(ys, 2);
  s.last = h;
  return s;
}

Tensor selective_scan_output(const ScanFromZero& s, const Tensor& y) {
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  return (y + s.u * s.D.view({1, -1, 1})) * torch::silu(s.z);
}

Tensor selective_scan(const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& Bm,
                      const Tensor& C, const Tensor& D, const Tensor& z, const Tensor& delta_bias) {
  const auto s = selective_scan_from_zero(u, delta, A, Bm, C, D, z, delta_bias);
  return selective_scan_output(s, s.y);
}

// Note [Fused selective scan]: the scan as one loop per (batch, channel) over raw fp32 memory,
// parallel over (batch, channel) and sequential over time: O(B D L N) work with no per-step
// tensor dispatch (the reference's Python loop, and selective_scan() above, launch several tensor
// ops per time step). The forward keeps the states h [B, D, L, N] for the backward, which runs
// the reverse recurrence dh_t = C_t dy_t + exp(delta_{t+1} A) dh_{t+1} by hand; dB and dC are
// then two contractions over the channels. Equal to selective_scan() in values and gradients
// (tests/worker/caduceus_test.cpp). The two loops take a state before the first position and a
// gradient entering after the last (zero for a whole sequence), which the context-parallel scan
// (Note [Mamba context parallelism]) passes between ranks.
FusedScanOutputs fused_scan_forward(const FusedScanInputs& in, const Tensor& start) {
  const auto &u = in.u, &delta = in.delta, &A = in.A, &Bt = in.Bt, &Ct = in.Ct, &Dv = in.Dv,
             &z = in.z, &bias = in.bias;
  const int64_t batch = u.size(0), D = u.size(1), L = u.size(2), N = A.size(1);
  FusedScanOutputs o{torch::empty_like(u), torch::empty_like(u),
                     torch::empty({batch, D, L, N}, u.options())};
  const float *pu = u.data_ptr<float>(), *pd = delta.data_ptr<float>(), *pz = z.data_ptr<float>();
  const float *pA = A.data_ptr<float>(), *pD = Dv.data_ptr<float>(), *pb = bias.data_ptr<float>();
  const float *pB = Bt.data_ptr<float>(), *pC = Ct.data_ptr<float>();
  const float* ps = start.defined() ? start.data_ptr<float>() : nullptr;
  float *po = o.out.data_ptr<float>(), *py = o.y_pre.data_ptr<float>(), *pH = o.H.data_ptr<float>();
  at::parallel_for(0, batch * D, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(static_cast<size_t>(N));
    for (int64_t bd = begin; bd < end; ++bd) {
      const int64_t b = bd / D, d = bd % D;
      if (ps != nullptr) {
        std::copy(ps + bd * N, ps + (bd + 1) * N, h.begin());
      } else {
        std::fill(h.begin(), h.end(), 0.f);
      }
      const float* Ad = pA + d * N;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t i = bd * L + t;
        const float dt = softplus20(pd[i] + pb[d]);
        const float du = dt * pu[i];
        const float* Bbt = pB + (b * L + t) * N;
        const float* Cbt = pC + (b * L + t) * N;
        float* Ht = pH + i * N;
        float y = 0.f;
        for (int64_t n = 0; n < N; ++n) {
          h[n] = std::exp(dt * Ad[n]) * h[n] + du * Bbt[n];
          y += h[n] * Cbt[n];
          Ht[n] = h[n];
        }
        y += pu[i] * pD[d];
        py[i] = y;
        po[i] = y * pz[i] * sigmoidf(pz[i]);
      }
    }
  });
  return o;
}

torch::autograd::variable_list fused_scan_backward(const FusedScanInputs& in,
                                                   const FusedScanOutputs& fwd,
                                                   const Tensor& dout_in, const Tensor& start,
                                                   const Tensor& entering) {
  const auto &u = in.u, &delta = in.delta, &A = in.A, &Bt = in.Bt, &Ct = in.Ct, &Dv = in.Dv,
             &z = in.z, &bias = in.bias;
  const auto &y_pre = fwd.y_pre, &H = fwd.H;
  const auto dout = dout_in.contiguous();
  const int64_t batch = u.size(0), D = u.size(1), L = u.size(2), N = A.size(1);
  auto du = torch::empty_like(u), ddelta = torch::empty_like(u), dz = torch::empty_like(u);
  auto dy = torch::empty_like(u), dtu = torch::empty_like(u);
  auto dH = torch::empty_like(H);
  auto dA_rows = torch::zeros({batch, D, N}, u.options());
  auto dD_rows = torch::zeros({batch, D}, u.options());
  const float *pu = u.data_ptr<float>(), *pd = delta.data_ptr<float>(), *pz = z.data_ptr<float>();
  const float *pA = A.data_ptr<float>(), *pD = Dv.data_ptr<float>(), *pb = bias.data_ptr<float>();
  const float *pB = Bt.data_ptr<float>(), *pC = Ct.data_ptr<float>();
  const float *py = y_pre.data_ptr<float>(), *pH = H.data_ptr<float>(),
              *pg = dout.data_ptr<float>();
  const float* ps = start.defined() ? start.data_ptr<float>() : nullptr;
  const float* pG = entering.defined() ? entering.data_ptr<float>() : nullptr;
  float *pdu = du.data_ptr<float>(), *pdd = ddelta.data_ptr<float>(), *pdz = dz.data_ptr<float>();
  float *pdy = dy.data_ptr<float>(), *pdtu = dtu.data_ptr<float>(), *pdH = dH.data_ptr<float>();
  float *pdA = dA_rows.data_ptr<float>(), *pdD = dD_rows.data_ptr<float>();
  at::parallel_for(0, batch * D, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> carry(static_cast<size_t>(N));
    for (int64_t bd = begin; bd < end; ++bd) {
      const int64_t b = bd / D, d = bd % D;
      if (pG != nullptr) {
        std::copy(pG + bd * N, pG + (bd + 1) * N, carry.begin());
      } else {
        std::fill(carry.begin(), carry.end(), 0.f);
      }
      const float* Ad = pA + d * N;
      float* dAd = pdA + bd * N;
      for (int64_t t = L - 1; t >= 0; --t) {
        const int64_t i = bd * L + t;
        const float x = pd[i] + pb[d];
        const float dt = softplus20(x);
        const float sz = sigmoidf(pz[i]);
        const float g = pg[i] * pz[i] * sz;  // d loss / d y_pre
        pdz[i] = pg[i] * py[i] * sz * (1.f + pz[i] * (1.f - sz));
        pdy[i] = g;
        pdtu[i] = dt * pu[i];
        const float* Bbt = pB + (b * L + t) * N;
        const float* Cbt = pC + (b * L + t) * N;
        // The state before position t: the start state (or none: zero) before the first.
        const float* Hprev = t > 0 ? pH + (i - 1) * N : (ps != nullptr ? ps + bd * N : nullptr);
        float* dHt = pdH + i * N;
        float ddt = 0.f, dui = g * pD[d];
        for (int64_t n = 0; n < N; ++n) {
          const float a = std::exp(dt * Ad[n]);
          const float dh = Cbt[n] * g + carry[n];
          dHt[n] = dh;
          const float da = Hprev != nullptr ? dh * Hprev[n] : 0.f;
          ddt += da * a * Ad[n] + dh * Bbt[n] * pu[i];
          dAd[n] += da * a * dt;
          dui += dh * dt * Bbt[n];
          carry[n] = a * dh;
        }
        pdu[i] = dui;
        pdD[bd] += g * pu[i];
        pdd[i] = ddt * (x > 20.f ? 1.f : sigmoidf(x));
      }
    }
  });
  // dC_t = sum_d dy_t h_t, dB_t = sum_d dh_t delta_t u_t: contractions over the channels.
  auto dC = torch::einsum("bdtn,bdt->bnt", {H, dy});
  auto dB = torch::einsum("bdtn,bdt->bnt", {dH, dtu});
  return {
      du, ddelta, dA_rows.sum(0), dB, dC, dD_rows.sum(0), dz, ddelta.sum(at::IntArrayRef{0, 2})};
}

FusedScanInputs FusedScanInputs::of(const Tensor& u, const Tensor& delta, const Tensor& A,
                                    const Tensor& Bm, const Tensor& C, const Tensor& Dv,
                                    const Tensor& z, const Tensor& bias) {
  return {u.contiguous(),
          delta.contiguous(),
          A.contiguous(),
          Bm.transpose(1, 2).contiguous(),  // [B, L, N]
          C.transpose(1, 2).contiguous(),
          Dv.contiguous(),
          z.contiguous(),
          bias.contiguous()};
}

namespace {

struct FusedScan : public torch::autograd::Function<FusedScan> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor u, Tensor delta, Tensor A,
                        Tensor Bm, Tensor C, Tensor Dv, Tensor z, Tensor bias) {
    const auto in = FusedScanInputs::of(u, delta, A, Bm, C, Dv, z, bias);
    auto o = fused_scan_forward(in, Tensor());
    ctx->save_for_backward(
        {in.u, in.delta, in.A, in.Bt, in.Ct, in.Dv, in.z, in.bias, o.y_pre, o.H});
    return o.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    const FusedScanInputs in{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]};
    return fused_scan_backward(in, FusedScanOutputs{Tensor(), s[8], s[9]}, grads[0], Tensor(),
                               Tensor());
  }
};

}  // namespace

Tensor selective_scan_fused(const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& Bm,
                            const Tensor& C, const Tensor& D, const Tensor& z,
                            const Tensor& delta_bias) {
  if (!u.device().is_cpu()) return selective_scan(u, delta, A, Bm, C, D, z, delta_bias);
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  auto f = [](const Tensor& t) { return t.to(torch::kFloat32); };
  const auto uf = f(u), dt = f(delta), Af = f(A), Bf = f(Bm), Cf = f(C);
  const auto Df = f(D), zf = f(z), bias = f(delta_bias);
  RECORD_FUNCTION("dnallm::caduceus::selective_scan",
                  std::vector<c10::IValue>({uf, dt, Af, Bf, Cf}));
  return FusedScan::apply(uf, dt, Af, Bf, Cf, Df, zf, bias);
}

MambaImpl::MambaImpl(const CaduceusOptions& o, MambaImpl* shared) : o_(o) {
  const int64_t di = o.d_inner();
  if (shared == nullptr) {
    in_proj = register_module(
        "in_proj",
        LoraLinear(torch::nn::Linear(torch::nn::LinearOptions(o.d_model, 2 * di).bias(false))));
    out_proj = register_module(
        "out_proj",
        LoraLinear(torch::nn::Linear(torch::nn::LinearOptions(di, o.d_model).bias(false))));
  } else {  // BiMamba ties the projections: the reverse direction uses the forward's
    in_proj = shared->in_proj;
    out_proj = shared->out_proj;
  }
  conv1d = register_module(
      "conv1d", torch::nn::Conv1d(
                    torch::nn::Conv1dOptions(di, di, o.d_conv).groups(di).padding(o.d_conv - 1)));
  x_proj = register_module(
      "x_proj",
      torch::nn::Linear(torch::nn::LinearOptions(di, o.dt_rank + 2 * o.d_state).bias(false)));
  dt_proj = register_module("dt_proj", torch::nn::Linear(o.dt_rank, di));
  A_log = register_parameter(
      "A_log", torch::log(torch::arange(1, o.d_state + 1, torch::kFloat32)).repeat({di, 1}));
  D = register_parameter("D", torch::ones({di}));
}

Tensor MambaImpl::forward(const Tensor& x) {
  const int64_t L = x.size(1), batch = x.size(0);
  auto xz = in_proj->forward(x).transpose(1, 2);  // [B, 2 di, L]
  auto parts = xz.chunk(2, 1);
  auto u = torch::silu(conv1d->forward(parts[0]).slice(-1, 0, L));  // causal: first L outputs
  auto x_dbl = x_proj->forward(u.transpose(1, 2).reshape({batch * L, -1}));
  auto pieces = x_dbl.split_with_sizes({o_.dt_rank, o_.d_state, o_.d_state}, -1);
  auto dt = torch::matmul(dt_proj->weight, pieces[0].t()).view({-1, batch, L}).transpose(0, 1);
  auto Bm = pieces[1].view({batch, L, -1}).transpose(1, 2).contiguous();
  auto C = pieces[2].view({batch, L, -1}).transpose(1, 2).contiguous();
  auto A = -torch::exp(A_log.to(torch::kFloat32));
  auto y = selective_scan_fused(u, dt, A, Bm, C, D, parts[1], dt_proj->bias);
  return out_proj->forward(y.transpose(1, 2));
}

}  // namespace dnallm::models::caduceus
