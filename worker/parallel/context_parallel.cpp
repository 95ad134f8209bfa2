#include "worker/parallel/context_parallel.hpp"

#include <string>
#include <vector>

#include <fmt/format.h>
#if __has_include(<fmt/ranges.h>)
#include <fmt/ranges.h>  // fmt::join lives here from fmt 11 on
#endif

#include "core/error.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::parallel {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string shape_text(const Tensor& t) { return fmt::format("[{}]", fmt::join(t.sizes(), ", ")); }

void check_shard(const Tensor& x, const char* what) {
  DNALLM_CHECK(x.dim() == 3, ExitCode::kUsage,
               "{}: expected a [B, positions, channels] tensor, got {}", what, shape_text(x));
}

ChannelBlock channel_block(int64_t channels, int world_size, int rank) {
  DNALLM_CHECK(world_size > 0 && rank >= 0 && rank < world_size, ExitCode::kUsage,
               "context parallelism: rank {} outside a group of {}", rank, world_size);
  DNALLM_CHECK(channels > 0 && channels % world_size == 0, ExitCode::kUsage,
               "context parallelism: {} channels are not divisible by the context group's {} "
               "ranks; choose a context-parallel degree that divides the channel count",
               channels, world_size);
  const int64_t per_rank = channels / world_size;
  return {rank * per_rank, (rank + 1) * per_rank};
}

namespace {

// The autograd node keeps the group as an integer (saved_data holds IValues); the header's
// contract makes the caller keep it alive through the backward.
void save_group(AutogradContext* ctx, comm::Communicator& group) {
  ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(&group));
}
comm::Communicator& saved_group(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Communicator*>(
      static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
}

DType wire_dtype(const Tensor& t, const char* what) {
  const auto d = dtype_of(t.scalar_type());
  DNALLM_CHECK(d.has_value(), ExitCode::kUsage, "{}: no communicator dtype for a {} tensor", what,
               c10::toString(t.scalar_type()));
  return *d;
}

BufferView whole(const Tensor& t, DType dtype) { return buffer_view(t, 0, t.numel(), dtype); }

// `blocks` [C, ...] contiguous: block p to rank p; returns the C blocks received, block p from
// rank p.
Tensor exchange_blocks(const Tensor& blocks, comm::Communicator& group, const char* what) {
  const auto dtype = wire_dtype(blocks, what);
  auto out = torch::empty_like(blocks);
  const int64_t world = group.world_size();
  const std::vector<int64_t> counts(static_cast<size_t>(world), blocks.numel() / world);
  group.all_to_all(whole(blocks, dtype), counts, whole(out, dtype), counts)->wait();
  return out;
}

// Note [Context all-to-all layout]: both directions send rank p the block [B, L / C, D / C] of
// (positions of the sender's or p's chunk) x (channels of p's or the sender's block), laid out
// [C, B, L / C, D / C] so that each peer's block is contiguous and blocks are in rank order.
Tensor to_channels(const Tensor& x, comm::Communicator& group) {
  constexpr const char* what = "sequence_to_channels";
  check_shard(x, what);
  const int world = group.world_size();
  const int64_t B = x.size(0), positions = x.size(1), D = x.size(2);
  const int64_t per_rank = channel_block(D, world, group.rank()).count();
  // Sent: block p = my positions x p's channels.
  auto blocks = x.reshape({B, positions, world, per_rank}).permute({2, 0, 1, 3}).contiguous();
  // Received: block p = p's positions x my channels; positions in rank order.
  auto got = exchange_blocks(blocks, group, what);
  return got.permute({1, 0, 2, 3}).reshape({B, world * positions, per_rank});
}

Tensor to_sequence(const Tensor& y, comm::Communicator& group) {
  constexpr const char* what = "channels_to_sequence";
  check_shard(y, what);
  const int world = group.world_size();
  const int64_t B = y.size(0), L = y.size(1), per_rank = y.size(2);
  DNALLM_CHECK(L % world == 0, ExitCode::kUsage,
               "{}: {} positions are not divisible by the context group's {} ranks; pad the "
               "sequence to a multiple of the context-parallel degree",
               what, L, world);
  const int64_t positions = L / world;
  // Sent: block p = p's positions x my channels.
  auto blocks = y.reshape({B, world, positions, per_rank}).permute({1, 0, 2, 3}).contiguous();
  // Received: block p = my positions x p's channels; channels in rank order.
  auto got = exchange_blocks(blocks, group, what);
  return got.permute({1, 2, 0, 3}).reshape({B, positions, world * per_rank});
}

struct GatherRanks : torch::autograd::Function<GatherRanks> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, comm::Communicator* group) {
    save_group(ctx, *group);
    const auto mine = x.contiguous();
    auto [all, work] = launch_gather_ranks(mine, *group);
    work->wait();
    return all;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = saved_group(ctx);
    const auto gradient = grads[0].contiguous();
    const auto dtype = wire_dtype(gradient, "gather_ranks");
    auto mine = torch::empty(gradient.sizes().slice(1), gradient.options());
    group.reduce_scatter(whole(gradient, dtype), whole(mine, dtype), comm::ReduceOp::kSum)->wait();
    return {mine, Tensor()};
  }
};

