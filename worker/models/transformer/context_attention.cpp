#include "worker/models/transformer/context_attention.hpp"

#include <chrono>
#include <cmath>
#include <tuple>
#include <utility>

#include "core/error.hpp"
#include "worker/models/transformer/attention.hpp"
#include "worker/parallel/context_parallel.hpp"
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

// Note [Attention context parallelism]: one context_attention call's K/V exchange, shared by the
// two autograd nodes around its blocks (LocalKeys, ReceivedKeys) and kept alive by them.
struct KeyValueExchange : torch::CustomClassHolder {
  comm::Communicator* group = nullptr;
  bool overlap = true;
  ContextAttentionCounts* counts = nullptr;
  // Forward: this rank's k and v [2, B, Hkv, t, D] all-gathered into [C, 2, B, Hkv, t, D].
  Tensor sent, received;
  comm::WorkPtr gather;
  // Backward: the remote blocks' gradient of `received` reduce-scattered into this rank's share.
  Tensor gradient, own_gradient;
  comm::WorkPtr scatter;

  KeyValueExchange() = default;
  KeyValueExchange(const KeyValueExchange&) = delete;
  KeyValueExchange& operator=(const KeyValueExchange&) = delete;
  // A collective must not outlive its buffers (Communicator contract): one still runs here only
  // when an error ended the call or the backward between launch and wait.
  ~KeyValueExchange() override {
    for (auto* work : {&gather, &scatter}) {
      if (*work == nullptr) continue;
      try {
        (*work)->wait();
      } catch (...) {  // the first error was reported where it happened; never throw here
      }
    }
  }

  void timed_wait(comm::Work& work) {
    if (counts == nullptr) return work.wait();
    const auto start = std::chrono::steady_clock::now();
    work.wait();
    counts->seconds_waiting +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  void launch_gather(const Tensor& k, const Tensor& v) {
    sent = torch::stack({k.detach(), v.detach()});
    std::tie(received, gather) = parallel::launch_gather_ranks(sent, *group);
    if (counts != nullptr) ++counts->exchanges;
  }
  bool gathering() const { return gather != nullptr; }
  // Waits for the all-gather; the received buffer, handed over once (see ReceivedKeys).
  void wait_gather() {
    if (gather == nullptr) return;
    timed_wait(*gather);
    gather.reset();
    sent = Tensor();
  }

  // `g`: the gradient of `received` (undefined: zero).
  void launch_scatter(const Tensor& g, c10::IntArrayRef received_shape,
                      const torch::TensorOptions& options) {
    gradient = g.defined() ? g.contiguous() : torch::zeros(received_shape, options);
    own_gradient = torch::empty(received_shape.slice(1), gradient.options());
    const auto dtype = wire_dtype(gradient);
    scatter = group->reduce_scatter(buffer_view(gradient, 0, gradient.numel(), dtype),
                                    buffer_view(own_gradient, 0, own_gradient.numel(), dtype),
                                    comm::ReduceOp::kSum);
    if (counts != nullptr) ++counts->gradient_exchanges;
    if (!overlap) wait_scatter();
  }
  bool scattering() const { return scatter != nullptr; }
  void wait_scatter() {
    if (scatter == nullptr) return;
    timed_wait(*scatter);
    scatter.reset();
    gradient = Tensor();
  }
};

c10::intrusive_ptr<KeyValueExchange> exchange_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<KeyValueExchange>(
      ctx->saved_data["exchange"].toCapsule());
}

// Hands this rank's k and v to the blocks unchanged. Its backward runs after every block's (they
// all read its outputs, ReceivedKeys too): it waits for the reduce-scatter that ReceivedKeys'
// backward launched, or launches it with zeros when that did not run (no remote block reached
// the loss: every rank still issues it), and adds this rank's share of the remote blocks'
// gradients to the local blocks'.
struct LocalKeys : torch::autograd::Function<LocalKeys> {
  static variable_list forward(AutogradContext* ctx, const Tensor& k, const Tensor& v,
                               const c10::intrusive_ptr<KeyValueExchange>& exchange) {
    ctx->saved_data["exchange"] = c10::IValue::make_capsule(exchange);
    ctx->saved_data["received_shape"] = c10::IValue(exchange->received.sizes().vec());
    return {k, v};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto exchange = exchange_of(ctx);
    if (!exchange->scattering() && !exchange->own_gradient.defined()) {
      const auto shape = ctx->saved_data["received_shape"].toIntVector();
      const auto& like = grads[0].defined() ? grads[0] : grads[1];
      exchange->launch_scatter(Tensor(), shape, like.options());
    }
    exchange->wait_scatter();
    const auto own = std::move(exchange->own_gradient);  // [2, B, Hkv, t, D]
    exchange->own_gradient = Tensor();
    auto add = [](const Tensor& g, const Tensor& r) { return g.defined() ? g + r : r; };
    return {add(grads[0], own[0]), add(grads[1], own[1]), Tensor()};
  }
};

