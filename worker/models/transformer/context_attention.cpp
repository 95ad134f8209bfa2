#include "worker/models/transformer/context_attention.hpp"

#include <cmath>

#include "core/error.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<PositionRun> position_runs(const std::vector<int64_t>& positions) {
  std::vector<PositionRun> runs;
  for (size_t i = 0; i < positions.size(); ++i) {
    if (runs.empty() || positions[i] != runs.back().first + runs.back().length) {
      runs.push_back({positions[i], 0, static_cast<int64_t>(i)});
    }
    ++runs.back().length;
  }
  return runs;
}

namespace {

DType wire_dtype(const Tensor& t) {
  const auto d = dtype_of(t.scalar_type());
  DNALLM_CHECK(d.has_value(), ExitCode::kUsage,
               "attention context parallelism: no communicator dtype for a {} tensor",
               c10::toString(t.scalar_type()));
  return *d;
}

// `mine` contiguous -> [C, mine...], rank q's at index q.
Tensor all_gather(const Tensor& mine, comm::Communicator& group) {
  std::vector<int64_t> shape{group.world_size()};
  for (const auto s : mine.sizes()) shape.push_back(s);
  auto all = torch::empty(shape, mine.options());
  const auto dtype = wire_dtype(mine);
  group
      .allgather(buffer_view(mine, 0, mine.numel(), dtype), buffer_view(all, 0, all.numel(), dtype))
      ->wait();
  return all;
}

struct GatherContext : torch::autograd::Function<GatherContext> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, comm::Communicator* group) {
    ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(group));
    const auto all = all_gather(x.contiguous(), *group);  // [C, B, H, T / C, D]
    const int64_t C = all.size(0), B = x.size(0), H = x.size(1), t = x.size(2), D = x.size(3);
    return all.permute({1, 2, 0, 3, 4}).reshape({B, H, C * t, D});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = *reinterpret_cast<comm::Communicator*>(
        static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
    const auto& g = grads[0];
    const int64_t C = group.world_size(), B = g.size(0), H = g.size(1), D = g.size(3);
    const int64_t t = g.size(2) / C;
    const auto blocks = g.reshape({B, H, C, t, D}).permute({2, 0, 1, 3, 4}).contiguous();
    auto mine = torch::empty({B, H, t, D}, g.options());
    const auto dtype = wire_dtype(blocks);
    group
        .reduce_scatter(buffer_view(blocks, 0, blocks.numel(), dtype),
                        buffer_view(mine, 0, mine.numel(), dtype), comm::ReduceOp::kSum)
        ->wait();
    return {mine, Tensor()};
  }
};

// Positions [first, first + length) as a tensor on `device`.
Tensor run_positions(const PositionRun& run, const torch::Device& device) {
  return torch::arange(run.first, run.first + run.length,
                       torch::TensorOptions().dtype(torch::kInt64).device(device));
}

}  // namespace

Tensor gather_context(const Tensor& x, comm::Communicator& group) {
  DNALLM_CHECK(x.dim() == 4, ExitCode::kUsage,
               "gather_context: expected [batch, heads, positions, head_dim], got {} dimensions",
               x.dim());
  return GatherContext::apply(x, &group);
}

Tensor gather_context_rows(const Tensor& x, comm::Communicator& group) {
  const auto all = all_gather(x.contiguous(), group);  // [C, B, T / C]
  return all.permute({1, 0, 2}).reshape({x.size(0), -1});
}

Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionContext& context, double dropout_p) {
  const auto query_runs = position_runs(context.query_positions);
  const auto key_runs = position_runs(context.key_positions);
  DNALLM_CHECK(q.size(2) == int64_t(context.query_positions.size()) &&
                   k.size(2) == int64_t(context.key_positions.size()),
               ExitCode::kUsage,
               "context attention: {} queries and {} keys for {} and {} positions", q.size(2),
               k.size(2), context.query_positions.size(), context.key_positions.size());
  const auto device = q.device();
  const int64_t B = q.size(0), H = q.size(1);
  const double scale = 1.0 / std::sqrt(double(q.size(-1)));
  const auto f32 = q.options().dtype(torch::kFloat32);
  Tensor slopes;
  if (!context.alibi_slopes.empty()) {
    std::vector<float> s(context.alibi_slopes.begin(), context.alibi_slopes.end());
    slopes = torch::tensor(s, torch::kFloat32).to(device).view({1, H, 1, 1});
  }
  std::vector<Tensor> outputs;
  for (const auto& qr : query_runs) {
    const auto qi = q.narrow(2, qr.offset, qr.length);
    const int64_t q_last = qr.first + qr.length - 1;
    const auto q_pos = run_positions(qr, device);
    std::vector<Tensor> parts, lses;
    for (const auto& kr : key_runs) {
      const int64_t k_last = kr.first + kr.length - 1;
      if (context.causal && kr.first > q_last) continue;  // every key after every query
      const auto kj = k.narrow(2, kr.offset, kr.length), vj = v.narrow(2, kr.offset, kr.length);
      auto scores = torch::matmul(qi, kj.transpose(-2, -1)) * scale;  // [B, H, tq, tk]
      const auto k_pos = run_positions(kr, device);
      Tensor allowed;                             // bool, broadcastable to [B, 1, tq, tk]
      if (context.causal && k_last > qr.first) {  // the block straddles the diagonal
        allowed = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).view({1, 1, qr.length, kr.length});
      }
      auto both = [&](const Tensor& a) { return allowed.defined() ? allowed.logical_and(a) : a; };
      if (context.key_ok.defined()) {
        allowed = both(context.key_ok.narrow(1, kr.offset, kr.length).view({B, 1, 1, kr.length}));
      }
      if (context.key_segments.defined()) {
        const auto qs = context.query_segments.narrow(1, qr.offset, qr.length);
        const auto ks = context.key_segments.narrow(1, kr.offset, kr.length);
        allowed = both(qs.unsqueeze(2).eq(ks.unsqueeze(1)).unsqueeze(1));
      }
      // The one-rank path's additive bias (Note [Attention masks], Note [ALiBi]), this block's.
      Tensor bias;
      if (allowed.defined()) {
        bias = torch::zeros(allowed.sizes(), f32).masked_fill(allowed.logical_not(), -1e9);
      }
      if (slopes.defined()) {
        const auto alibi =
            slopes * (k_pos.unsqueeze(0) - q_pos.unsqueeze(1)).abs().neg().to(torch::kFloat32);
        bias = bias.defined() ? bias + alibi : alibi;
      }
      if (bias.defined()) scores = scores + bias.to(scores.dtype());
      const auto lse = torch::logsumexp(scores, -1, /*keepdim=*/true);  // [B, H, tq, 1]
      auto probs = torch::exp(scores - lse);
      if (dropout_p > 0) probs = torch::dropout(probs, dropout_p, true);
      parts.push_back(torch::matmul(probs, vj));
      lses.push_back(lse);
    }
    const auto lse = torch::logsumexp(torch::cat(lses, -1), -1, /*keepdim=*/true);
    Tensor out;
    for (size_t j = 0; j < parts.size(); ++j) {
      const auto part = torch::exp(lses[j] - lse) * parts[j];
      out = out.defined() ? out + part : part;
    }
    outputs.push_back(out);
  }
  return outputs.size() == 1 ? outputs[0] : torch::cat(outputs, 2);
}

}  // namespace dnallm::models
