#include "comm/nccl/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

#include "comm/detail/queued_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

#define DNALLM_CUDA_CHECK(call)                                                              \
  do {                                                                                       \
    cudaError_t dnallm_cuda_rc_ = (call);                                                    \
    if (dnallm_cuda_rc_ != cudaSuccess)                                                      \
      throw ::dnallm::Error(                                                                 \
          ::dnallm::ExitCode::kFailure,                                                      \
          ::fmt::format("{} failed: {} [{}:{}]", #call, cudaGetErrorString(dnallm_cuda_rc_), \
                        __FILE__, __LINE__));                                                \
  } while (0)

#define DNALLM_NCCL_CHECK(call)                                                              \
  do {                                                                                       \
    ncclResult_t dnallm_nccl_rc_ = (call);                                                   \
    if (dnallm_nccl_rc_ != ncclSuccess)                                                      \
      throw ::dnallm::Error(                                                                 \
          ::dnallm::ExitCode::kPeerFailed,                                                   \
          ::fmt::format("{} failed: {} [{}:{}]", #call, ncclGetErrorString(dnallm_nccl_rc_), \
                        __FILE__, __LINE__));                                                \
  } while (0)

namespace dnallm::comm {

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt64:
      return ncclInt64;
    case DType::kInt32:
      return ncclInt32;
    case DType::kUInt8:
      return ncclUint8;
    case DType::kInt8:
      return ncclInt8;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

// Note [Producer stream]
// Buffers handed to a collective were written by kernels on the caller's stream: LibTorch's
// default stream, i.e. the legacy default stream, which a cudaStreamNonBlocking stream does
// not wait for by itself. Each enqueue records an event there and makes the communicator's
// stream wait for it, so NCCL reads the gradients only after backward wrote them, while the
// host returns at once (the overlap of DDP is kept). Work on another torch stream must be
// ordered before the collective by its issuer.

// State shared by the communicator, its Works and its watchdog.
struct NcclShared {
  std::mutex mutex;
  std::string abort_error;  // guarded by mutex; non-empty once aborted
  std::atomic<bool> aborted{false};
  std::shared_ptr<detail::PeerMonitor> monitor;
  std::chrono::milliseconds timeout{0};
  int rank = 0;
  int device = 0;
};

// One enqueued collective. Shared by its Work and the watchdog; the event dies with it.
struct InFlight {
  InFlight() = default;
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  ~InFlight() {
    if (event) cudaEventDestroy(event);
  }
  cudaEvent_t event = nullptr;
  Clock::time_point started;
  uint64_t seq = 0;
  std::string what;
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclShared> shared, std::shared_ptr<InFlight> op)
      : shared_(std::move(shared)), op_(std::move(op)) {}

