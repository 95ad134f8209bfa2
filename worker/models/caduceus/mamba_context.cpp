#include "worker/models/caduceus/mamba_context.hpp"

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "worker/models/caduceus/mamba.hpp"
#include "worker/models/fp32_region.hpp"
#include "worker/parallel/context_parallel.hpp"
#include "worker/tensor_buffer.hpp"

// Note [OpenMP in our kernels] (worker/CMakeLists.txt): at::parallel_for is serial in a file
// compiled without OpenMP.
#if defined(AT_PARALLEL_OPENMP) && AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile this file with -fopenmp: at::parallel_for would run its loops on one thread"
#endif

namespace dnallm::models::caduceus {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::shared_ptr<MambaContext> make_mamba_context(comm::Communicator& group) {
  auto context = std::make_shared<MambaContext>();
  context->group = &group;
  if (group.world_size() > 1) {
    context->reversed = group.split(0, group.world_size() - 1 - group.rank());
  }
  return context;
}

namespace {

// As in parallel/context_parallel.cpp: the node keeps the group as an integer (saved_data holds
// IValues); the header's contract keeps it alive through the backward.
comm::Communicator& saved_group(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Communicator*>(
      static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
}

// `mine` [...] from every rank of `group`: [C, ...], rank q's at index q (fp32).
Tensor all_gather(const Tensor& mine, comm::Communicator& group) {
  std::vector<int64_t> shape{group.world_size()};
  for (const auto s : mine.sizes()) shape.push_back(s);
  auto all = torch::empty(shape, mine.options());
  group
      .allgather(buffer_view(mine, 0, mine.numel(), DType::kFloat32),
                 buffer_view(all, 0, all.numel(), DType::kFloat32))
      ->wait();
  return all;
}

// Note [Mamba context parallelism], steps 1-4 forward and backward. The loops are those of
// Note [Fused selective scan] with a start state (forward) and an entering gradient (backward).
struct ContextScan : torch::autograd::Function<ContextScan> {
  static Tensor forward(AutogradContext* ctx, Tensor u, Tensor delta, Tensor A, Tensor Bm, Tensor C,
                        Tensor Dv, Tensor z, Tensor bias, comm::Communicator* group) {
    const int64_t batch = u.size(0), D = u.size(1), L = u.size(2), N = A.size(1);
    const auto in = FusedScanInputs::of(u, delta, A, Bm, C, Dv, z, bias);
    const float *pu = in.u.data_ptr<float>(), *pd = in.delta.data_ptr<float>();
    const float *pA = in.A.data_ptr<float>(), *pb = in.bias.data_ptr<float>();
    const float* pB = in.Bt.data_ptr<float>();

    // 1. The shard's end state from zero and the product of its a_t: [B, D, (e | P)].
    auto ends = torch::empty({batch, D, 2 * N}, u.options());
    float* pe = ends.data_ptr<float>();
    at::parallel_for(0, batch * D, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bd = begin; bd < end; ++bd) {
        const int64_t b = bd / D, d = bd % D;
        float* h = pe + bd * 2 * N;
        float* p = h + N;
        std::fill(h, h + N, 0.f);
        std::fill(p, p + N, 1.f);
        const float* Ad = pA + d * N;
        for (int64_t t = 0; t < L; ++t) {
          const int64_t i = bd * L + t;
          const float dt = softplus20(pd[i] + pb[d]);
          const float du = dt * pu[i];
          const float* Bbt = pB + (b * L + t) * N;
          for (int64_t n = 0; n < N; ++n) {
            const float a = std::exp(dt * Ad[n]);
            h[n] = a * h[n] + du * Bbt[n];
            p[n] *= a;
          }
        }
      }
    });
    // 2-3. Everyone's, and this rank's start state folded from the ranks before it.
    const auto all = all_gather(ends, *group);
    const auto products = all.slice(-1, N).contiguous();  // [C, B, D, N], kept for the backward
    auto start = torch::zeros({batch, D, N}, u.options());
    for (int q = 0; q < group->rank(); ++q) start = products[q] * start + all[q].slice(-1, 0, N);
    start = start.contiguous();

    // 4. The scan of the shard from its start state, keeping the states for the backward.
    const auto o = fused_scan_forward(in, start);
    ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(group));
    ctx->save_for_backward(
        {in.u, in.delta, in.A, in.Bt, in.Ct, in.Dv, in.z, in.bias, o.y_pre, o.H, start, products});
    return o.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = saved_group(ctx);
    auto s = ctx->get_saved_variables();
    const FusedScanInputs in{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]};
    const auto &u = in.u, &start = s[10], &products = s[11];
    const auto dout = grads[0].contiguous();
    const int64_t batch = u.size(0), D = u.size(1), L = u.size(2), N = in.A.size(1);
    const float *pd = in.delta.data_ptr<float>(), *pz = in.z.data_ptr<float>();
    const float *pA = in.A.data_ptr<float>(), *pb = in.bias.data_ptr<float>();
    const float *pC = in.Ct.data_ptr<float>(), *pg = dout.data_ptr<float>();