struct SequenceToChannels : torch::autograd::Function<SequenceToChannels> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, comm::Communicator* group) {
    save_group(ctx, *group);
    return to_channels(x, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {to_sequence(grads[0], saved_group(ctx)), Tensor()};
  }
};

struct ChannelsToSequence : torch::autograd::Function<ChannelsToSequence> {
  static Tensor forward(AutogradContext* ctx, const Tensor& y, comm::Communicator* group) {
    save_group(ctx, *group);
    return to_sequence(y, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {to_channels(grads[0], saved_group(ctx)), Tensor()};
  }
};

// Posts the recv (if any) before the send (if any), then waits for both. See the header.
void send_recv(comm::Communicator& group, const Tensor& to_send, int to, const Tensor& to_recv,
               int from, int tag, const char* what) {
  comm::WorkPtr recv_work, send_work;
  if (to_recv.defined()) {
    recv_work = group.recv(whole(to_recv, wire_dtype(to_recv, what)), from, tag);
  }
  if (to_send.defined()) {
    send_work = group.send(whole(to_send, wire_dtype(to_send, what)), to, tag);
  }
  if (recv_work) recv_work->wait();
  if (send_work) send_work->wait();
}

struct CausalHalo : torch::autograd::Function<CausalHalo> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x_in, int64_t halo,
                        comm::Communicator* group) {
    constexpr const char* what = "causal_halo";
    check_shard(x_in, what);
    const int64_t positions = x_in.size(1);
    DNALLM_CHECK(halo >= 0 && halo <= positions, ExitCode::kUsage,
                 "{}: a halo of {} positions needs at least that many positions per rank, got {}; "
                 "use a lower context-parallel degree or a longer sequence",
                 what, halo, positions);
    save_group(ctx, *group);
    ctx->saved_data["halo"] = halo;
    const auto x = x_in.contiguous();
    auto received = torch::zeros({x.size(0), halo, x.size(2)}, x.options());
    if (halo > 0) {
      const int rank = group->rank(), world = group->world_size();
      const Tensor tail =
          rank + 1 < world ? x.slice(1, positions - halo, positions).contiguous() : Tensor();
      send_recv(*group, tail, rank + 1, rank > 0 ? received : Tensor(), rank - 1, kHaloTag, what);
    }
    return torch::cat({received, x}, 1);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr const char* what = "causal_halo backward";
    auto& group = saved_group(ctx);
    const int64_t halo = ctx->saved_data["halo"].toInt();
    const auto& g = grads[0];
    const int64_t positions = g.size(1) - halo;
    auto dx = g.slice(1, halo).clone(at::MemoryFormat::Contiguous);
    if (halo > 0) {
      const int rank = group.rank(), world = group.world_size();
      const Tensor halo_grad = rank > 0 ? g.slice(1, 0, halo).contiguous() : Tensor();
      const Tensor from_next =
          rank + 1 < world ? torch::empty({g.size(0), halo, g.size(2)}, g.options()) : Tensor();
      send_recv(group, halo_grad, rank - 1, from_next, rank + 1, kHaloGradTag, what);
      if (from_next.defined()) dx.slice(1, positions - halo, positions).add_(from_next);
    }
    return {dx, Tensor(), Tensor()};
  }
};

// In place: t summed over the group. See Note [Context-parallel pooling].
void all_reduce_in_place(Tensor& t, comm::ReduceOp op, comm::Communicator& group,
                         const char* what) {
  const auto dtype = wire_dtype(t, what);
  group.allreduce(whole(t, dtype), whole(t, dtype), op)->wait();
}

struct ContextAllReduceSum : torch::autograd::Function<ContextAllReduceSum> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, comm::Communicator* group) {
    save_group(ctx, *group);
    auto out = x.contiguous().clone();
    all_reduce_in_place(out, comm::ReduceOp::kSum, *group, "context_all_reduce_sum");
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = grads[0].contiguous().clone();
    all_reduce_in_place(g, comm::ReduceOp::kSum, saved_group(ctx),
                        "context_all_reduce_sum backward");
    return {g, Tensor()};
  }
};

}  // namespace

void refuse_context_parallel_regression(bool regression, int64_t degree) {
  DNALLM_CHECK(!regression, ExitCode::kUsage,
               "parallel.context_parallel = {} cannot train a regressor yet (model.task = "
               "\"regression\"): set parallel.context_parallel = 1",
               degree);
}

