// The manifest (manifest.json) of a step directory and the commit protocol.
//
// Commit protocol (one checkpoint of step S under root R):
//   1. Every rank writes R/step_S/shard_<rank>.dnc with write_shard(): temporary name,
//      fsync, rename, fsync of the directory. It returns a ShardDescriptor.
//   2. The descriptors reach the committer (checkpoint/commit.hpp: commit_shard() through a
//      CommitChannel; rank 0 receives them all).
//   3. commit_step() checks that there is one descriptor per rank and that each file
//      exists with the recorded size, then writes R/step_S/manifest.json (temporary,
//      fsync, rename, fsync dir). From this moment the step is committed.
//   4. commit_step() replaces R/LATEST (holding "step_S") by rename, fsyncs R.
//   5. commit_step() removes step directories older than S that have no manifest
//      (leftovers of crashed saves). Newer ones may be in flight and are left alone.
// A step directory without a manifest is never loaded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/codec.hpp"
#include "checkpoint/types.hpp"

namespace dnallm::checkpoint {

inline constexpr const char* kManifestName = "manifest.json";
inline constexpr const char* kLatestName = "LATEST";
inline constexpr int kManifestVersion = 1;

struct Manifest {
  int64_t step = 0;
  int world_size = 1;
  int zero_stage = 0;
  std::vector<TensorSpec> tensors;                  // the full layout, in first-seen order
  std::vector<ShardDescriptor> shards;              // indexed by rank
  nlohmann::json state = nlohmann::json::object();  // opaque, filled by the trainer

  const TensorSpec* find(const std::string& name) const;
  nlohmann::json to_json() const;
  // Throws Error(kCheckpointCorrupt) naming `where` when fields are missing or inconsistent.
  static Manifest from_json(const nlohmann::json& j, const std::string& where);
};

// "step_000001200"
std::string step_dir_name(int64_t step);
// Parses "step_<digits>"; nullopt for anything else.
std::optional<int64_t> parse_step_dir_name(const std::string& name);

struct CommitInfo {
  int64_t step = 0;
  int world_size = 1;
  int zero_stage = 0;
  nlohmann::json state = nlohmann::json::object();
};

// A descriptor as JSON (with its tensor specs), for sending it from a rank to the
// committer (e.g. through the coordinator's KV store), and back. from_json throws
// Error(kBadData) on a malformed descriptor.
nlohmann::json descriptor_to_json(const ShardDescriptor& d);
ShardDescriptor descriptor_from_json(const nlohmann::json& j);

// Steps 3-5 of the protocol above. `shards` holds one descriptor per rank (any order).
// Blocks on fsync. Throws Error(kUsage) on inconsistent descriptors (missing rank,
// conflicting tensor specs) and Error(kCheckpointCorrupt) when a shard file is missing or
// has another size than its descriptor says; nothing is committed then.
void commit_step(const std::filesystem::path& root, const CommitInfo& info,
                 std::vector<ShardDescriptor> shards);

// Reads and validates <step_dir>/manifest.json. Throws Error(kCheckpointCorrupt).
Manifest read_manifest(const std::filesystem::path& step_dir);

// Committed step directories under root (those with a manifest.json), oldest first.
std::vector<std::pair<int64_t, std::filesystem::path>> list_committed(
    const std::filesystem::path& root);

// The step directory LATEST names, if LATEST exists and names a committed directory.
std::optional<std::filesystem::path> latest_step_dir(const std::filesystem::path& root);

// True when `path` is a step directory (has a manifest or a step_* name) rather than a root.
bool is_step_dir(const std::filesystem::path& path);

}  // namespace dnallm::checkpoint
