// A communicator whose backend can be replaced in place: what the engines built over the
// world communicator (DDP, the checkpointer, the evaluation sums) hold a reference to, so that
// a rank that survives a peer's death goes on with the same objects over a communicator
// re-formed under a new name (Note [In-process recovery] in worker/train/in_process_recovery.hpp).
//
// Every operation forwards to the current backend. replace() swaps it: call it from the thread
// that issues collectives, with none in flight (the old backend is destroyed there, which joins
// its worker thread and fails what it still held). The rank and world size may not change.
// Sub-communicators (split) belong to the backend they were split from: a re-formed world
// needs its splits made again.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.hpp"

namespace dnallm::comm {

class ReformableCommunicator final : public Communicator {
 public:
  // `name`: the backend's name (CommOptions::name), under which it keeps its store keys.
  ReformableCommunicator(std::unique_ptr<Communicator> backend, std::string name);

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return kind_; }

  WorkPtr allreduce(BufferView in, BufferView out, ReduceOp op) override {
    return live().allreduce(in, out, op);
  }
  WorkPtr reduce_scatter(BufferView in, BufferView out, ReduceOp op) override {
    return live().reduce_scatter(in, out, op);
  }
  WorkPtr allgather(BufferView in, BufferView out) override { return live().allgather(in, out); }
  WorkPtr broadcast(BufferView buf, int root) override { return live().broadcast(buf, root); }
  WorkPtr barrier() override { return live().barrier(); }
  WorkPtr all_to_all(BufferView in, const std::vector<int64_t>& in_counts, BufferView out,
                     const std::vector<int64_t>& out_counts) override {
    return live().all_to_all(in, in_counts, out, out_counts);
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return live().split(color, key);
  }
  WorkPtr send(BufferView buf, int peer, int tag) override { return live().send(buf, peer, tag); }
  WorkPtr recv(BufferView buf, int peer, int tag) override { return live().recv(buf, peer, tag); }

  // The current backend's name.
  const std::string& name() const { return name_; }
  // Whether the current backend recorded a failed collective in `store` (the group's; Note
  // [Peer failure]): a peer died or did not arrive, as opposed to an error of this rank's own.
  bool backend_failed(coordinator::Store& store) const;
  // Destroys the current backend and forwards to `backend` (named `name`) from now on. Throws
  // Error(kFailure) when its rank or world size differs from the old one's.
  void replace(std::unique_ptr<Communicator> backend, std::string name);
  // Note [Shrink and grow] (worker/train/in_process_recovery.hpp): replace() by a backend of
  // another rank or world size (the group shrank or grew); the engines over this communicator
  // read both from it.
  void resize(std::unique_ptr<Communicator> backend, std::string name);
  // Destroys the current backend now (its connections close, so that a peer still blocked in a
  // collective with this rank fails at once instead of at its timeout); until replace(), every
  // operation but rank(), world_size() and backend() throws Error(kPeerFailed).
  void abort();

 private:
  Communicator& live() const;

  std::unique_ptr<Communicator> backend_;
  std::string name_;
  int rank_ = 0, world_ = 1;
  const char* kind_ = "";
};

}  // namespace dnallm::comm