std::pair<Tensor, comm::WorkPtr> launch_gather_ranks(const Tensor& x, comm::Communicator& group) {
  DNALLM_CHECK(x.is_contiguous(), ExitCode::kFailure, "launch_gather_ranks: a strided tensor");
  std::vector<int64_t> sizes{group.world_size()};
  for (const auto s : x.sizes()) sizes.push_back(s);
  auto all = torch::empty(sizes, x.options());
  const auto dtype = wire_dtype(x, "gather_ranks");
  auto work = group.allgather(whole(x, dtype), whole(all, dtype));
  return {all, work};
}

Tensor gather_ranks(const Tensor& x, comm::Communicator& group) {
  return GatherRanks::apply(x, &group);
}

Tensor context_all_reduce_sum(const Tensor& x, comm::Communicator& group) {
  return ContextAllReduceSum::apply(x, &group);
}

Tensor context_mean_pool(const Tensor& hidden, const Tensor& mask, comm::Communicator& group) {
  constexpr const char* what = "context_mean_pool";
  check_shard(hidden, what);
  DNALLM_CHECK(!mask.defined() || (mask.dim() == 2 && mask.size(0) == hidden.size(0) &&
                                   mask.size(1) == hidden.size(1)),
               ExitCode::kUsage, "{}: a mask {} for hidden states {}", what,
               mask.defined() ? shape_text(mask) : "[]", shape_text(hidden));
  Tensor sum, count;
  if (mask.defined()) {
    const auto m = mask.to(hidden.scalar_type()).unsqueeze(-1);
    sum = (hidden * m).sum(1);
    count = m.sum(1);
  } else {
    sum = hidden.sum(1);
    count = torch::full({hidden.size(0), 1}, double(hidden.size(1)), hidden.options());
  }
  // One all-reduce of [sum | count] (the counts carry no gradient).
  const int64_t H = sum.size(1);
  const auto both = context_all_reduce_sum(torch::cat({sum, count.detach()}, 1), group);
  return both.narrow(1, 0, H) / both.narrow(1, H, 1).clamp_min(1.0);
}

Tensor context_token_pool(const Tensor& hidden, const Tensor& positions, const Tensor& index,
                          comm::Communicator& group) {
  constexpr const char* what = "context_token_pool";
  check_shard(hidden, what);
  DNALLM_CHECK(positions.dim() == 1 && positions.size(0) == hidden.size(1) && index.dim() == 1 &&
                   index.size(0) == hidden.size(0),
               ExitCode::kUsage, "{}: positions {} and index {} for hidden states {}", what,
               shape_text(positions), shape_text(index), shape_text(hidden));
  const int64_t B = hidden.size(0), H = hidden.size(2);
  // [B, T / C]: where each row's position lies here, if it does.
  const auto here = positions.to(hidden.device()).view({1, -1}).eq(index.view({-1, 1}));
  const auto slot = here.to(torch::kInt64).argmax(1);
  const auto picked = hidden.gather(1, slot.view({B, 1, 1}).expand({B, 1, H})).squeeze(1);
  // Zeros where the position is another rank's (where, not a product: 0 x inf is NaN).
  const auto mine = torch::where(here.any(1, /*keepdim=*/true), picked, torch::zeros_like(picked));
  return context_all_reduce_sum(mine, group);
}

Tensor context_first_position(const Tensor& where, const Tensor& positions, int64_t none,
                              comm::Communicator& group) {
  constexpr const char* what = "context_first_position";
  DNALLM_CHECK(where.dim() == 2 && positions.dim() == 1 && positions.size(0) == where.size(1),
               ExitCode::kUsage, "{}: positions {} for a mask {}", what, shape_text(positions),
               shape_text(where));
  torch::NoGradGuard no_grad;
  const auto global = positions.to(where.device(), torch::kInt64).view({1, -1}).expand_as(where);
  const auto none_here = torch::full_like(global, none);
  // The communicator has no minimum: the maximum of the negated positions.
  auto negated = torch::where(where, global, none_here).amin(1).neg().contiguous();
  all_reduce_in_place(negated, comm::ReduceOp::kMax, group, what);
  return negated.neg();
}

Tensor sequence_to_channels(const Tensor& x, comm::Communicator& group) {
  return SequenceToChannels::apply(x, &group);
}

Tensor channels_to_sequence(const Tensor& y, comm::Communicator& group) {
  return ChannelsToSequence::apply(y, &group);
}

Tensor causal_halo(const Tensor& x, int64_t halo, comm::Communicator& group) {
  return CausalHalo::apply(x, halo, &group);
}

}  // namespace dnallm::parallel
