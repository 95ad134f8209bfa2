// CommitRegistry: the coordinator's record of durable checkpoint shards and committed
// checkpoints, and the only place that decides which checkpoints retention deletes.
//
// Protocol (ops 37-38 on the frame protocol; the ElasticService serves them, the workers call
// them through CommitClient; docs/checkpoint-format.md, "Commit protocol"):
//   1. every rank, once its shard of step S is durable (written, fsync'ed, renamed), sends
//      shard_durable(root, S, rank, world_size, descriptor JSON);
//   2. the answer says whether every rank 0..world_size-1 of S has reported; when it has,
//      it carries all descriptors in rank order. Reports are idempotent: rank 0 repeats its
//      own until the step is complete (or its commit timeout expires);
//   3. rank 0 writes the manifest and LATEST (checkpoint::commit_step), then sends
//      committed(root, S, the committed steps it finds on disk, keep_last, keep_every,
//      protected step, LATEST's step);
//   4. the registry records S (and the steps on disk) as committed, decides with
//      checkpoint::steps_to_delete which to delete, forgets them, and answers the list;
//      rank 0 deletes exactly those (checkpoint::remove_checkpoint). No rank decides a
//      deletion on its own.
// Records are per checkpoint root (several jobs may share a coordinator). Thread safety:
// none; the service calls it under its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "coordinator/protocol.hpp"
#include "coordinator/tcp_store_client.hpp"

namespace dnallm::coordinator {

constexpr int64_t kMaxCheckpointRanks = 1 << 20;

struct ShardReport {
  std::string root;
  int64_t generation = 0;  // the reporting worker's DNALLM_GENERATION (0 outside elastic)
  int64_t step = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  std::string descriptor;  // checkpoint::descriptor_to_json(...).dump()
};

struct CommittedReport {
  std::string root;
  int64_t step = 0;
  std::vector<int64_t> on_disk;  // committed steps found under root
  int64_t keep_last = 0;         // <= 0 keeps all
  int64_t keep_every = 0;        // <= 0 disables
  int64_t protected_step = -1;   // -1: none
  int64_t latest_step = -1;      // -1: none
};

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

// The ranks' side of steps 1-4 over a TcpStoreClient connected to a coordinator that runs
// the ElasticService. Thread-safe as the client is; each call blocks up to the client's
// op timeout. Throws Error(kPeerFailed) when the coordinator does not serve the ops.
class CommitClient {
 public:
  // `generation` is stamped on every shard report.
  CommitClient(TcpStoreClient& store, int64_t generation)
      : store_(store), generation_(generation) {}
  // Steps 1-2: every descriptor in rank order once all ranks reported, else nullopt.
  std::optional<std::vector<std::string>> shard_durable(ShardReport report);
  // Steps 3-4: the steps this rank must delete.
  std::vector<int64_t> committed(const CommittedReport& report);

 private:
  TcpStoreClient& store_;
  int64_t generation_;
};

// Wire encoding of the two ops (requests start with the op byte).
FrameWriter encode_shard_durable(const ShardReport& r);
ShardReport decode_shard_durable(FrameReader& r);
FrameWriter encode_committed(const CommittedReport& r);
CommittedReport decode_committed(FrameReader& r);

}  // namespace dnallm::coordinator
