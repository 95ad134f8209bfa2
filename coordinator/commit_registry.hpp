// The checkpoint commit registry (checkpoint::CommitRegistry, checkpoint/commit.hpp) served
// over the frame protocol: ops 37-38, steps 1-2 and 4 of checkpoint/commit.hpp's commit
// protocol (docs/checkpoint-format.md, "Commit protocol").
//
// Who serves them: register_commit_ops() on a StoreServer. The ElasticService registers them
// on the coordinator's server (elastic jobs, dnallm-launch, dnallm-coordinator), and
// comm::connect_process_group on the store rank 0 hosts in static multi-rank runs. The ranks
// call them through CommitClient, a checkpoint::CommitChannel.
//
//   op 37 shard_durable: request root, generation, step, rank, world size, descriptor;
//         answer u8 complete, then every descriptor in rank order when complete.
//   op 38 committed: request root, step, on-disk steps, keep_last, keep_every, protected
//         step, LATEST's step; answer the steps to delete.
// Records are per checkpoint root (several jobs may share a coordinator).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/commit.hpp"
#include "coordinator/protocol.hpp"
#include "coordinator/store.hpp"
#include "coordinator/store_server.hpp"
#include "coordinator/tcp_store_client.hpp"

namespace dnallm::coordinator {

// Serves ops 37-38 on `server` with a registry of its own (kept alive by the handlers, used
// only on the server's io thread, so it needs no lock). Call before server.start(), once per
// server.
void register_commit_ops(StoreServer& server);

// The ranks' side of ops 37-38 over a TcpStoreClient connected to a server that
// register_commit_ops()'d. Thread-safe as the client is; each call blocks up to the client's
// op timeout. Throws Error(kPeerFailed) when the server does not serve the ops.
class CommitClient final : public checkpoint::CommitChannel {
 public:
  // `generation` is stamped on every shard report. The client must outlive this object.
  CommitClient(TcpStoreClient& store, int64_t generation)
      : store_(store), generation_(generation) {}
  // Keeps `store` alive itself.
  CommitClient(std::shared_ptr<TcpStoreClient> store, int64_t generation)
      : owner_(std::move(store)), store_(*owner_), generation_(generation) {}

  std::optional<std::vector<std::string>> shard_durable(
      const checkpoint::ShardReport& report) override;
  std::vector<int64_t> committed(const checkpoint::CommittedReport& report) override;
  std::string describe() const override;

 private:
  std::shared_ptr<TcpStoreClient> owner_;  // may be null
  TcpStoreClient& store_;
  int64_t generation_;
};

// The commit channel of a process group whose store is `store`: a CommitClient when it is a
// TcpStoreClient (rank 0's store server or the coordinator serves the ops), else null (an
// InMemoryStore or no store: only a single process can commit, in process; see
// train::CheckpointerOptions::commit).
std::shared_ptr<checkpoint::CommitChannel> commit_channel_for(const std::shared_ptr<Store>& store,
                                                              int64_t generation);

// Wire encoding of the two ops (requests start with the op byte).
FrameWriter encode_shard_durable(const checkpoint::ShardReport& r);
checkpoint::ShardReport decode_shard_durable(FrameReader& r);
FrameWriter encode_committed(const checkpoint::CommittedReport& r);
checkpoint::CommittedReport decode_committed(FrameReader& r);

}  // namespace dnallm::coordinator
