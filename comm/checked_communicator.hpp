// CheckedCommunicator: a Communicator that verifies, before each collective, that every rank
// issues the same one (CommOptions::check_collectives, [parallel] check_collectives).
//
// Note [Collective check]
// The contract of comm/communicator.hpp is that every rank issues the same collectives in the
// same order with the same counts and dtypes. A program that breaks it (a rank that runs a
// module once more, a branch taken on one rank only, a ZeRO-3 unit gathered in another order)
// does not fail cleanly: the backends pair the n-th collectives of the ranks, so an
// allreduce meets an allgather, and the result is a hang until the timeout naming nobody
// useful, a transport error about sizes, or, worst, a silently wrong sum. PyTorch's answer
// is TORCH_DISTRIBUTED_DEBUG=DETAIL, which checks each collective's op and shapes with an
// extra all-gather. Ours, on for a debugging run:
//  - Each collective gets a fingerprint: its number n in this communicator's order, the op,
//    the reduce op or root, the dtype and the element count that every rank must agree on
//    (allreduce: N; reduce_scatter: the input's N; allgather: the output's N; broadcast: N
//    and root; all_to_all: only op and dtype, as block sizes legitimately differ; split:
//    the op). Point-to-point transfers are not collectives and are not checked.
//  - Before issuing collective n to the backend, the rank publishes its fingerprint at
//    "comm/<name>/check/<n>/<rank>" in the store and waits, up to the communicator's
//    timeout, for every rank's fingerprint of n. Equal: the collective is issued, and the
//    rank deletes its fingerprint of n - 1 (every peer has read it: each published n only
//    after passing the check of n - 1). Different: every rank fails with the same
//    Error(kUsage) listing the ranks and what each issued as collective n; the mismatched
//    collective never reaches the backend, so no buffer is touched. Missing after the
//    timeout: Error(kPeerFailed) naming the ranks that did not issue collective n, the op
//    this rank issued, and the last collective they did issue (n - 1, whose fingerprint
//    matched). A rank that died is reported the same way within the timeout, never a hang.
//  - Without a store (MPI started by mpirun with no MASTER_ADDR) the fingerprints go through
//    the wrapped communicator itself: an allgather of fixed-size fingerprints before each
//    collective (its timeout names the missing ranks, Note [Peer failure]).
// Cost: the issuing thread blocks until every rank has issued the same collective, plus one
// store round trip per rank (or one small allgather), so overlap of communication with
// computation is lost: a debugging mode, off by default.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.hpp"

namespace dnallm::comm {

// What ranks must agree on for one collective (Note [Collective check]).
struct CollectiveFingerprint {
  std::string op;      // "allreduce", "reduce_scatter", ...
  std::string detail;  // "sum", "root 0", "" ...
  DType dtype = DType::kFloat32;
  int64_t count = -1;            // -1: not compared (all_to_all, split, barrier)
  bool typed = true;             // false: no buffer (split, barrier): the dtype is not compared
  std::string describe() const;  // "allreduce sum fp32 x1024"
};

// The message every rank gives when collective `seq` differs across ranks: the ranks grouped
// by what they issued ("collective #7 differs across ranks: rank(s) 0, 2 issued allreduce sum
// fp32 x8; rank(s) 1 issued allgather fp32 x16"). `issued[r]` is rank r's description.
std::string describe_mismatch(const std::string& name, uint64_t seq,
                              const std::vector<std::string>& issued);

class CheckedCommunicator final : public Communicator {
 public:
  // `store` may be null (fingerprints then go through `inner`, Note [Collective check]).
  CheckedCommunicator(std::unique_ptr<Communicator> inner,
                      std::shared_ptr<coordinator::Store> store, std::string name,
                      std::chrono::milliseconds timeout);
  // Logs how many collectives were checked (info), when there were any.
  ~CheckedCommunicator() override;

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  const char* backend() const override { return inner_->backend(); }

  WorkPtr allreduce(BufferView in, BufferView out, ReduceOp op) override;
  WorkPtr reduce_scatter(BufferView in, BufferView out, ReduceOp op) override;
  WorkPtr allgather(BufferView in, BufferView out) override;
  WorkPtr broadcast(BufferView buf, int root) override;
  WorkPtr barrier() override;
  WorkPtr all_to_all(BufferView in, const std::vector<int64_t>& in_counts, BufferView out,
                     const std::vector<int64_t>& out_counts) override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  WorkPtr send(BufferView buf, int peer, int tag) override { return inner_->send(buf, peer, tag); }
  WorkPtr recv(BufferView buf, int peer, int tag) override { return inner_->recv(buf, peer, tag); }

  // Collectives checked so far.
  uint64_t checked() const;

 private:
  // Blocks until every rank issued `fp` as the next collective; throws as the Note says.
  // Called with mu_ held.
  void check(const CollectiveFingerprint& fp);
  void check_through_store(const std::string& mine);
  std::vector<std::string> exchange_through_inner(const std::string& mine);
  std::string key(uint64_t seq, int rank) const;

  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<coordinator::Store> store_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;  // one check at a time: the issue order is the checked order
  uint64_t seq_ = 0;
  std::string last_;  // this rank's fingerprint of collective seq_ (matched on every rank)
  uint64_t splits_ = 0;
};

}  // namespace dnallm::comm