    // 1. The gradient at the shard's start from zero at its end (the states are not needed).
    auto at_start = torch::empty({batch, D, N}, u.options());
    float* pl = at_start.data_ptr<float>();
    at::parallel_for(0, batch * D, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bd = begin; bd < end; ++bd) {
        const int64_t b = bd / D, d = bd % D;
        float* carry = pl + bd * N;
        std::fill(carry, carry + N, 0.f);
        const float* Ad = pA + d * N;
        for (int64_t t = L - 1; t >= 0; --t) {
          const int64_t i = bd * L + t;
          const float dt = softplus20(pd[i] + pb[d]);
          const float g = pg[i] * pz[i] * sigmoidf(pz[i]);
          const float* Cbt = pC + (b * L + t) * N;
          for (int64_t n = 0; n < N; ++n) carry[n] = std::exp(dt * Ad[n]) * (Cbt[n] * g + carry[n]);
        }
      }
    });
    // 2-3. Everyone's, and the gradient entering this shard's end folded from the ranks after it.
    const auto all = all_gather(at_start, group);
    auto entering = torch::zeros({batch, D, N}, u.options());
    for (int q = group.world_size() - 1; q > group.rank(); --q) {
      entering = all[q] + products[q] * entering;
    }
    entering = entering.contiguous();

    // 4. The backward of the shard entered with that gradient (Note [Fused selective scan]); the
    // state before its first position is the start state.
    auto g = fused_scan_backward(in, FusedScanOutputs{Tensor(), s[8], s[9]}, dout, start, entering);
    g.push_back(Tensor());  // the group
    return g;
  }
};

// The same steps in torch ops under autograd, on any device (Note [Mamba context parallelism]).
Tensor generic_context_scan(const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& Bm,
                            const Tensor& C, const Tensor& D, const Tensor& z,
                            const Tensor& delta_bias, comm::Communicator& group) {
  // 1. The shard's scan from zero, its end state e and P = exp(A sum_t delta_t): [B, D, N] each.
  const auto s = selective_scan_from_zero(u, delta, A, Bm, C, D, z, delta_bias);
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  const int64_t batch = s.u.size(0), channels = s.u.size(1), N = s.A.size(1);
  const auto A3 = s.A.view({1, channels, N});
  const auto product = torch::exp(s.delta.sum(-1, /*keepdim=*/true) * A3);
  // 2. Everyone's (e, P): [C, B, D, 2N].
  const auto all = parallel::gather_ranks(torch::cat({s.last, product}, -1), group);
  // 3. Every rank's start state, s_0 = 0 and s_{q+1} = P_q s_q + e_q, then this rank's: picked
  // from the stack, so that the gather is in rank 0's graph too (its backward is a collective).
  std::vector<Tensor> starts{torch::zeros({batch, channels, N}, s.u.options())};
  for (int q = 0; q + 1 < group.world_size(); ++q) {
    starts.push_back(all[q].slice(-1, N) * starts.back() + all[q].slice(-1, 0, N));
  }
  const auto start = torch::stack(starts)[group.rank()];
  // 4. Its zero-input response at each position t: sum_n C_t[n] exp(A[n] sum_{t' <= t} delta_t')
  // s[n], added before the skip and the gate. [B, D, L, N], as the scan's own exp(delta A).
  const auto decay = torch::exp(s.delta.cumsum(-1).unsqueeze(-1) * A3.unsqueeze(2));
  const auto carried = (decay * start.unsqueeze(2) * s.C.transpose(1, 2).unsqueeze(1)).sum(-1);
  return selective_scan_output(s, s.y + carried);
}

}  // namespace

