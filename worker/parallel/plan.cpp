#include "worker/parallel/plan.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace dnallm::parallel {

FlatLayout plan_flat_layout(const std::vector<int64_t>& numels, const LayoutOptions& options) {
  DNALLM_CHECK(options.element_bytes > 0 && options.bucket_cap_bytes > 0 &&
                   options.first_bucket_bytes > 0 && options.align_elements > 0 &&
                   options.world_size > 0,
               ExitCode::kUsage, "invalid layout options");
  FlatLayout layout;
  const int64_t n = static_cast<int64_t>(numels.size());
  layout.offsets.assign(numels.size(), 0);
  auto align = [&](int64_t x) {
    return (x + options.align_elements - 1) / options.align_elements * options.align_elements;
  };
  int64_t cursor = 0;
  BucketPlan current;
  int64_t current_bytes = 0;
  auto cap = [&]() {
    return layout.buckets.empty() ? options.first_bucket_bytes : options.bucket_cap_bytes;
  };
  auto close = [&]() {
    if (current.params.empty()) return;
    current.range.end = cursor;
    layout.buckets.push_back(current);
    current = BucketPlan{};
    current_bytes = 0;
  };
  for (int64_t i = n - 1; i >= 0; --i) {
    DNALLM_CHECK(numels[i] >= 0, ExitCode::kUsage, "parameter {} has negative size", i);
    int64_t bytes = numels[i] * options.element_bytes;
    if (!current.params.empty() && current_bytes + bytes > cap()) close();
    if (current.params.empty()) current.range.begin = cursor;
    layout.offsets[i] = cursor;
    current.params.push_back(i);
    current_bytes += bytes;
    cursor = align(cursor + numels[i]);
  }
  close();
  layout.total = cursor;
  layout.padded_total = (cursor + options.world_size - 1) / options.world_size * options.world_size;
  // The alignment gap after the last parameter and the world-size padding belong to the last
  // bucket, so buckets tile the whole padded buffer.
  if (!layout.buckets.empty()) layout.buckets.back().range.end = layout.padded_total;
  return layout;
}

FlatRange shard_range(int64_t padded_total, int64_t world_size, int64_t rank) {
  DNALLM_CHECK(world_size > 0 && rank >= 0 && rank < world_size && padded_total % world_size == 0,
               ExitCode::kUsage, "invalid shard request: total {} world {} rank {}", padded_total,
               world_size, rank);
  int64_t share = padded_total / world_size;
  return {rank * share, (rank + 1) * share};
}

FlatRange intersect(const FlatRange& a, const FlatRange& b) {
  int64_t begin = std::max(a.begin, b.begin);
  int64_t end = std::min(a.end, b.end);
  if (end <= begin) return {a.begin, a.begin};
  return {begin, end};
}

std::vector<UnitShard> plan_unit_shards(const std::vector<int64_t>& unit_numels, int64_t world,
                                        int64_t rank) {
  DNALLM_CHECK(world > 0 && rank >= 0 && rank < world, ExitCode::kUsage,
               "invalid rank {} of world size {}", rank, world);
  std::vector<UnitShard> out;
  int64_t begin = 0, local = 0;
  for (const int64_t n : unit_numels) {
    DNALLM_CHECK(n >= 0, ExitCode::kUsage, "a unit of {} elements", n);
    UnitShard u;
    u.begin = begin;
    u.numel = n;
    u.chunk = (n + world - 1) / world;
    u.local_offset = local;
    const int64_t lo = std::min(n, rank * u.chunk), hi = std::min(n, (rank + 1) * u.chunk);
    u.owned = {begin + lo, begin + hi};
    out.push_back(u);
    begin += n;
    local += u.chunk;
  }
  return out;
}

MemoryAccount account_memory(int64_t numel, cfg::Precision precision, int64_t zero_stage,
                             int64_t world_size) {
  DNALLM_CHECK(world_size > 0 && zero_stage >= 0 && zero_stage <= 3, ExitCode::kUsage,
               "invalid ZeRO stage {} or world size {}", zero_stage, world_size);
  const bool mixed = precision != cfg::Precision::kFp32;
  const int64_t compute_bytes = mixed ? 2 : 4;
  // Optimizer state per parameter: Adam m and v (fp32), plus fp32 master weights when the
  // model itself is kept in a 16-bit type.
  const int64_t optimizer_bytes = mixed ? 12 : 8;
  auto share = [&](int64_t bytes) { return (numel * bytes + world_size - 1) / world_size; };
  MemoryAccount m;
  m.params = zero_stage >= 3 ? share(compute_bytes) : numel * compute_bytes;
  m.grads = zero_stage >= 2 ? share(compute_bytes) : numel * compute_bytes;
  m.optimizer = zero_stage >= 1 ? share(optimizer_bytes) : numel * optimizer_bytes;
  return m;
}

}  // namespace dnallm::parallel
