// Communicator: collectives on typed buffers (BufferView) for DDP and ZeRO.
//
// Contracts (every backend):
//  - Collectives MUST be called in the same order, with the same counts and dtypes, on
//    every rank of the communicator. Each call returns at once with a Work handle; the
//    operation runs asynchronously, in issue order (gloo/mpi: on the communicator's worker
//    thread; nccl: on its CUDA stream).
//  - The caller keeps every buffer alive and untouched until the Work completes.
//  - Any thread may issue collectives, but the issue order is what counts: serialise
//    issuing yourself if several threads do it.
//  - Timeouts: every collective fails after CommOptions::timeout with
//    Error(ExitCode::kPeerFailed); Work::wait() without an argument waits that long plus
//    the diagnosis grace (kDiagnosisGrace). See Note [Peer failure] for how the missing
//    rank(s) are named. After a failure the communicator is broken: every later
//    collective fails at once with the first error. Build a new one (new name) to go on.
//
// Buffer shapes (`W` = world size, `N` = element count):
//  - allreduce(in, out, op): in and out hold N elements of one dtype; in == out is in place.
//  - reduce_scatter(in, out, op): in holds N elements; out holds this rank's shard,
//    shard_range(N, W, rank).count elements. Shards are balanced: the first N % W ranks get
//    one element more. out may alias its own shard inside in (in place).
//  - allgather(in, out): out holds N elements; in holds this rank's shard of them (may
//    alias its place inside out: in place).
//  - broadcast(buf, root): buf holds N elements on every rank; root's are sent.
//  - all_to_all(in, in_counts, out, out_counts): in holds W contiguous blocks in rank
//    order, in_counts[p] elements for peer p; out receives W blocks, out_counts[p] from
//    peer p. Counts are elements (any may be 0), sum(in_counts) == in.count,
//    sum(out_counts) == out.count, in_counts[rank] == out_counts[rank] (the block kept),
//    and out_counts[p] on this rank == in_counts[rank] on rank p. in and out must not
//    overlap. Layout and checks: all_to_all_layout() below.
//  - ReduceOp::kAvg divides the sum by W (integer division for integer dtypes).
//
// Sub-groups: split(color, key) is a collective over this communicator (same order as the
// other collectives): the ranks that pass the same color >= 0 form a new communicator,
// ranked by key, then by rank here (MPI_Comm_split's rule, split_members() below); a
// negative color joins no group and gets null. The new communicator is independent of
// this one (its own worker thread or stream, its own issue order and failure state) and
// may outlive it; its name is "<name>.split<n>.c<color>" (n counts this communicator's
// splits from 1), under which it keeps its own store keys (Note [Peer failure]).
//
// Point-to-point: send(buf, peer, tag) / recv(buf, peer, tag) move buf.count elements to /
// from another rank of this communicator; the recv's count and dtype must equal the
// send's. They are not collectives: only the two ranks take part, and they do not take a
// place in the collective order on other ranks. Messages between two ranks match by tag
// (>= 0), and in issue order among the same tag (MPI's non-overtaking rule). Each returns
// at once; the transfer is posted in issue order after the collectives issued before it,
// without waiting for the peer, so a ring exchange (send right, recv left on every rank)
// cannot deadlock (gloo, mpi). Their Works complete in issue order among point-to-point
// operations. A transfer not matched within the timeout fails and breaks the communicator
// like a collective; Work::wait(timeout) names the peer (alive or dead).
// nccl: NCCL has no tags (tag is checked, then ignored: messages between two ranks match
// in issue order), and a send on the communicator's stream waits for the peer's recv:
// order them so that they pair up (e.g. even ranks send first), or use all_to_all.
//
// Note [Peer failure]
// Each communicator publishes "comm/<name>/alive/<rank>" with Store::set_owned at
// construction: the coordinator deletes it when that process's store connection closes,
// i.e. when the process dies. When a collective fails (the backend reports an I/O error
// or its timeout expires) the rank records "comm/<name>/failed/<rank>" = collective
// number and polls the alive keys for up to kDiagnosisWindow: ranks whose key vanished
// are reported as dead ("rank(s) 2 died"), except those that recorded a failure of their own
// before exiting: they followed the first loss ("; rank(s) 0 failed after it and exited"), so
// the culprit named is the rank lost first. If none vanished, ranks that neither reported
// the same failure nor died are reported as not having arrived. The error therefore
// comes at most timeout + kDiagnosisWindow after the collective started (sooner when the
// transport notices the dead peer, as TCP does on a killed process).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace dnallm::coordinator {
class Store;
}