Tensor context_parallel_selective_scan(const Tensor& u, const Tensor& delta, const Tensor& A,
                                       const Tensor& Bm, const Tensor& C, const Tensor& D,
                                       const Tensor& z, const Tensor& delta_bias,
                                       comm::Communicator& group, ContextScanKernel kernel) {
  DNALLM_CHECK(u.dim() == 3 && delta.sizes() == u.sizes() && z.sizes() == u.sizes() &&
                   A.dim() == 2 && A.size(0) == u.size(1) && Bm.dim() == 3 &&
                   Bm.size(0) == u.size(0) && Bm.size(1) == A.size(1) && Bm.size(2) == u.size(2) &&
                   C.sizes() == Bm.sizes(),
               ExitCode::kUsage,
               "context_parallel_selective_scan: expected u, delta, z [B, D, L], A [D, N], B and "
               "C [B, N, L]");
  if (kernel == ContextScanKernel::kGeneric || !u.device().is_cpu()) {
    return generic_context_scan(u, delta, A, Bm, C, D, z, delta_bias, group);
  }
  auto f = [](const Tensor& t) { return t.to(torch::kFloat32); };
  return ContextScan::apply(f(u), f(delta), f(A), f(Bm), f(C), f(D), f(z), f(delta_bias), &group);
}

Tensor mamba_context_parallel(MambaImpl& m, const Tensor& x, comm::Communicator& group,
                              ContextScanKernel kernel) {
  const int64_t L = x.size(1), batch = x.size(0);
  const auto parts = m.in_proj->forward(x).chunk(2, -1);  // x and z, [B, L, d_inner] each
  const auto& conv = m.conv1d->weight;                    // [d_inner, 1, d_conv]
  const int64_t d_inner = conv.size(0), d_conv = conv.size(2);
  // The causal conv: the previous rank's last d_conv - 1 positions, then no padding.
  const auto with_halo = parallel::causal_halo(parts[0], d_conv - 1, group);
  const int64_t no_padding = 0;  // (a literal 0 would also convert to the string overload)
  const auto u = torch::silu(
      torch::conv1d(with_halo.transpose(1, 2), conv, m.conv1d->bias, 1, no_padding, 1, d_inner));
  const int64_t dt_rank = m.dt_proj->weight.size(1);
  auto x_dbl = m.x_proj->forward(u.transpose(1, 2).reshape({batch * L, -1}));
  const int64_t d_state = (x_dbl.size(-1) - dt_rank) / 2;
  auto pieces = x_dbl.split_with_sizes({dt_rank, d_state, d_state}, -1);
  auto dt = torch::matmul(m.dt_proj->weight, pieces[0].t()).view({-1, batch, L}).transpose(0, 1);
  auto Bm = pieces[1].view({batch, L, -1}).transpose(1, 2).contiguous();
  auto C = pieces[2].view({batch, L, -1}).transpose(1, 2).contiguous();
  auto A = -torch::exp(m.A_log.to(torch::kFloat32));
  auto y = context_parallel_selective_scan(u, dt, A, Bm, C, m.D, parts[1].transpose(1, 2),
                                           m.dt_proj->bias, group, kernel);
  return m.out_proj->forward(y.transpose(1, 2));
}

}  // namespace dnallm::models::caduceus
