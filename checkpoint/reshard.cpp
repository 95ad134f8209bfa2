#include "checkpoint/reshard.hpp"

#include "checkpoint/manifest.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;

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
  const auto plan = plan_reshard(m.tensors, world_size);
  const fs::path dir = out_root / step_dir_name(m.step);
  std::vector<ShardDescriptor> descs;
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
  CommitInfo info{m.step, world_size, m.zero_stage, m.state};
  commit_step(out_root, info, std::move(descs));
  return dir;
}

}  // namespace dnallm::checkpoint
