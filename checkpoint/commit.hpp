// The one commit path of a checkpoint, for every run: static and elastic multi-rank jobs,
// a single process, the tests and the benchmark (docs/checkpoint-format.md, "Commit
// protocol"). Steps 1-5 of manifest.hpp's protocol say what a committed step is on disk;
// this header says how the shards' descriptors reach the committer and who decides
// retention.
//
// Commit protocol (one checkpoint of step S under root R, world size W):
//   1. every rank, once its shard of S is durable (write_shard: written, fsync'ed, renamed),
//      publishes it: CommitChannel::shard_durable(R, S, rank, W, descriptor JSON);
//   2. the committer (CommitRegistry) answers whether every rank 0..W-1 of S has reported;
//      when it has, the answer carries all descriptors in rank order. Reports are
//      idempotent: rank 0 repeats its own until the step is complete, its commit timeout
//      expires (Error(kPeerFailed): S stays uncommitted) or it is told to abort;
//   3. rank 0 writes the manifest and LATEST (commit_step);
//   4. rank 0 sends committed(R, S, the committed steps it finds on disk, keep_last,
//      keep_every, protected step, LATEST's step); the registry records S (and the steps on
//      disk) as committed, decides with steps_to_delete which to delete, forgets them and
//      answers the list;
//   5. rank 0 deletes exactly those (remove_checkpoint). No rank decides a deletion on its
//      own: the registry is the one place retention is decided.
// commit_shard() runs steps 1-5 for one rank; the channel decides where the registry is:
//   - LocalCommitChannel: an in-process registry (world size 1: single processes, tests,
//     the benchmark);
//   - coordinator::CommitClient: ops 37-38 over a TcpStoreClient to a StoreServer that serves
//     them (coordinator::register_commit_ops): rank 0's store in static multi-rank runs,
//     the elastic coordinator otherwise.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/codec.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/retention.hpp"
#include "checkpoint/types.hpp"

namespace dnallm::checkpoint {

constexpr int64_t kMaxCheckpointRanks = 1 << 20;

// Step 1: one rank's durable shard.
struct ShardReport {
  std::string root;
  int64_t generation = 0;  // the reporting worker's DNALLM_GENERATION (0 outside elastic)
  int64_t step = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  std::string descriptor;  // descriptor_to_json(...).dump()
};

// Step 4: rank 0 committed `step`.
struct CommittedReport {
  std::string root;
  int64_t step = 0;
  std::vector<int64_t> on_disk;  // committed steps found under root
  int64_t keep_last = 0;         // <= 0 keeps all
  int64_t keep_every = 0;        // <= 0 disables
  int64_t protected_step = -1;   // -1: none
  int64_t latest_step = -1;      // -1: none
};

// The committer's record of durable shards and committed checkpoints, per checkpoint root
// (several jobs may share a coordinator). Thread safety: none; its owner serialises calls.
class CommitRegistry {
 public:
  // Step 2. Throws Error(kUsage) on an out-of-range rank/world/step, a world size that
  // differs from earlier reports of the same step and generation, or a report from an older
  // generation than the step's records (a newer generation's report drops those records:
  // shards written before a restart never complete a step after it). Returns every
  // descriptor once complete.
  std::optional<std::vector<std::string>> shard_durable(const ShardReport& report);
  // Step 4. Returns the steps to delete.
  std::vector<int64_t> committed(const CommittedReport& report);

  // The committed steps known under `root` (for tests and logs).
  std::vector<int64_t> committed_steps(const std::string& root) const;

 private:
  struct PendingStep {
    int64_t generation = 0;
    int64_t world_size = 0;
    std::map<int64_t, std::string> descriptors;  // by rank
  };
  struct Root {
    std::map<int64_t, PendingStep> pending;  // by step
    std::set<int64_t> committed;
  };
  std::map<std::string, Root> roots_;
};

// Where a rank's reports go (steps 1-2 and 4). Implementations are thread-safe; each call
// may block (a network round trip) and throws Error on failure.
class CommitChannel {
 public:
  virtual ~CommitChannel() = default;
  // Steps 1-2: every descriptor in rank order once all ranks reported, else nullopt.
  virtual std::optional<std::vector<std::string>> shard_durable(const ShardReport& report) = 0;
  // Step 4: the steps rank 0 must delete.
  virtual std::vector<int64_t> committed(const CommittedReport& report) = 0;
  // Names the committer in logs and errors ("the in-process registry", "the coordinator").
  virtual std::string describe() const = 0;
};

// The registry in this process (world size 1).
class LocalCommitChannel final : public CommitChannel {
 public:
  std::optional<std::vector<std::string>> shard_durable(const ShardReport& report) override;
  std::vector<int64_t> committed(const CommittedReport& report) override;
  std::string describe() const override { return "the in-process registry"; }

 private:
  std::mutex mu_;
  CommitRegistry registry_;  // guarded by mu_
};

// What one rank commits.
struct ShardCommit {
  std::filesystem::path root;  // [checkpoint] dir
  int rank = 0;
  CommitInfo info;  // step, world size, zero stage, state (the manifest's; rank 0 writes it)
  RetentionPolicy retention;
  std::optional<int64_t> protected_step;  // the step resumed from: never deleted
  // Rank 0 waits this long for every rank's shard before failing the commit.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Set by the owner to stop waiting (rank 0 returns with committed = false). May be null.
  const std::atomic<bool>* abort = nullptr;
};

struct CommitOutcome {
  bool committed = false;        // rank 0: the step is committed; other ranks: always false
  uint64_t bytes = 0;            // rank 0: all shards' bytes
  std::vector<int64_t> deleted;  // rank 0: the steps retention deleted
};

// Steps 1-5 for this rank, `own` being its durable shard: every rank reports it; rank 0
// then polls (every 10 ms, the one wait loop) until the step is complete, commits it and
// deletes what the registry answers. Blocks up to `commit.timeout` on rank 0. Throws
// Error(kPeerFailed) when the step does not complete in time, commit_step's errors, and
// the channel's.
CommitOutcome commit_shard(CommitChannel& channel, const ShardDescriptor& own,
                           const ShardCommit& commit);

// Convenience for a single process: write_shard(rank 0) + commit_shard through a
// LocalCommitChannel (world size 1, no retention). Throws Error(kUsage) for another world.
ShardDescriptor save_single(const std::filesystem::path& root, const CommitInfo& info,
                            const std::vector<TensorSlice>& slices, const CodecOptions& codec);

}  // namespace dnallm::checkpoint