namespace dnallm::comm {

enum class ReduceOp : uint8_t { kSum = 0, kAvg = 1, kMax = 2 };
const char* reduce_op_name(ReduceOp op);
// "sum" | "avg" | "max"; throws Error(kUsage).
ReduceOp parse_reduce_op(const std::string& name);

constexpr std::chrono::milliseconds kDiagnosisWindow{500};
constexpr std::chrono::milliseconds kDiagnosisGrace{1000};

// The slice of an N-element buffer that `rank` owns in reduce_scatter / allgather.
struct ShardRange {
  size_t offset = 0;
  size_t count = 0;
};
ShardRange shard_range(size_t count, int world_size, int rank);

// Where each peer's block starts in all_to_all's buffers (elements), after the argument
// checks every backend makes before queueing: W counts each side, none negative, their
// sums equal to the buffers' counts, and the block this rank keeps the same size on both
// sides. Throws Error(kFailure) naming `backend`, the rank and the bad count.
struct AllToAllLayout {
  std::vector<size_t> in_offsets;   // W + 1 entries: block p is [in_offsets[p], [p + 1])
  std::vector<size_t> out_offsets;  // W + 1 entries
};
AllToAllLayout all_to_all_layout(const char* backend, int world_size, int rank, size_t in_count,
                                 const std::vector<int64_t>& in_counts, size_t out_count,
                                 const std::vector<int64_t>& out_counts);

// The members of the sub-group that `rank` joins when rank r passed (colors[r], keys[r])
// to split(): the ranks with its color, ordered by key, then by rank; the new rank is the
// index of `rank` in it. Empty when colors[rank] < 0.
std::vector<int> split_members(const std::vector<int>& colors, const std::vector<int>& keys,
                               int rank);
// The name of the n-th (from 1) sub-communicator of `parent` with `color`.
std::string split_name(const std::string& parent, uint64_t n, int color);

// Note [Stream-ordered wait]
// wait() blocks the host until a collective is done. On a GPU that stalls the thread that
// queues kernels: ZeRO-3's all-gather of block i, waited for before block i runs, keeps the
// host from queueing block i's kernels until the wire is done, so the device idles between
// blocks. c10d's ProcessGroupNCCL (and FSDP) instead make the compute stream wait on the
// collective's end event and return at once; Work::wait_stream() is that, and
//  - what holds afterwards: kernels queued on the legacy default stream (LibTorch's default,
//    Note [Producer stream] in comm/nccl/nccl_communicator.cpp) after wait_stream() run after
//    the collective, so they may read its output and overwrite its input. The host may not:
//    it reads results only after wait() (or after a device-to-host copy that synchronises).
//  - buffers: "kept alive and untouched until the Work completes" (the contract above) is
//    met for device buffers of LibTorch's caching allocator if they are freed after
//    wait_stream(): the allocator is stream-ordered (a block freed on the default stream is
//    handed out again only to allocations on that stream, whose kernels run after the wait),
//    and a later collective that gets the block waits for everything queued on the default
//    stream before it starts (Note [Producer stream]). Memory of any other allocator, or work
//    on another stream, needs wait().
//  - failures: wait_stream() throws at once if the communicator already failed. A collective
//    nobody host-waits for is still watched: the nccl watchdog times out every enqueued
//    collective (it keeps them all, not the waited ones) and polls NCCL's asynchronous
//    errors, then aborts the communicator (ncclCommAbort "aborts any uncompleted
//    operations": the collective's kernel ends, its end event completes, and the device
//    stream waiting on it goes on) and fails every later collective and wait() with the
//    watchdog's error. Kernels queued after the wait then read whatever
//    the aborted collective left: the step that saw the failure is lost, never committed (the
//    next collective of the step, at the latest the loss and norm sums, throws first).
//  - wrappers: CheckedCommunicator and the staging communicator (worker/parallel/
//    device_group.hpp) hand out the inner backend's Work itself where they do not stage, so
//    wait_stream() reaches it; a staged collective's Work waits on the host, since its result
//    comes back through a host copy done by the staging thread.

// A handle on one asynchronous collective. Thread-safe.
class Work {
 public:
  virtual ~Work() = default;
  // Non-blocking: true once the collective finished (successfully or not).
  virtual bool is_completed() = 0;
  // Blocks up to `timeout` for completion. Throws the collective's Error on failure, or
  // Error(kPeerFailed) naming the ranks that did not arrive when `timeout` expires first.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // wait(communicator timeout + kDiagnosisGrace).
  virtual void wait() = 0;
  // Stream-ordered wait (Note [Stream-ordered wait]): work the caller queues on its device
  // stream from now on runs after this collective; the host returns at once. nccl: the
  // legacy default stream (LibTorch's) waits for the collective's end event; every other
  // Work (host backends, staged collectives) waits on the host, as wait() does. Throws the
  // communicator's first error when it already failed; a failure or timeout that comes later
  // surfaces at the next collective or host wait.
  virtual void wait_stream() { wait(); }
};
using WorkPtr = std::shared_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const char* backend() const = 0;  // "gloo" | "mpi" | "nccl"