// The received buffer [C, 2, B, Hkv, t, D] as a function of this rank's k and v (LocalKeys'
// outputs): the all-gather ran before, the forward only hands it over (and lets go of it: the
// exchange must not hold a tensor whose grad_fn holds the exchange). Backward: launches the
// reduce-scatter of its gradient to the ranks that own the keys and returns none itself
// (LocalKeys' backward adds it).
struct ReceivedKeys : torch::autograd::Function<ReceivedKeys> {
  static Tensor forward(AutogradContext* ctx, const Tensor& /*k*/, const Tensor& /*v*/,
                        const c10::intrusive_ptr<KeyValueExchange>& exchange) {
    ctx->saved_data["exchange"] = c10::IValue::make_capsule(exchange);
    return std::exchange(exchange->received, Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto exchange = exchange_of(ctx);
    const auto& g = grads[0];
    DNALLM_CHECK(g.defined(), ExitCode::kFailure,
                 "context attention: no gradient for the received keys and values");
    exchange->launch_scatter(g, g.sizes(), g.options());
    return {Tensor(), Tensor(), Tensor()};
  }
};

// Positions [first, first + length) as a tensor on `device`.
Tensor run_positions(const PositionRun& run, const torch::Device& device) {
  return torch::arange(run.first, run.first + run.length,
                       torch::TensorOptions().dtype(torch::kInt64).device(device));
}

// The additive bias [B or 1, 1 or H, tq, tk] of the block of query run `qr` (global positions
// `q_pos`) and key run `kr` (`k_pos`), undefined when nothing masks it: causality where the
// block straddles the diagonal, padding, segments and ALiBi (`slopes` [1, H, 1, 1], defined).
Tensor block_bias(const AttentionContext& context, const PositionRun& qr, const PositionRun& kr,
                  const Tensor& q_pos, const Tensor& k_pos, int64_t batch, const Tensor& slopes,
                  const torch::TensorOptions& f32) {
  const int64_t k_last = kr.first + kr.length - 1;
  Tensor allowed;                             // bool, broadcastable to [B, 1, tq, tk]
  if (context.causal && k_last > qr.first) {  // the block straddles the diagonal
    allowed = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).view({1, 1, qr.length, kr.length});
  }
  auto both = [&](const Tensor& a) { return allowed.defined() ? allowed.logical_and(a) : a; };
  if (context.key_ok.defined()) {
    allowed = both(context.key_ok.narrow(1, kr.offset, kr.length).view({batch, 1, 1, kr.length}));
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
  return bias;
}

// The (query run, key run) blocks of one query run: their outputs and log-sum-exps.
struct RunBlocks {
  std::vector<Tensor> parts, lses;
};

// Note [Attention context parallelism]: each query run's blocks merged exactly by their
// log-sum-exp, the runs concatenated along the positions.
Tensor merge_blocks(const std::vector<RunBlocks>& blocks) {
  std::vector<Tensor> outputs;
  for (const auto& b : blocks) {
    const auto lse = torch::logsumexp(torch::cat(b.lses, -1), -1, /*keepdim=*/true);
    Tensor out;
    for (size_t j = 0; j < b.parts.size(); ++j) {
      const auto part = torch::exp(b.lses[j] - lse) * b.parts[j];
      out = out.defined() ? out + part : part;
    }
    outputs.push_back(out);
  }
  return outputs.size() == 1 ? outputs[0] : torch::cat(outputs, 2);
}

}  // namespace

