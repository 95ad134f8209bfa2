#include "worker/models/caduceus/caduceus.hpp"

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/caduceus/mamba_context.hpp"
#include "worker/models/family_io.hpp"
#include "worker/models/fp32_region.hpp"
#include "worker/models/hf_directory.hpp"
#include "worker/models/recompute_autocast.hpp"
#include "worker/models/transformer/transformer.hpp"
#include "worker/parallel/context_parallel.hpp"
#include "worker/tensor_buffer.hpp"

// Note [OpenMP in our kernels] (worker/CMakeLists.txt): at::parallel_for is serial in a file
// compiled without OpenMP.
#if defined(AT_PARALLEL_OPENMP) && AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile this file with -fopenmp: at::parallel_for would run its loops on one thread"
#endif

namespace dnallm::models::caduceus {

using nlohmann::json;
using torch::Tensor;
using torch::indexing::Slice;

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

namespace {

// Reverse complement of an RCPS stream half: flip over the sequence and the channels.
Tensor rc(const Tensor& x) { return x.flip({-2, -1}); }

}  // namespace

CaduceusLMImpl::CaduceusLMImpl(CaduceusOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  word_embeddings =
      register_module("word_embeddings", torch::nn::Embedding(o.vocab_size, o.d_model));
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const auto n = std::to_string(i);
    fwd.push_back(register_module("mamba_fwd_" + n, Mamba(o, nullptr)));
    if (o.bidirectional)
      rev.push_back(register_module("mamba_rev_" + n, Mamba(o, fwd.back().get())));
    norm_weight.push_back(register_parameter("norm_weight_" + n, torch::ones({o.d_model})));
    norm_bias.push_back(
        o.rms_norm ? Tensor() : register_parameter("norm_bias_" + n, torch::zeros({o.d_model})));
    // Note [Streamed build]: layer i's unit as CaduceusModelImpl::blocks() lists it (LayerUnit:
    // both directions; the norms are the root's).
    torch::nn::Module unit;
    unit.register_module("mamba_fwd", fwd.back().ptr());
    if (o.bidirectional) unit.register_module("mamba_rev", rev.back().ptr());
    block_built(size_t(i), "", unit);
  }
  norm_f_weight = register_parameter("norm_f_weight", torch::ones({o.d_model}));
  if (!o.rms_norm) norm_f_bias = register_parameter("norm_f_bias", torch::zeros({o.d_model}));
  if (!o.tied_head()) {  // Note [Caduceus tied head]
    head_weight = register_parameter(
        "head_weight",
        torch::randn({o.classifier ? o.num_labels : o.vocab_size, o.d_model}) * 0.02);
  }
  complement = register_buffer("complement", complement_table(o));
}

Tensor complement_table(const CaduceusOptions& o) {
  std::vector<int64_t> map = o.complement;
  for (int64_t i = int64_t(map.size()); i < o.vocab_size; ++i) map.push_back(i);
  return torch::tensor(map, torch::kLong);
}

Tensor CaduceusLMImpl::norm(const Tensor& x, const Tensor& w, const Tensor& b) const {
  if (!options_.rms_norm) {
    return torch::layer_norm(x, {options_.d_model}, w, b, options_.norm_eps);
  }
  auto rstd = torch::rsqrt(x.to(torch::kFloat32).square().mean(-1, true) + options_.norm_eps);
  return (x.to(torch::kFloat32) * rstd * w).to(x.scalar_type());
}

Tensor CaduceusLMImpl::mixer(size_t layer, const Tensor& x) {
  // `flipped`: h holds the sequence in reverse order; under context parallelism its shards are
  // then on the ranks in reverse order (Note [Mamba context parallelism]).
  auto mamba = [&](Mamba& m, const Tensor& h, bool flipped) {
    if (!context) return m->forward(h);
    return mamba_context_parallel(*m, h, flipped ? context->reversed_group() : *context->group,
                                  context->kernel);
  };
  auto bimamba = [&](const Tensor& h, bool flipped) {
    auto out = mamba(fwd[layer], h, flipped);
    if (options_.bidirectional) out = out + mamba(rev[layer], h.flip({1}), !flipped).flip({1});
    return out;
  };
  if (!options_.rcps) return bimamba(x, false);
  const int64_t d = options_.d_model;
  return torch::cat({bimamba(x.slice(-1, 0, d), false), rc(bimamba(rc(x.slice(-1, d)), true))}, -1);
}

