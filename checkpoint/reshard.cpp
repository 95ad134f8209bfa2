#include "checkpoint/reshard.hpp"

#include <algorithm>

#include "checkpoint/manifest.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;

namespace {
void write_all_shards(const CheckpointReader& src, const Manifest& m,
                      const std::vector<std::vector<ShardRange>>& plan, const fs::path& dir,
                      const CodecOptions& codec, std::vector<ShardDescriptor>& descs);
}  // namespace

std::vector<std::vector<ShardRange>> plan_reshard(const std::vector<TensorSpec>& layout,
                                                  int world_size) {
  DNALLM_CHECK(world_size >= 1, ExitCode::kUsage, "world size must be >= 1, got {}", world_size);
  std::vector<std::vector<ShardRange>> plan(world_size);
  const auto w = static_cast<uint64_t>(world_size);
  for (const auto& t : layout) {
    const uint64_t n = t.numel();
    for (uint64_t r = 0; r < w; ++r) {
      // n * r fits: n < 2^63 / 2^16 for any realistic tensor; use 128-bit to be exact.
      const auto b = static_cast<uint64_t>((static_cast<unsigned __int128>(n) * r) / w);
      const auto e = static_cast<uint64_t>((static_cast<unsigned __int128>(n) * (r + 1)) / w);
      if (e > b) plan[r].push_back({t.name, b, e});
    }
  }
  return plan;
}

fs::path reshard(const CheckpointReader& src, const fs::path& out_root, int world_size,
                 const CodecOptions& codec) {
  const Manifest& m = src.manifest();
  uint64_t largest = 0;
  for (const auto& t : m.tensors) largest = std::max(largest, t.numel());
  DNALLM_CHECK(world_size >= 1 && world_size <= kMaxReshardWorldSize &&
                   static_cast<uint64_t>(world_size) <= largest,
               ExitCode::kUsage,
               "reshard --world-size {}: must be between 1 and {} (the largest tensor of {} "
               "holds {} elements, and at most {} shards are supported); choose the job's "
               "world size",
               world_size, std::min<uint64_t>(largest, kMaxReshardWorldSize), src.dir().string(),
               largest, kMaxReshardWorldSize);
  const auto plan = plan_reshard(m.tensors, world_size);
  const fs::path dir = out_root / step_dir_name(m.step);
  std::error_code ec;
  DNALLM_CHECK(!fs::exists(dir, ec), ExitCode::kUsage,
               "reshard: {} already exists; choose another --out or remove it", dir.string());
  std::vector<ShardDescriptor> descs;
  try {
    write_all_shards(src, m, plan, dir, codec, descs);
    CommitInfo info{m.step, world_size, m.zero_stage, m.state};
    commit_step(out_root, info, std::move(descs));
  } catch (...) {
    fs::remove_all(dir, ec);  // never leave a partial step (or its *.tmp files) behind
    throw;
  }
  return dir;
}

namespace {
void write_all_shards(const CheckpointReader& src, const Manifest& m,
                      const std::vector<std::vector<ShardRange>>& plan, const fs::path& dir,
                      const CodecOptions& codec, std::vector<ShardDescriptor>& descs) {
  const int world_size = static_cast<int>(plan.size());
  for (int r = 0; r < world_size; ++r) {
    std::vector<std::vector<uint8_t>> buffers;
    std::vector<TensorSlice> slices;
    for (const auto& range : plan[r]) {
      const TensorSpec* spec = m.find(range.tensor);
      buffers.emplace_back((range.end - range.begin) * dtype_size(spec->dtype));
      src.read_range(range.tensor, range.begin, range.end, buffers.back().data());
      slices.push_back({*spec, range.begin, range.end, buffers.back().data()});
    }
    descs.push_back(write_shard(dir, r, slices, codec));
  }
}
}  // namespace

}  // namespace dnallm::checkpoint
