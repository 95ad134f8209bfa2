// Reading a committed checkpoint: open, verify, read any element range of any tensor
// (from whichever shards hold it), choose the checkpoint to resume from, and check that
// it belongs to the model being trained.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/manifest.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/config.hpp"

namespace dnallm::checkpoint {

// A committed step directory opened for reading. Opening reads the manifest and every
// shard's header, footer and index, and checks shard sizes and file hashes recorded in
// the manifest against the footers (cheap). verify() hashes all data. Reads verify the
// chunks they touch. Const methods are safe to call from several threads.
class CheckpointReader {
 public:
  // `path`: a step directory, or a root (then the newest committed step under it; LATEST
  // is only a hint, see Note [LATEST is a hint] in reader.cpp). Throws Error(kCheckpointCorrupt)
  // naming the damaged file.
  static CheckpointReader open(const std::filesystem::path& path);

  const Manifest& manifest() const { return manifest_; }
  const std::filesystem::path& dir() const { return dir_; }
  int64_t step() const { return manifest_.step; }

  // Full verification: every shard's file hash and every chunk hash. Throws
  // Error(kCheckpointCorrupt) naming the shard and, for a chunk, tensor and chunk index.
  void verify() const;

  // Copies elements [begin, end) of `tensor` (global flat layout) into `out`, which holds
  // (end - begin) * dtype_size bytes. Reads only the overlapping chunks of the shards
  // that hold the range. Throws Error(kUsage) for an unknown tensor or a range outside
  // it, Error(kCheckpointCorrupt) when shards do not cover the range or are damaged.
  void read_range(const std::string& tensor, uint64_t begin, uint64_t end, void* out) const;

  // The whole tensor as bytes.
  std::vector<uint8_t> read_tensor(const std::string& tensor) const;

  const std::vector<ShardFile>& shards() const { return shards_; }

 private:
  CheckpointReader() = default;
  std::filesystem::path dir_;
  Manifest manifest_;
  std::vector<ShardFile> shards_;  // by rank
};

// Resolves `resume` (checkpoint.resume: auto, none or a path) under `root` and returns the
// checkpoint to resume from, fully verified:
//  - "none": nullopt.
//  - "auto": the newest committed checkpoint under `root` (step_* directories with a
//    manifest, newest first; a LATEST naming another step is reported, not followed). A damaged one
//    (checksum mismatch, truncation, missing shard) is skipped with a warning naming the bad file,
//    and the previous committed one is tried. nullopt when `root` holds no committed checkpoint;
//    Error(kCheckpointCorrupt) when some exist but none is usable.
//  - PATH: a root is treated as "auto" on it; a step directory is opened and verified
//    (Error(kCheckpointCorrupt) when damaged, no fallback).
std::optional<CheckpointReader> find_resume(const std::filesystem::path& root,
                                            const cfg::Resume& resume);

// What the caller expects of a checkpoint it resumes from. Empty fields are not checked.
struct Expectation {
  std::vector<TensorSpec> layout;           // every tensor must match name/dtype/shape
  std::optional<std::string> config_hash;   // state["config_hash"]
  std::optional<nlohmann::json> tokenizer;  // state["tokenizer"]
};

// Throws Error(kUsage) with one sentence naming the first difference (tensor, config
// hash or tokenizer), the checkpoint directory and what to do.
void check_compatible(const CheckpointReader& ckpt, const Expectation& expected);

}  // namespace dnallm::checkpoint