Tensor gather_context_rows(const Tensor& x, comm::Communicator& group) {
  const auto mine = x.contiguous();
  const auto [all, work] = parallel::launch_gather_ranks(mine, group);  // [C, B, T / C]
  work->wait();
  return all.permute({1, 0, 2}).reshape({x.size(0), -1});
}

Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionContext& context, double dropout_p) {
  DNALLM_CHECK(context.group != nullptr, ExitCode::kFailure, "context attention without a group");
  auto& group = *context.group;
  const int C = group.world_size(), me = group.rank();
  DNALLM_CHECK(
      q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
      ExitCode::kUsage,
      "context attention: expected q [batch, heads, positions, head_dim] and k, v of one "
      "shape and dtype, got {}, {} and {}",
      c10::str(q.sizes()), c10::str(k.sizes()), c10::str(v.sizes()));
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), t = k.size(2);
  DNALLM_CHECK(
      q.size(2) == int64_t(context.query_positions.size()) &&
          C * t == int64_t(context.key_positions.size()) && Hkv > 0 && H % Hkv == 0,
      ExitCode::kUsage,
      "context attention: {} queries of {} heads and {} keys a rank of {} heads for {} and "
      "{} positions over {} ranks",
      q.size(2), H, t, Hkv, context.query_positions.size(), context.key_positions.size(), C);
  const auto query_runs = position_runs(context.query_positions);
  // Each rank's key runs; their offsets index the gathered positions [T] (rank q's from q t).
  std::vector<std::vector<PositionRun>> key_runs(static_cast<size_t>(C));
  for (int r = 0; r < C; ++r) {
    const auto first = context.key_positions.begin() + r * t;
    key_runs[r] = position_runs(std::vector<int64_t>(first, first + t));
    for (auto& run : key_runs[r]) run.offset += r * t;
  }
  const auto device = q.device();
  const double scale = 1.0 / std::sqrt(double(q.size(-1)));
  const auto f32 = q.options().dtype(torch::kFloat32);
  Tensor slopes;
  if (!context.alibi_slopes.empty()) {
    std::vector<float> s(context.alibi_slopes.begin(), context.alibi_slopes.end());
    slopes = torch::tensor(s, torch::kFloat32).to(device).view({1, H, 1, 1});
  }
  // Note [Grouped-query attention]: each shared head repeated after the exchange.
  auto repeat = [&](const Tensor& x) { return Hkv == H ? x : repeat_kv_heads(x, H); };

  // Note [Attention context parallelism]: launch the exchange, compute the local blocks, wait,
  // compute the remote ones.
  auto exchange = c10::make_intrusive<KeyValueExchange>();
  exchange->group = &group;
  exchange->overlap = context.overlap_exchange;
  exchange->counts = context.counts;
  exchange->launch_gather(k, v);
  if (!context.overlap_exchange) exchange->wait_gather();
  const auto local = LocalKeys::apply(k, v, exchange);

  std::vector<RunBlocks> blocks(query_runs.size());
  // The (query run, key run) blocks of rank r's keys and values [B, H, t, D].
  auto attend = [&](int r, const Tensor& keys, const Tensor& values) {
    for (size_t i = 0; i < query_runs.size(); ++i) {
      const auto& qr = query_runs[i];
      const auto qi = q.narrow(2, qr.offset, qr.length);
      const int64_t q_last = qr.first + qr.length - 1;
      const auto q_pos = run_positions(qr, device);
      for (const auto& kr : key_runs[r]) {
        if (context.causal && kr.first > q_last) continue;  // every key after every query
        const int64_t at = kr.offset - r * t;               // in this rank's keys
        const auto kj = keys.narrow(2, at, kr.length), vj = values.narrow(2, at, kr.length);
        auto scores = torch::matmul(qi, kj.transpose(-2, -1)) * scale;  // [B, H, tq, tk]
        const auto bias =
            block_bias(context, qr, kr, q_pos, run_positions(kr, device), B, slopes, f32);
        if (bias.defined()) scores = scores + bias.to(scores.dtype());
        const auto lse = torch::logsumexp(scores, -1, /*keepdim=*/true);  // [B, H, tq, 1]
        auto probs = torch::exp(scores - lse);
        if (dropout_p > 0) probs = torch::dropout(probs, dropout_p, true);
        blocks[i].parts.push_back(torch::matmul(probs, vj));
        blocks[i].lses.push_back(lse);
        if (context.counts != nullptr) {
          ++(exchange->gathering() ? context.counts->blocks_before_wait
                                   : context.counts->blocks_after_wait);
        }
        if (r == me && context.counts != nullptr && blocks[i].parts.back().requires_grad()) {
          blocks[i].parts.back().register_hook([exchange](const Tensor&) {
            if (exchange->scattering()) ++exchange->counts->local_backward_before_wait;
          });
        }
      }
    }
  };
  attend(me, repeat(local[0]), repeat(local[1]));
  exchange->wait_gather();
  const auto received = ReceivedKeys::apply(local[0], local[1], exchange);  // [C, 2, B, Hkv, t, D]
  for (int r = 0; r < C; ++r) {
    if (r != me) attend(r, repeat(received[r][0]), repeat(received[r][1]));
  }

  return merge_blocks(blocks);
}

}  // namespace dnallm::models
