#include "comm/communicator.hpp"

#include <algorithm>

#include "core/enum_names.hpp"
#include "core/error.hpp"

namespace dnallm::comm {

namespace {

constexpr EnumName<ReduceOp> kReduceOpNames[] = {
    {ReduceOp::kSum, "sum"}, {ReduceOp::kAvg, "avg"}, {ReduceOp::kMax, "max"}};
static_assert(lists_each_in_order<ReduceOp::kMax>(kReduceOpNames));

}  // namespace

const char* reduce_op_name(ReduceOp op) { return name_of(kReduceOpNames, op, "?"); }

ReduceOp parse_reduce_op(const std::string& name) {
  if (auto op = value_named(kReduceOpNames, name)) return *op;
  fail(ExitCode::kUsage, "unknown reduction '{}': use sum, avg or max", name);
}

ShardRange shard_range(size_t count, int world_size, int rank) {
  const auto w = static_cast<size_t>(world_size);
  const auto r = static_cast<size_t>(rank);
  const size_t base = count / w;
  const size_t extra = count % w;
  return ShardRange{r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

AllToAllLayout all_to_all_layout(const char* backend, int world_size, int rank, size_t in_count,
                                 const std::vector<int64_t>& in_counts, size_t out_count,
                                 const std::vector<int64_t>& out_counts) {
  const auto w = static_cast<size_t>(world_size);
  auto offsets = [&](const std::vector<int64_t>& counts, const char* side, size_t total) {
    DNALLM_CHECK(counts.size() == w, ExitCode::kFailure,
                 "{} all_to_all on rank {}: {} has {} counts, expected one per rank ({})", backend,
                 rank, side, counts.size(), w);
    std::vector<size_t> off(w + 1, 0);
    for (size_t p = 0; p < w; ++p) {
      DNALLM_CHECK(counts[p] >= 0, ExitCode::kFailure,
                   "{} all_to_all on rank {}: {}[{}] = {} is negative", backend, rank, side, p,
                   counts[p]);
      off[p + 1] = off[p] + static_cast<size_t>(counts[p]);
    }
    DNALLM_CHECK(off[w] == total, ExitCode::kFailure,
                 "{} all_to_all on rank {}: {} add up to {} elements but the buffer holds {}",
                 backend, rank, side, off[w], total);
    return off;
  };
  AllToAllLayout layout;
  layout.in_offsets = offsets(in_counts, "in_counts", in_count);
  layout.out_offsets = offsets(out_counts, "out_counts", out_count);
  const auto me = static_cast<size_t>(rank);
  DNALLM_CHECK(in_counts[me] == out_counts[me], ExitCode::kFailure,
               "{} all_to_all on rank {}: the block kept here differs in size: in_counts[{}] = {}, "
               "out_counts[{}] = {}",
               backend, rank, rank, in_counts[me], rank, out_counts[me]);
  return layout;
}

std::vector<int> split_members(const std::vector<int>& colors, const std::vector<int>& keys,
                               int rank) {
  DNALLM_CHECK(
      colors.size() == keys.size() && rank >= 0 && static_cast<size_t>(rank) < colors.size(),
      ExitCode::kFailure, "split: {} colors, {} keys, rank {}", colors.size(), keys.size(), rank);
  const int color = colors[static_cast<size_t>(rank)];
  std::vector<int> members;
  if (color < 0) return members;
  for (size_t r = 0; r < colors.size(); ++r)
    if (colors[r] == color) members.push_back(static_cast<int>(r));
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return keys[static_cast<size_t>(a)] < keys[static_cast<size_t>(b)];
  });
  return members;
}

std::string split_name(const std::string& parent, uint64_t n, int color) {
  return fmt::format("{}.split{}.c{}", parent, n, color);
}

// ---------------------------------------------------------------- Communicator defaults

WorkPtr Communicator::all_to_all(BufferView, const std::vector<int64_t>&, BufferView,
                                 const std::vector<int64_t>&) {
  fail(ExitCode::kUsage, "this {} communicator does not implement all_to_all", backend());
}

std::unique_ptr<Communicator> Communicator::split(int, int) {
  fail(ExitCode::kUsage, "this {} communicator does not implement split", backend());
}

WorkPtr Communicator::send(BufferView, int, int) {
  fail(ExitCode::kUsage, "this {} communicator does not implement send", backend());
}

WorkPtr Communicator::recv(BufferView, int, int) {
  fail(ExitCode::kUsage, "this {} communicator does not implement recv", backend());
}

}  // namespace dnallm::comm