  bool is_completed() override {
    if (shared_->aborted) return true;
    return cudaEventQuery(op_->event) != cudaErrorNotReady;
  }
  void wait() override { wait(shared_->timeout + kDiagnosisGrace); }
  void wait(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      if (shared_->aborted) {
        std::lock_guard<std::mutex> lock(shared_->mutex);
        throw Error(ExitCode::kPeerFailed, shared_->abort_error);
      }
      cudaError_t rc = cudaEventQuery(op_->event);
      if (rc == cudaSuccess) return;
      if (rc != cudaErrorNotReady)
        fail(ExitCode::kFailure, "{} #{}: CUDA error {}", op_->what, op_->seq,
             cudaGetErrorString(rc));
      if (Clock::now() >= deadline)
        fail(ExitCode::kPeerFailed, "{} #{} did not complete within {} ms on rank {}@{}: {}",
             op_->what, op_->seq, timeout.count(), shared_->rank, host_name(),
             shared_->monitor->diagnose(op_->seq));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  // Note [Stream-ordered wait] (comm/communicator.hpp): the legacy default stream waits for
  // the end event; the watchdog still watches the collective (it holds every enqueued one).
  void wait_stream() override {
    if (shared_->aborted) {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      throw Error(ExitCode::kPeerFailed, shared_->abort_error);
    }
    cudaError_t rc = cudaEventQuery(op_->event);
    if (rc == cudaSuccess) return;  // done: nothing to order
    if (rc != cudaErrorNotReady)
      fail(ExitCode::kFailure, "{} #{}: CUDA error {}", op_->what, op_->seq,
           cudaGetErrorString(rc));
    // The event's current record is what the stream waits for: the event may be destroyed
    // before it completes (CUDA releases it once the device is done with it).
    DNALLM_CUDA_CHECK(cudaSetDevice(shared_->device));
    DNALLM_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamLegacy, op_->event, 0));
  }

 private:
  std::shared_ptr<NcclShared> shared_;
  std::shared_ptr<InFlight> op_;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(const CommOptions& o) : NcclCommunicator(o, bootstrap(o)) {}

  // Wraps `comm` (owned from here on), of which this process is rank o.rank of o.world_size
  // on o.device: make_communicator's (bootstrap()) or a sub-group's (split()).
  NcclCommunicator(const CommOptions& o, ncclComm_t comm)
      : options_(o), rank_(o.rank), world_(o.world_size), comm_(comm) {
    device_ = o.device.index;
    shared_ = std::make_shared<NcclShared>();
    shared_->monitor = std::make_shared<detail::PeerMonitor>(o.store, o.name, o.rank, o.world_size);
    shared_->timeout = o.timeout;
    shared_->rank = o.rank;
    shared_->device = o.device.index;
    DNALLM_CUDA_CHECK(cudaSetDevice(device_));
    DNALLM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    DNALLM_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
    DNALLM_CUDA_CHECK(cudaEventCreateWithFlags(&produced_, cudaEventDisableTiming));
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  // Rank 0 publishes the ncclUniqueId in the store; every rank joins with ncclCommInitRank.
  static ncclComm_t bootstrap(const CommOptions& o) {
    DNALLM_CHECK(o.store != nullptr, ExitCode::kUsage,
                 "the nccl backend needs a coordinator store");
    DNALLM_CHECK(o.device.is_cuda(), ExitCode::kUsage, "the nccl backend needs a CUDA device");
    DNALLM_CUDA_CHECK(cudaSetDevice(o.device.index));
    ncclUniqueId id;
    const std::string key = "comm/" + o.name + "/nccl/id";
    if (o.rank == 0) {
      DNALLM_NCCL_CHECK(ncclGetUniqueId(&id));
      auto p = reinterpret_cast<const uint8_t*>(&id);
      o.store->set(key, coordinator::Bytes(p, p + sizeof(id)));
    } else {
      auto bytes = o.store->get(key, o.timeout);
      DNALLM_CHECK(bytes.size() == sizeof(id), ExitCode::kPeerFailed,
                   "nccl: unique id at '{}' has {} bytes, expected {}", key, bytes.size(),
                   sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    ncclComm_t comm = nullptr;
    DNALLM_NCCL_CHECK(ncclCommInitRank(&comm, o.world_size, id, o.rank));
    return comm;
  }

  ~NcclCommunicator() override {
    // Let what was issued finish; the watchdog still aborts anything past its timeout.
    const auto deadline = Clock::now() + shared_->timeout + kDiagnosisGrace;
    while (!shared_->aborted && stream_ && cudaStreamQuery(stream_) == cudaErrorNotReady &&
           Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      stopping_ = true;
    }
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    // Never throw from here. The watchdog already aborted (and freed) an aborted comm.
    const bool stuck = stream_ && cudaStreamQuery(stream_) == cudaErrorNotReady;
    if (comm_ && !shared_->aborted) {
      if (stuck)
        ncclCommAbort(comm_);
      else
        ncclCommDestroy(comm_);
    }
    in_flight_.clear();
    if (produced_) cudaEventDestroy(produced_);
    if (barrier_buf_) cudaFree(barrier_buf_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return "nccl"; }

  WorkPtr allreduce(BufferView in, BufferView out, ReduceOp op) override {
    check(in, "allreduce");
    check(out, "allreduce");
    DNALLM_CHECK(in.count == out.count && in.dtype == out.dtype, ExitCode::kFailure,
                 "allreduce: input and output differ");
    return enqueue("allreduce", [&] {
      DNALLM_NCCL_CHECK(ncclAllReduce(in.data, out.data, in.count, nccl_type(in.dtype), nccl_op(op),
                                      comm_, stream_));
    });
  }
  using Communicator::allreduce;

  WorkPtr reduce_scatter(BufferView in, BufferView out, ReduceOp op) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    DNALLM_CHECK(out.count == shard_range(in.count, world_, rank_).count && in.dtype == out.dtype,
                 ExitCode::kFailure, "reduce_scatter: output is not this rank's shard");
    return enqueue("reduce_scatter", [&] {
      const size_t esize = dtype_size(in.dtype);
      if (in.count % static_cast<size_t>(world_) == 0) {
        DNALLM_NCCL_CHECK(ncclReduceScatter(in.data, out.data, out.count, nccl_type(in.dtype),
                                            nccl_op(op), comm_, stream_));
        return;
      }
      DNALLM_NCCL_CHECK(ncclGroupStart());
      for (int r = 0; r < world_; ++r) {
        auto s = shard_range(in.count, world_, r);
        const void* send = static_cast<const uint8_t*>(in.data) + s.offset * esize;
        DNALLM_NCCL_CHECK(ncclReduce(send, r == rank_ ? out.data : nullptr, s.count,
                                     nccl_type(in.dtype), nccl_op(op), r, comm_, stream_));
      }
      DNALLM_NCCL_CHECK(ncclGroupEnd());
    });
  }

  WorkPtr allgather(BufferView in, BufferView out) override {
    check(in, "allgather");
    check(out, "allgather");
    DNALLM_CHECK(in.count == shard_range(out.count, world_, rank_).count && in.dtype == out.dtype,
                 ExitCode::kFailure, "allgather: input is not this rank's shard");
    return enqueue("allgather", [&] {
      const size_t esize = dtype_size(out.dtype);
      if (out.count % static_cast<size_t>(world_) == 0) {
        DNALLM_NCCL_CHECK(
            ncclAllGather(in.data, out.data, in.count, nccl_type(in.dtype), comm_, stream_));
        return;
      }
      DNALLM_NCCL_CHECK(ncclGroupStart());
      for (int r = 0; r < world_; ++r) {
        auto s = shard_range(out.count, world_, r);
        void* dst = static_cast<uint8_t*>(out.data) + s.offset * esize;
        DNALLM_NCCL_CHECK(ncclBroadcast(r == rank_ ? in.data : dst, dst, s.count,
                                        nccl_type(out.dtype), r, comm_, stream_));
      }
      DNALLM_NCCL_CHECK(ncclGroupEnd());
    });
  }

  WorkPtr broadcast(BufferView buf, int root) override {
    check(buf, "broadcast");
    return enqueue("broadcast", [&] {
      DNALLM_NCCL_CHECK(
          ncclBroadcast(buf.data, buf.data, buf.count, nccl_type(buf.dtype), root, comm_, stream_));
    });
  }

  WorkPtr barrier() override {
    return enqueue("barrier", [&] {
      DNALLM_NCCL_CHECK(
          ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, stream_));
    });
  }

  // One NCCL group of a send and a recv per peer with a non-empty block (NCCL's own
  // all-to-all recipe); the block kept here is a device copy on the same stream.
  WorkPtr all_to_all(BufferView in, const std::vector<int64_t>& in_counts, BufferView out,
                     const std::vector<int64_t>& out_counts) override {
    check(in, "all_to_all");
    check(out, "all_to_all");
    DNALLM_CHECK(in.dtype == out.dtype, ExitCode::kFailure,
                 "nccl all_to_all on rank {}: input is {}, output {}", rank_, dtype_name(in.dtype),
                 dtype_name(out.dtype));
    const AllToAllLayout layout =
        all_to_all_layout("nccl", world_, rank_, in.count, in_counts, out.count, out_counts);
    const auto* ib = static_cast<const uint8_t*>(in.data);
    const auto* ob = static_cast<const uint8_t*>(out.data);
    DNALLM_CHECK(
        in.bytes() == 0 || out.bytes() == 0 || ib + in.bytes() <= ob || ob + out.bytes() <= ib,
        ExitCode::kFailure,
        "nccl all_to_all on rank {}: input and output overlap (no in-place all_to_all)", rank_);
    return enqueue("all_to_all", [&] {
      const size_t es = dtype_size(in.dtype);
      const auto me = static_cast<size_t>(rank_);
      const size_t kept = layout.in_offsets[me + 1] - layout.in_offsets[me];
      if (kept > 0)
        DNALLM_CUDA_CHECK(cudaMemcpyAsync(
            static_cast<uint8_t*>(out.data) + layout.out_offsets[me] * es,
            ib + layout.in_offsets[me] * es, kept * es, cudaMemcpyDeviceToDevice, stream_));
      DNALLM_NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < world_; ++p) {
        if (p == rank_) continue;
        const auto u = static_cast<size_t>(p);
        const size_t n_in = layout.in_offsets[u + 1] - layout.in_offsets[u];
        const size_t n_out = layout.out_offsets[u + 1] - layout.out_offsets[u];
        if (n_in > 0)
          DNALLM_NCCL_CHECK(ncclSend(ib + layout.in_offsets[u] * es, n_in, nccl_type(in.dtype), p,
                                     comm_, stream_));
        if (n_out > 0)
          DNALLM_NCCL_CHECK(ncclRecv(static_cast<uint8_t*>(out.data) + layout.out_offsets[u] * es,
                                     n_out, nccl_type(out.dtype), p, comm_, stream_));
      }
      DNALLM_NCCL_CHECK(ncclGroupEnd());
    });
  }

  // ncclCommSplit (NCCL 2.18+), in issue order with this communicator's collectives. It
  // blocks until every rank of this communicator calls it: NCCL's communicator creation
  // has no timeout of ours (the watchdog only sees enqueued work).
  std::unique_ptr<Communicator> split(int color, int key) override {
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21800
    std::lock_guard<std::mutex> issue(issue_mutex_);
    if (shared_->aborted) {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      throw Error(ExitCode::kPeerFailed, shared_->abort_error);
    }
    const std::string name = split_name(options_.name, ++splits_, color);
    DNALLM_CUDA_CHECK(cudaSetDevice(device_));
    ncclComm_t sub = nullptr;
    try {
      DNALLM_NCCL_CHECK(
          ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    } catch (const Error& e) {
      fail(ExitCode::kPeerFailed, "nccl split (into {}) failed on rank {}@{}: {}", name, rank_,
           host_name(), e.what());
    }
    if (sub == nullptr) return nullptr;
    CommOptions o = options_;
    o.name = name;
    DNALLM_NCCL_CHECK(ncclCommUserRank(sub, &o.rank));
    DNALLM_NCCL_CHECK(ncclCommCount(sub, &o.world_size));
    return std::make_unique<NcclCommunicator>(o, sub);
#else
    (void)color;
    (void)key;
    fail(ExitCode::kUsage, "nccl split needs NCCL 2.18 or newer (ncclCommSplit); this build has {}",
         NCCL_VERSION_CODE);
#endif
  }

  // NCCL has no tags: `tag` is checked like the other backends do, then ignored.
  WorkPtr send(BufferView buf, int peer, int tag) override {
    check_p2p(buf, "send", peer, tag);
    return enqueue(fmt::format("send to rank {} tag {}", peer, tag), [&] {
      DNALLM_NCCL_CHECK(ncclSend(buf.data, buf.count, nccl_type(buf.dtype), peer, comm_, stream_));
    });
  }

  WorkPtr recv(BufferView buf, int peer, int tag) override {
    check_p2p(buf, "recv", peer, tag);
    return enqueue(fmt::format("recv from rank {} tag {}", peer, tag), [&] {
      DNALLM_NCCL_CHECK(ncclRecv(buf.data, buf.count, nccl_type(buf.dtype), peer, comm_, stream_));
    });
  }

 private:
  void check(const BufferView& b, const char* what) const {
    DNALLM_CHECK(b.device.is_cuda() && b.device.index == device_, ExitCode::kUsage,
                 "nccl {}: buffers must be CUDA memory on device {}", what, device_);
  }

  void check_p2p(const BufferView& b, const char* what, int peer, int tag) const {
    check(b, what);
    DNALLM_CHECK(peer >= 0 && peer < world_ && peer != rank_, ExitCode::kFailure,
                 "nccl {} on rank {}: peer {} is not another rank of this communicator (world "
                 "size {})",
                 what, rank_, peer, world_);
    DNALLM_CHECK(tag >= 0, ExitCode::kFailure, "nccl {} on rank {}: tag {} is negative", what,
                 rank_, tag);
  }

  // Issue order = stream order; serialised so that concurrent issuers cannot interleave.
  template <typename Launch>
  WorkPtr enqueue(const std::string& what, Launch launch) {
    std::lock_guard<std::mutex> issue(issue_mutex_);
    if (shared_->aborted) {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      throw Error(ExitCode::kPeerFailed, shared_->abort_error);
    }
    auto op = std::make_shared<InFlight>();
    op->seq = next_seq_++;
    op->what = "nccl " + what;
    DNALLM_CUDA_CHECK(cudaSetDevice(device_));
    // See Note [Producer stream].
    DNALLM_CUDA_CHECK(cudaEventRecord(produced_, cudaStreamLegacy));
    DNALLM_CUDA_CHECK(cudaStreamWaitEvent(stream_, produced_, 0));
    launch();
    DNALLM_CUDA_CHECK(cudaEventCreateWithFlags(&op->event, cudaEventDisableTiming));
    DNALLM_CUDA_CHECK(cudaEventRecord(op->event, stream_));
    op->started = Clock::now();
    {
      std::lock_guard<std::mutex> lock(watch_mutex_);
      in_flight_.push_back(op);
    }
    return std::make_shared<NcclWork>(shared_, op);
  }

  void watchdog_loop() {
    std::unique_lock<std::mutex> lock(watch_mutex_);
    while (!stopping_) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
      check_async_error();
      for (auto it = in_flight_.begin(); it != in_flight_.end();) {
        auto& op = *it;
        if (cudaEventQuery(op->event) != cudaErrorNotReady) {
          it = in_flight_.erase(it);  // a Work may still hold it: it owns the event
          continue;
        }
        if (!shared_->aborted && Clock::now() - op->started > shared_->timeout) {
          std::string why = shared_->monitor->diagnose(op->seq);
          {
            std::lock_guard<std::mutex> l(shared_->mutex);
            shared_->abort_error = fmt::format(
                "{} #{} timed out after {} ms on rank {}@{}: {}; NCCL communicator "
                "aborted",
                op->what, op->seq, shared_->timeout.count(), rank_, host_name(), why);
          }
          spdlog::error("{}", shared_->abort_error);
          shared_->aborted = true;  // enqueue() refuses new work from now on
          ncclCommAbort(comm_);
        }
        ++it;
      }
    }
  }

  // Note [NCCL asynchronous errors]: a peer that dies mid-collective makes NCCL's proxy
  // thread report ncclRemoteError / ncclSystemError on the communicator long before our
  // timeout. The watchdog polls for it, aborts at once, and names the peer(s) the store saw
  // die (Note [Peer failure]) next to NCCL's own last error. Called with watch_mutex_ held.
  void check_async_error() {
    if (shared_->aborted || comm_ == nullptr) return;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess) return;
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21400
    if (async == ncclInProgress) return;
#endif
    if (async == ncclSuccess) return;
    const uint64_t seq = in_flight_.empty() ? 0 : in_flight_.front()->seq;
    const std::string what = in_flight_.empty() ? std::string("nccl") : in_flight_.front()->what;
    std::string detail = ncclGetErrorString(async);
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21300
    if (const char* last = ncclGetLastError(comm_); last != nullptr && *last != '\0') {
      detail += std::string(": ") + last;
    }
#endif
    const std::string why = shared_->monitor->diagnose(seq);
    {
      std::lock_guard<std::mutex> l(shared_->mutex);
      shared_->abort_error = fmt::format(
          "{} #{} failed on rank {}@{}: NCCL reported {}; {}; NCCL communicator "
          "aborted",
          what, seq, rank_, host_name(), detail, why);
    }
    spdlog::error("{}", shared_->abort_error);
    shared_->aborted = true;
    ncclCommAbort(comm_);
  }

  const CommOptions options_;  // a sub-group starts from a copy
  int rank_;
  int world_;
  int device_ = 0;
  uint64_t splits_ = 0;  // guarded by issue_mutex_
  std::shared_ptr<NcclShared> shared_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t produced_ = nullptr;  // guarded by issue_mutex_; Note [Producer stream]
  void* barrier_buf_ = nullptr;
  std::mutex issue_mutex_;
  uint64_t next_seq_ = 1;  // guarded by issue_mutex_

  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  bool stopping_ = false;                           // guarded by watch_mutex_
  std::list<std::shared_ptr<InFlight>> in_flight_;  // guarded by watch_mutex_
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& options) {
  return std::make_unique<NcclCommunicator>(options);
}

}  // namespace dnallm::comm
