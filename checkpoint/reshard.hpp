// Rewriting a checkpoint for another world size.
//
// Note [Reshard rule]: every stored tensor (a ZeRO flat buffer is one stored tensor) is
// split independently into N contiguous ranges of its flat layout; rank r holds
// [floor(r * n / N), floor((r + 1) * n / N)). Ranks whose range is empty hold nothing of
// that tensor. A rank therefore holds the same fraction of every tensor.
#pragma once

#include <filesystem>
#include <vector>

#include "checkpoint/codec.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/types.hpp"

namespace dnallm::checkpoint {

// Pure: the ranges of rank 0..world_size-1 under Note [Reshard rule].
std::vector<std::vector<ShardRange>> plan_reshard(const std::vector<TensorSpec>& layout,
                                                  int world_size);

// The most shards a checkpoint may be resharded into (a rank per GPU of a very large job).
inline constexpr int kMaxReshardWorldSize = 65536;

// Writes `src` as a committed checkpoint of the same step and state under `out_root`
// with `world_size` shards (manifest zero_stage kept). Holds one output shard in memory
// at a time. Returns the new step directory. Throws Error(kUsage), before writing
// anything, when world_size is outside [1, kMaxReshardWorldSize] or larger than the
// largest stored tensor (every shard must hold something), or when out_root already holds
// this step; a failed write removes the partial step directory.
std::filesystem::path reshard(const CheckpointReader& src, const std::filesystem::path& out_root,
                              int world_size, const CodecOptions& codec);

}  // namespace dnallm::checkpoint
