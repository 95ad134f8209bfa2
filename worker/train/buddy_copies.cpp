// Note [Buddy copies] (worker/train/in_process_recovery.hpp): each step's commit of the shard
// copies, and the recovery's exchange of shards under ZeRO-1/2/3.
#include "coordinator/store.hpp"
#include "worker/train/in_process_recovery.hpp"
#include "worker/train/recovery_detail.hpp"

namespace dnallm::train {

using namespace recovery_detail;  // NOLINT: this file's half of the recovery

namespace {

// Note [Buddy copies]: the tags of a commit's two messages, and of a spare's shard.
constexpr int kHeaderTag = 41001, kShardTag = 41002, kSpareTag = 41003;

// This rank's shard of the optimizer's range: [parameters | exp_avg | exp_avg_sq].
struct ShardViews {
  torch::Tensor params, exp_avg, exp_avg_sq;
  int64_t numel() const { return params.numel(); }
};
ShardViews shard_views(Trainer& t) {
  auto& opt = t.optimizer();
  return {t.flat().params().slice(0, opt.begin(), opt.end()), opt.exp_avg(), opt.exp_avg_sq()};
}

void pack(const ShardViews& v, torch::Tensor& data) {
  const int64_t n = v.numel();
  if (!data.defined() || data.numel() != 3 * n) data = torch::empty({3 * n}, torch::kFloat32);
  data.slice(0, 0, n).copy_(v.params);
  data.slice(0, n, 2 * n).copy_(v.exp_avg);
  data.slice(0, 2 * n, 3 * n).copy_(v.exp_avg_sq);
}

void unpack(const torch::Tensor& data, const ShardViews& v) {
  const int64_t n = v.numel();
  DNALLM_CHECK(data.numel() == 3 * n, ExitCode::kFailure,
               "in-process recovery: a shard copy of {} elements for a shard of {} (a bug; please "
               "report it)",
               data.numel(), n);
  v.params.copy_(data.slice(0, 0, n));
  v.exp_avg.copy_(data.slice(0, n, 2 * n));
  v.exp_avg_sq.copy_(data.slice(0, 2 * n, 3 * n));
}

// Sends or receives `t` (fp32 or fp64, contiguous) in chunks; the works, to wait for together.
void transfer(comm::Communicator& comm, const torch::Tensor& t, int peer, int tag, bool send,
              std::vector<comm::WorkPtr>& works) {
  for_each_chunk(t, [&](BufferView view) {
    works.push_back(send ? comm.send(view, peer, tag) : comm.recv(view, peer, tag));
  });
}

void wait_each(std::vector<comm::WorkPtr>& works) {
  for (auto& w : works) w->wait();
  works.clear();
}

// Every rank's numel, gathered.
std::vector<int64_t> gather_counts(comm::Communicator& comm, int64_t own) {
  auto mine = torch::full({1}, own, torch::kInt64);
  auto all = torch::zeros({comm.world_size()}, torch::kInt64);
  wait_all(comm.allgather(buffer_view(mine, 0, 1, DType::kInt64),
                          buffer_view(all, 0, all.numel(), DType::kInt64)));
  return {all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel()};
}

}  // namespace

void InProcessRecovery::commit(Trainer& t) {
  comm::Communicator& comm = *o_.comm;
  const int world = comm.world_size(), rank = comm.rank();
  const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  const int64_t step = t.step();
  const int slot = static_cast<int>(step % 2);
  torch::NoGradGuard no_grad;
  const ShardViews views = shard_views(t);
  StateCopy& own = own_[slot];
  StateCopy& buddy = buddy_[slot];
  own.step = -1;
  own.header = state_header(t, step);
  pack(views, own.data);
  own.step = step;
  buddy.step = -1;
  if (!buddy.header.defined()) buddy.header = torch::zeros({StateHeader::kCount}, torch::kFloat64);
  if (prev_numel_ < 0) prev_numel_ = gather_counts(comm, views.numel())[prev];
  if (!buddy.data.defined() || buddy.data.numel() != 3 * prev_numel_) {
    buddy.data = torch::empty({3 * prev_numel_}, torch::kFloat32);
  }
  std::vector<comm::WorkPtr> works;
  transfer(comm, buddy.header, prev, kHeaderTag, /*send=*/false, works);
  transfer(comm, buddy.data, prev, kShardTag, /*send=*/false, works);
  transfer(comm, own.header, next, kHeaderTag, /*send=*/true, works);
  transfer(comm, own.data, next, kShardTag, /*send=*/true, works);
  wait_each(works);
  buddy.step = step;
  // Past this barrier every rank holds its own copy of `step` and its predecessor's.
  wait_all(comm.barrier());
  committed_ = step;
}

int64_t InProcessRecovery::exchange_shards(Trainer& t, bool holds_state, int& source) {
  comm::Communicator& comm = *o_.comm;
  const int world = comm.world_size(), rank = comm.rank();
  torch::NoGradGuard no_grad;
  const ShardViews views = shard_views(t);
  const auto counts = gather_counts(comm, views.numel());
  prev_numel_ = counts[(rank + world - 1) % world];
  const int64_t committed =
      static_cast<int64_t>(allreduce_max(comm, holds_state ? committed_ : -1));
  if (committed < 0) {
    throw StateLost(ExitCode::kPeerFailed,
                    "in-process recovery: no rank of the re-formed group holds a committed state; "
                    "the generation restarts from its last checkpoint");
  }
  // Who holds what, for the committed step S and the one after: [holds a state, has its own
  // copy of S, has its predecessor's copy of S, the same two of S + 1].
  const auto has = [](const StateCopy(&copies)[2], int64_t step) {
    return copies[step % 2].step == step ? 1.0 : 0.0;
  };
  auto mine = torch::tensor({holds_state ? 1.0 : 0.0, has(own_, committed), has(buddy_, committed),
                             has(own_, committed + 1), has(buddy_, committed + 1)},
                            torch::kFloat64);
  constexpr int kFields = 5;
  auto table = torch::zeros({kFields * world}, torch::kFloat64);
  wait_all(comm.allgather(buffer_view(mine, 0, kFields, DType::kFloat64),
                          buffer_view(table, 0, table.numel(), DType::kFloat64)));
  const auto at = [&](int r, int k) { return table[kFields * r + k].item<double>() != 0.0; };
  // S + 1 when every shard's copy of it survived: a failure after the last step's exchange
  // (during its barrier) then costs no step at all.
  bool next_held = true;
  for (int r = 0; r < world; ++r) {
    const int buddy = (r + 1) % world;
    next_held = next_held && (at(r, 0) ? at(r, 3) : at(buddy, 0) && at(buddy, 4));
  }
  const int64_t target = next_held ? committed + 1 : committed;
  const int own_field = next_held ? 3 : 1, buddy_field = next_held ? 4 : 2;
  const int slot = static_cast<int>(target % 2);
  source = -1;
  for (int r = 0; r < world; ++r) {
    const int buddy = (r + 1) % world;
    if (at(r, 0)) {
      DNALLM_CHECK(at(r, own_field), ExitCode::kFailure,
                   "in-process recovery: rank {} holds no copy of its shard at step {} (a bug; "
                   "please report it)",
                   r, target);
      if (source < 0) source = r;
    } else {
      if (!at(buddy, 0) || !at(buddy, buddy_field)) {
        throw StateLost(
            ExitCode::kPeerFailed,
            fmt::format("in-process recovery: rank {}'s shard of step {} was held only by rank {} "
                        "(its buddy), which {}; the generation restarts from its last checkpoint",
                        r, target, buddy, at(buddy, 0) ? "has no copy of it" : "failed too"));
      }
    }
  }
  // Every place given to a spare gets its shard from its buddy, the rank after it.
  int64_t bytes = 0;
  torch::Tensor received;
  std::vector<comm::WorkPtr> works;
  for (int r = 0; r < world; ++r) {
    if (at(r, 0)) continue;
    const int buddy = (r + 1) % world;
    if (rank == buddy) {
      transfer(comm, buddy_[slot].data, r, kSpareTag, /*send=*/true, works);
    } else if (rank == r) {
      received = torch::empty({3 * views.numel()}, torch::kFloat32);
      transfer(comm, received, buddy, kSpareTag, /*send=*/false, works);
    }
    bytes += 3 * counts[r] * int64_t{4};
  }
  wait_each(works);
  unpack(holds_state ? own_[slot].data : received, views);
  auto header = rank == source ? own_[slot].header.clone()
                               : torch::zeros({StateHeader::kCount}, torch::kFloat64);
  bytes += broadcast_tensor(comm, header, source);
  const int64_t own_step = holds_state ? t.step() : -1;
  apply_header(t, header, own_step, source);
  // ZeRO-1/2: every rank's parameters whole again, from the shards.
  t.sync().after_optimizer_step(t.flat());
  // The copies of `target` again, the spares' included (a second failure finds them).
  commit(t);
  return bytes;
}

}  // namespace dnallm::train
