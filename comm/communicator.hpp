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
//  - ReduceOp::kAvg divides the sum by W (integer division for integer dtypes).
//
// Note [Peer failure]
// Each communicator publishes "comm/<name>/alive/<rank>" with Store::set_owned at
// construction: the coordinator deletes it when that process's store connection closes,
// i.e. when the process dies. When a collective fails (the backend reports an I/O error
// or its timeout expires) the rank records "comm/<name>/failed/<rank>" = collective
// number and polls the alive keys for up to kDiagnosisWindow: ranks whose key vanished
// are reported as dead ("rank(s) 2 died"); if none vanished, ranks that neither reported
// the same failure nor died are reported as not having arrived. The error therefore
// comes at most timeout + kDiagnosisWindow after the collective started (sooner when the
// transport notices the dead peer, as TCP does on a killed process).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

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
};

// Builds and connects the communicator (collective over all ranks: blocks until every
// rank has joined, up to `timeout`). Throws Error(kUsage) for an unknown or unbuilt
// backend, Error(kPeerFailed) when peers do not join in time.
std::unique_ptr<Communicator> make_communicator(const CommOptions& options);

// Which backend "auto" resolves to here (for logs and the bench).
std::string resolve_backend(const CommOptions& options);
// Whether a backend can be made here: gloo and mpi when compiled in; nccl when the CUDA
// plugin provides it, which asking loads (Note [Lazy CUDA] in core/cuda_plugin.hpp).
bool backend_available(const std::string& name);

// Backends that plugins provide (nccl, from libdnallm_cuda.so): the plugin registers its
// factory when it is loaded. make_communicator checks the options first.
using BackendFactory = std::unique_ptr<Communicator> (*)(const CommOptions& options);
void register_backend(const std::string& name, BackendFactory factory);

}  // namespace dnallm::comm