namespace {

// Note [Caduceus activation checkpointing]: Note [Activation checkpointing] (transformer.hpp)
// for a Caduceus mixer, the unit blocks() lists and the block hooks surround: the forward runs
// without keeping activations (an autograd Function's forward runs under no_grad), the backward
// reruns the mixer under grad mode from its saved input (the hooks have gathered its parameters
// again by then: Note [Block hooks]) and back-propagates through it, the parameters' gradients
// accumulating as usual. The mixer has no dropout and no randomness, and its recompute is the
// same graph, so the gradients are bit-identical to those without checkpointing. The norms stay
// outside (their parameters are the model's, not the block's).
struct CaduceusCheckpoint : public torch::autograd::Function<CaduceusCheckpoint> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor x, int64_t model_address,
                        int64_t layer) {
    ctx->save_for_backward({x});
    ctx->saved_data["model"] = model_address;
    ctx->saved_data["layer"] = layer;
    save_autocast_state(ctx);  // Note [Recompute under the forward's autocast]
    return reinterpret_cast<CaduceusLMImpl*>(model_address)->mixer(static_cast<size_t>(layer), x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* model = reinterpret_cast<CaduceusLMImpl*>(ctx->saved_data["model"].toInt());
    const auto layer = static_cast<size_t>(ctx->saved_data["layer"].toInt());
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    Tensor out;
    {
      torch::AutoGradMode grad_mode(true);
      RecomputeAutocast autocast(ctx);
      out = model->mixer(layer, x);
    }
    torch::autograd::backward({out}, {grad_out[0]});
    return {x.grad(), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor CaduceusLMImpl::hidden(const Tensor& input_ids) {
  const auto& o = options_;
  const int64_t d = o.d_model;
  Tensor h;
  if (o.rcps) {  // the RC strand's embedding, flipped back over sequence and channels
    const auto rc_ids = complement.index({input_ids.flip({-1})});
    h = torch::cat({word_embeddings->forward(input_ids), rc(word_embeddings->forward(rc_ids))}, -1);
  } else {
    h = word_embeddings->forward(input_ids);
  }
  Tensor residual;
  // Note [Caduceus fused add+norm]: the RCPS block's fused path swaps the halves first.
  const auto swap_halves = [&](const Tensor& x) {
    return torch::cat({x.slice(-1, d), x.slice(-1, 0, d)}, -1);
  };
  auto add_norm = [&](const Tensor& w, const Tensor& b, bool block) {
    if (!o.rcps) {
      residual = residual.defined() ? h + residual : h;
      return norm(residual, w, b);
    }
    if (block && o.fused_add_norm) {
      h = swap_halves(h);
      if (residual.defined()) residual = swap_halves(residual);
    }
    const auto hf = h.slice(-1, 0, d), hr = rc(h.slice(-1, d));
    const auto rf = residual.defined() ? hf + residual.slice(-1, 0, d) : hf;
    const auto rr = residual.defined() ? hr + rc(residual.slice(-1, d)) : hr;
    residual = torch::cat({rf, rc(rr)}, -1);
    return torch::cat({norm(rf, w, b), rc(norm(rr, w, b))}, -1);
  };
  const bool checkpoint = gradient_checkpointing && is_training() && torch::GradMode::is_enabled();
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const auto normed = add_norm(norm_weight[i], norm_bias[i], /*block=*/true);
    h = run_block(block_hooks.get(), static_cast<size_t>(i), [&] {  // Note [Block hooks]
      if (!checkpoint) return mixer(static_cast<size_t>(i), normed);
      // An input that needs no gradient (a frozen base under LoRA) still must reach the
      // Function's backward, where the block's parameters get theirs.
      auto input = normed.requires_grad() ? normed : normed.detach().requires_grad_(true);
      return CaduceusCheckpoint::apply(input, reinterpret_cast<int64_t>(this), i);
    });
  }
  return add_norm(norm_f_weight, norm_f_bias, /*block=*/false);
}

Tensor CaduceusLMImpl::forward(const Tensor& input_ids) {
  const auto& o = options_;
  const int64_t d = o.d_model;
  auto h = hidden(input_ids);
  const Tensor& w = head();  // Note [Caduceus tied head]
  if (!o.classifier) {
    if (!o.rcps) return torch::nn::functional::linear(h, w);
    return torch::nn::functional::linear(h.slice(-1, 0, d), w) +
           torch::nn::functional::linear(h.slice(-1, d).flip({-1}), w.index({complement}));
  }
  if (context) {
    // Note [Context-parallel pooling]: the mean over every position of the whole sequence
    // (the padding the mesh adds included, as the reference includes a batch's padding), both
    // RCPS halves in one sum; the RC half's channels flipped back after the mean.
    const auto pooled = parallel::context_mean_pool(h, torch::Tensor(), *context->group);
    if (!o.rcps) return torch::nn::functional::linear(pooled, w);
    return (torch::nn::functional::linear(pooled.slice(-1, 0, d), w) +
            torch::nn::functional::linear(pooled.slice(-1, d).flip({-1}), w)) /
           2;
  }
  if (!o.rcps) return torch::nn::functional::linear(h.mean(1), w);
  // RCPS: the forward half and the RC half (flipped back) pooled apart, their logits averaged.
  const auto pf = h.slice(-1, 0, d).mean(1), pr = h.slice(-1, d).flip({1, 2}).mean(1);
  return (torch::nn::functional::linear(pf, w) + torch::nn::functional::linear(pr, w)) / 2;
}

// ---------------------------------------------------------------------------------------------
// Import

namespace {

int64_t int_key(const json& c, const std::string& key, int64_t fallback, int64_t lo, int64_t hi,
                const std::string& where) {
  return family_int(c, key, fallback, lo, hi, where, "Caduceus");
}

}  // namespace

bool tie_word_embeddings(const json& c, bool fallback, const std::string& where) {
  return family_bool(c, "tie_word_embeddings", fallback, where);
}

namespace {

CaduceusOptions options_from(const json& c, const std::string& where) {
  CaduceusOptions o;
  o.d_model = int_key(c, "d_model", 256, 1, 1 << 16, where);
  o.n_layer = int_key(c, "n_layer", 16, 1, 1024, where);
  const int64_t multiple = int_key(c, "pad_vocab_size_multiple", 8, 1, 1024, where);
  const int64_t vocab = int_key(c, "vocab_size", 16, 1, 1 << 20, where);
  o.vocab_size = (vocab + multiple - 1) / multiple * multiple;
  const json ssm =
      c.contains("ssm_cfg") && c["ssm_cfg"].is_object() ? c["ssm_cfg"] : json::object();
  o.d_state = int_key(ssm, "d_state", 16, 1, 1024, where + " ssm_cfg");
  o.d_conv = int_key(ssm, "d_conv", 4, 1, 64, where + " ssm_cfg");
  o.expand = int_key(ssm, "expand", 2, 1, 64, where + " ssm_cfg");
  o.dt_rank = (o.d_model + 15) / 16;
  if (ssm.contains("dt_rank") && !(ssm["dt_rank"].is_string() && ssm["dt_rank"] == "auto")) {
    o.dt_rank = int_key(ssm, "dt_rank", o.dt_rank, 1, 1 << 16, where + " ssm_cfg");
  }
  for (const char* key : {"bias", "conv_bias"}) {
    DNALLM_CHECK(!ssm.contains(key) || ssm[key] == (std::string(key) == "conv_bias"),
                 ExitCode::kUsage,
                 "{}: ssm_cfg \"{}\" = {} is not supported (Caduceus uses the "
                 "Mamba defaults)",
                 where, key, ssm.contains(key) ? ssm[key].dump() : "");
  }
  o.rms_norm = family_bool(c, "rms_norm", true, where);
  o.rcps = family_bool(c, "rcps", false, where);
  // CaduceusConfig's default is true (our exports always write the key).
  o.fused_add_norm = family_bool(c, "fused_add_norm", true, where);
  // Note [Caduceus tied head]: CaduceusForMaskedLM ties an RCPS head whatever the config says.
  const bool tie = tie_word_embeddings(c, false, where);  // (read, so a damaged value refuses)
  o.tie_head = o.rcps || tie;
  o.bidirectional = family_bool(c, "bidirectional", true, where);
  DNALLM_CHECK(family_string(c, "bidirectional_strategy", "add", where) == "add", ExitCode::kUsage,
               "{}: bidirectional_strategy {} is not supported: \"add\" (every published model)",
               where, c.value("bidirectional_strategy", json()).dump());
  DNALLM_CHECK(family_bool(c, "bidirectional_weight_tie", true, where), ExitCode::kUsage,
               "{}: bidirectional_weight_tie = false is not supported (every published model ties)",
               where);
  if (c.contains("norm_epsilon") && c["norm_epsilon"].is_number()) {
    o.norm_eps = c["norm_epsilon"].get<double>();
    DNALLM_CHECK(std::isfinite(o.norm_eps) && o.norm_eps > 0, ExitCode::kUsage,
                 "{}: \"norm_epsilon\" = {} must be positive", where, o.norm_eps);
  }
  if (c.contains("complement_map") && c["complement_map"].is_object()) {
    std::vector<int64_t> map(static_cast<size_t>(o.vocab_size));
    for (int64_t i = 0; i < o.vocab_size; ++i) map[i] = i;
    for (auto& [k, v] : c["complement_map"].items()) {
      int64_t from = -1;
      try {
        from = std::stoll(k);
      } catch (...) {
      }
      DNALLM_CHECK(from >= 0 && from < o.vocab_size && v.is_number_integer() &&
                       v.get<int64_t>() >= 0 && v.get<int64_t>() < o.vocab_size,
                   ExitCode::kUsage, "{}: complement_map entry \"{}\": {} is not a token id pair",
                   where, clip_for_message(k), clip_for_message(v.dump()));
      map[from] = v.get<int64_t>();
    }
    o.complement = map;
  }
  DNALLM_CHECK(!o.rcps || !o.complement.empty(), ExitCode::kUsage,
               "{}: rcps = true needs a complement_map", where);
  return o;
}

// The task head's name in the Hugging Face layout.
std::string hf_head_name(const CaduceusOptions& o) {
  return o.classifier ? "score.weight" : (o.rcps ? "lm_head.lm_head.weight" : "lm_head.weight");
}

std::string hf_embedding_name(const CaduceusOptions& o) {
  return std::string("caduceus.backbone.embeddings.word_embeddings") +
         (o.rcps ? ".embedding" : "") + ".weight";
}

// name in the Hugging Face layout -> the tensor it fills.
std::map<std::string, Tensor> hf_names(CaduceusLMImpl& m) {
  const auto& o = m.options();
  const std::string sub = o.rcps ? ".submodule" : "";
  // The fused path's norms are plain RMSNorm/LayerNorm modules, not RCPSAddNormWrapper's.
  const std::string norm_sub = o.rcps && !o.fused_add_norm ? ".submodule" : "";
  std::map<std::string, Tensor> out;
  const std::string bb = "caduceus.backbone.";
  out[hf_embedding_name(o)] = m.word_embeddings->weight;
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const std::string l = bb + "layers." + std::to_string(i) + ".";
    out[l + "norm" + norm_sub + ".weight"] = m.norm_weight[i];
    if (!o.rms_norm) out[l + "norm" + norm_sub + ".bias"] = m.norm_bias[i];
    for (int dir = 0; dir < (o.bidirectional ? 2 : 1); ++dir) {
      auto& mm = dir == 0 ? m.fwd[i] : m.rev[i];
      const std::string p = l + "mixer" + sub + (dir == 0 ? ".mamba_fwd." : ".mamba_rev.");
      out[p + "A_log"] = mm->A_log;
      out[p + "D"] = mm->D;
      out[p + "conv1d.weight"] = mm->conv1d->weight;
      out[p + "conv1d.bias"] = mm->conv1d->bias;
      out[p + "x_proj.weight"] = mm->x_proj->weight;
      out[p + "dt_proj.weight"] = mm->dt_proj->weight;
      out[p + "dt_proj.bias"] = mm->dt_proj->bias;
      if (dir == 0) {
        out[p + "in_proj.weight"] = mm->in_proj->weight;
        out[p + "out_proj.weight"] = mm->out_proj->weight;
      }
    }
  }
  out[bb + "norm_f" + norm_sub + ".weight"] = m.norm_f_weight;
  if (!o.rms_norm) out[bb + "norm_f" + norm_sub + ".bias"] = m.norm_f_bias;
  // Note [Caduceus tied head]: a tied head is the embedding, read and written under its name.
  if (!o.tied_head()) out[hf_head_name(o)] = m.head_weight;
  return out;
}

}  // namespace

std::vector<std::string> hf_module_names(const CaduceusOptions& o, const std::string& ours) {
  const std::string prefix = "mamba_fwd_";
  const auto dot = ours.find('.');
  if (ours.rfind(prefix, 0) != 0 || dot == std::string::npos) return {ours};
  const std::string layer = ours.substr(prefix.size(), dot - prefix.size());
  const std::string linear = ours.substr(dot + 1);
  if (layer.empty() || layer.find_first_not_of("0123456789") != std::string::npos ||
      (linear != "in_proj" && linear != "out_proj")) {
    return {ours};
  }
  const std::string mixer =
      "caduceus.backbone.layers." + layer + ".mixer" + (o.rcps ? ".submodule" : "") + ".mamba_";
  std::vector<std::string> out = {mixer + "fwd." + linear};
  if (o.bidirectional) out.push_back(mixer + "rev." + linear);
  return out;
}

CaduceusOptions options_from_hf_config(const json& config, const std::string& where) {
  return options_from(config, where);
}

CaduceusLM load_hf_caduceus(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  const auto c = read_family_config(dir, "caduceus", "Caduceus");
  auto o = options_from(c, config_path);
  o.hf_config = c;
  const std::string weights = family_weights(dir, "Caduceus");
  checkpoint::SafetensorsReader reader(weights);
  o.classifier = reader.file().tensors.count("score.weight") != 0;
  if (o.classifier) o.num_labels = reader.file().tensors.at("score.weight").spec.shape.at(0);
  torch::manual_seed(0);
  CaduceusLM model(o);
  auto expected = hf_names(*model);
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  const std::string tied = ".mamba_rev.";
  for (const auto& [name, entry] : reader.file().tensors) {
    if (name.size() > 15 && name.compare(name.size() - 15, 15, ".complement_map") == 0) continue;
    const bool rev_projection =
        name.find(tied) != std::string::npos && (name.find(".in_proj.") != std::string::npos ||
                                                 name.find(".out_proj.") != std::string::npos);
    if (rev_projection) continue;  // tied to mamba_fwd's (Note [Caduceus])
    // Note [Caduceus tied head]: a tied head is the embedding (the hub code ties it on load).
    if (o.tied_head() && (name == "lm_head.weight" || name == "lm_head.lm_head.weight")) continue;
    auto it = expected.find(name);
    DNALLM_CHECK(it != expected.end(), ExitCode::kUsage,
                 "{}: unexpected tensor {} for this config.json (n_layer {}, rcps {}, "
                 "fused_add_norm {}): the directory mixes files of different models",
                 weights, clip_for_message(name), o.n_layer, o.rcps, o.fused_add_norm);
    const auto t = read_finite_tensor(reader, entry, weights, name);
    DNALLM_CHECK(t.sizes() == it->second.sizes(), ExitCode::kUsage,
                 "{}: {} has shape {} but config.json implies {}", weights, name,
                 fmt::format("{}", fmt::join(t.sizes(), "x")),
                 fmt::format("{}", fmt::join(it->second.sizes(), "x")));
    it->second.copy_(t);
    loaded.insert(name);
  }
  // An untied head missing from the file starts as the embedding.
  for (const auto& [name, t] : expected) {
    if (loaded.count(name) != 0) continue;
    const bool head = name == "lm_head.weight" || name == "lm_head.lm_head.weight";
    const std::string emb = hf_embedding_name(o);
    DNALLM_CHECK(head && loaded.count(emb) != 0, ExitCode::kUsage,
                 "{}: tensor {} is missing: the download is incomplete or of another model",
                 weights, name);
    t.copy_(expected.at(emb));
  }
  model->eval();
  return model;
}

json hf_config_of(const CaduceusOptions& o) {
  json ssm = {
      {"d_state", o.d_state}, {"d_conv", o.d_conv}, {"expand", o.expand}, {"dt_rank", o.dt_rank}};
  json config = {{"model_type", "caduceus"},
                 {"architectures",
                  {o.classifier ? "CaduceusForSequenceClassification" : "CaduceusForMaskedLM"}},
                 {"d_model", o.d_model},
                 {"n_layer", o.n_layer},
                 {"vocab_size", o.vocab_size},
                 {"pad_vocab_size_multiple", 8},
                 {"ssm_cfg", ssm},
                 {"rms_norm", o.rms_norm},
                 {"norm_epsilon", o.norm_eps},
                 {"residual_in_fp32", false},
                 {"fused_add_norm", o.fused_add_norm},
                 {"bidirectional", o.bidirectional},
                 {"bidirectional_strategy", "add"},
                 {"bidirectional_weight_tie", true},
                 {"rcps", o.rcps},
                 {"tie_word_embeddings", o.tie_head},
                 {"pad_token_id", 4}};
  if (!o.complement.empty()) {
    json map = json::object();
    for (size_t i = 0; i < o.complement.size(); ++i) map[std::to_string(i)] = o.complement[i];
    config["complement_map"] = map;
  }
  if (o.classifier) config["num_labels"] = o.num_labels;
  return config;
}

std::vector<ExportedTensor> hf_tensors(CaduceusLM& model, const Tensor& complement,
                                       const WeightReader& weight) {
  const auto& o = model->options();
  std::vector<ExportedTensor> tensors;
  for (const auto& [name, t] : hf_names(*model)) {
    tensors.push_back(weight(name, t));
    // Note [Caduceus tied projections].
    const auto fwd = name.find(".mamba_fwd.");
    if (o.bidirectional && fwd != std::string::npos &&
        (name.find(".in_proj.") != std::string::npos ||
         name.find(".out_proj.") != std::string::npos)) {
      tensors.push_back(renamed_tensor(
          tensors.back(), name.substr(0, fwd) + ".mamba_rev." + name.substr(fwd + 11)));
    }
  }
  if (o.tied_head()) {  // Note [Caduceus tied head]: the hub files hold it under its own name
    for (const auto& t : tensors) {
      if (t.name == hf_embedding_name(o)) {
        tensors.push_back(renamed_tensor(t, hf_head_name(o)));
        break;
      }
    }
  }
  if (o.rcps) {  // RCPSEmbedding's and RCPSLMHead's buffers, as the hub code saves them
    tensors.push_back(
        live_tensor("caduceus.backbone.embeddings.word_embeddings.complement_map", complement));
    if (!o.classifier) tensors.push_back(live_tensor("lm_head.complement_map", complement));
  }
  return tensors;
}

json hf_export_config(const CaduceusOptions& o) {
  json config = o.hf_config.is_null() ? hf_config_of(o) : o.hf_config;
  // Note [Caduceus tied head]: said, so that transformers 4 and 5 compute the same head.
  config["tie_word_embeddings"] = o.tie_head;
  if (!config.contains("auto_map")) {
    config["auto_map"] = {{"AutoConfig", "configuration_caduceus.CaduceusConfig"},
                          {"AutoModel", "modeling_caduceus.Caduceus"},
                          {"AutoModelForMaskedLM", "modeling_caduceus.CaduceusForMaskedLM"},
                          {"AutoModelForSequenceClassification",
                           "modeling_caduceus.CaduceusForSequenceClassification"}};
  }
  return config;
}

void export_hf_caduceus(CaduceusLM& model, const std::string& dir,
                        const std::string& tokenizer_from) {
  namespace fs = std::filesystem;
  write_exported_files(dir,
                       {{"model.safetensors",
                         hf_tensors(model, model->complement, LiveWeights(*model, true)),
                         {{"format", "pt"}}}},
                       whole_model_units(), /*write=*/true);
  checkpoint::write_file_durable(fs::path(dir) / "config.json",
                                 hf_export_config(model->options()).dump(2) + "\n");
  copy_tokenizer_files(tokenizer_from, dir);
}

}  // namespace dnallm::models::caduceus