  virtual WorkPtr allreduce(BufferView in, BufferView out, ReduceOp op) = 0;
  WorkPtr allreduce(BufferView buf, ReduceOp op) { return allreduce(buf, buf, op); }
  virtual WorkPtr reduce_scatter(BufferView in, BufferView out, ReduceOp op) = 0;
  virtual WorkPtr allgather(BufferView in, BufferView out) = 0;
  virtual WorkPtr broadcast(BufferView buf, int root) = 0;
  virtual WorkPtr barrier() = 0;

  // The operations below are implemented by every backend (gloo, mpi, nccl); the base
  // versions throw Error(kUsage) naming the operation, for wrappers that do not forward
  // them.
  virtual WorkPtr all_to_all(BufferView in, const std::vector<int64_t>& in_counts, BufferView out,
                             const std::vector<int64_t>& out_counts);
  // Collective over this communicator: blocks until the new group is connected (up to
  // the timeout), in issue order after the collectives issued before it. Null for a
  // negative color. Throws Error(kPeerFailed) like a failed collective.
  virtual std::unique_ptr<Communicator> split(int color, int key);
  virtual WorkPtr send(BufferView buf, int peer, int tag);
  virtual WorkPtr recv(BufferView buf, int peer, int tag);
};

struct CommOptions {
  // "auto": nccl when `device` is CUDA, not shared with another rank, and NCCL was built;
  // else mpi when started by mpirun (OMPI_COMM_WORLD_SIZE set and MPI was built), else
  // gloo. gloo and mpi reduce host memory: a CUDA model's buckets are staged through it by
  // the worker (Note [Staged collectives] in worker/parallel/device_group.hpp).
  std::string backend = "auto";
  int rank = 0;        // ignored by mpi (MPI decides; must match if the store is shared)
  int world_size = 1;  // ignored by mpi
  // Bootstrap and failure diagnosis; required for gloo and nccl, optional for mpi.
  std::shared_ptr<coordinator::Store> store;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // per collective
  // Namespaces this communicator's store keys; the same on every rank, unique per
  // communicator (a new one after a failure needs a new name).
  std::string name = "default";
  // gloo: the address peers use to reach this rank ("" = this host's name, or 127.0.0.1
  // when `loopback` is set).
  std::string gloo_host;
  bool loopback = false;
  Device device{};  // the device this rank trains on; nccl: the GPU it drives
  // Another rank of this node drives the same GPU (parallel.share_gpus, Note [One GPU per
  // rank] in cluster/gpu_placement.hpp): NCCL cannot, so "auto" picks a CPU backend and an
  // explicit "nccl" is a usage error.
  bool device_shared = false;
  // Note [Collective check] (comm/checked_communicator.hpp): before each collective, verify
  // that every rank issues the same one (op, dtype, count), naming the ranks and ops that
  // differ instead of hanging or reducing the wrong buffers. Slow: for debugging a hang.
  bool check_collectives = false;
};

}  // namespace dnallm::comm
