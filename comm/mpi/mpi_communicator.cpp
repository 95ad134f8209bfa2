#define OMPI_SKIP_MPICXX 1
#include "comm/mpi/mpi_communicator.hpp"
#include "comm/mpi/mpi_types.hpp"

#include <mpi.h>

#include <atomic>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "comm/detail/cpu_reduce.hpp"
#include "comm/detail/queued_communicator.hpp"
#include "core/error.hpp"

// DNALLM_MPI_CHECK(call): throws Error(kPeerFailed) with the call, file:line and MPI's text.
#define DNALLM_MPI_CHECK(call)                                                               \
  do {                                                                                       \
    int dnallm_mpi_rc_ = (call);                                                             \
    if (dnallm_mpi_rc_ != MPI_SUCCESS) {                                                     \
      char dnallm_mpi_msg_[MPI_MAX_ERROR_STRING];                                            \
      int dnallm_mpi_len_ = 0;                                                               \
      MPI_Error_string(dnallm_mpi_rc_, dnallm_mpi_msg_, &dnallm_mpi_len_);                   \
      throw ::dnallm::Error(                                                                 \
          ::dnallm::ExitCode::kPeerFailed,                                                   \
          ::fmt::format("{} failed: {} [{}:{}]", #call,                                      \
                        std::string(dnallm_mpi_msg_, dnallm_mpi_len_), __FILE__, __LINE__)); \
    }                                                                                        \
  } while (0)

namespace dnallm::comm {

namespace {

// User reductions for the 16-bit floating types (Note [Half-precision reduction]).
template <DType D, ReduceOp Op>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  detail::reduce_elements(D, Op, inout, inout, in, static_cast<size_t>(*len));
}

class MpiCommunicator final : public detail::QueuedCommunicator {
 public:
  static int world_rank_from_mpi(bool* initialised_here) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    *initialised_here = false;
    if (!initialised) {
      int provided = 0;
      DNALLM_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
      DNALLM_CHECK(provided >= MPI_THREAD_SERIALIZED, ExitCode::kFailure,
                   "this MPI provides thread level {} < MPI_THREAD_SERIALIZED", provided);
      *initialised_here = true;
    }
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank;
  }
  static int world_size_from_mpi() {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    return size;
  }

  MpiCommunicator(const CommOptions& o, bool initialised_here, int rank, int size)
      : QueuedCommunicator(o, rank, size, "mpi", /*spin_wait=*/false),
        initialised_here_(initialised_here) {
    DNALLM_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kFloat16, ReduceOp::kSum>, 1, &fp16_sum_));
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kFloat16, ReduceOp::kMax>, 1, &fp16_max_));
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kBFloat16, ReduceOp::kSum>, 1, &bf16_sum_));
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kBFloat16, ReduceOp::kMax>, 1, &bf16_max_));
    start_worker();
  }

  ~MpiCommunicator() override {
    // A collective that never finished cannot be cancelled: abort the job rather than hang.
    if (in_call_.load()) {
      auto deadline = std::chrono::steady_clock::now() + timeout();
      while (in_call_.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (in_call_.load()) {
        spdlog::error("mpi: a collective is still blocked at shutdown; calling MPI_Abort");
        MPI_Abort(MPI_COMM_WORLD, static_cast<int>(ExitCode::kPeerFailed));
      }
    }
    stop_worker();
    MPI_Op_free(&fp16_sum_);
    MPI_Op_free(&fp16_max_);
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&bf16_max_);
    MPI_Comm_free(&comm_);
    if (initialised_here_) MPI_Finalize();
  }

 protected:
  void run_allreduce(const BufferView& in, const BufferView& out, ReduceOp op, uint32_t) override {
    InCall guard(in_call_);
    const void* send = in.data == out.data ? MPI_IN_PLACE : in.data;
    DNALLM_MPI_CHECK(MPI_Allreduce(send, out.data, to_int(out.count), mpi_type(out.dtype),
                                   mpi_op(out.dtype, op), comm_));
    if (op == ReduceOp::kAvg) detail::divide_elements(out.dtype, out.data, out.count, world_size());
  }

  void run_reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp op,
                          uint32_t) override {
    InCall guard(in_call_);
    std::vector<int> counts(static_cast<size_t>(world_size()));
    for (int r = 0; r < world_size(); ++r)
      counts[static_cast<size_t>(r)] = to_int(shard_range(in.count, world_size(), r).count);
    // MPI_IN_PLACE for reduce_scatter means "the input is in the receive buffer", which is
    // not our in-place layout (the output is a slice of the input): use a scratch output.
    const bool aliased = out.data >= in.data && static_cast<uint8_t*>(out.data) <
                                                    static_cast<uint8_t*>(in.data) + in.bytes();
    void* recv = out.data;
    if (aliased) {
      scratch_.resize(out.bytes());
      recv = scratch_.data();
    }
    DNALLM_MPI_CHECK(MPI_Reduce_scatter(in.data, recv, counts.data(), mpi_type(in.dtype),
                                        mpi_op(in.dtype, op), comm_));
    if (aliased) std::memcpy(out.data, recv, out.bytes());
    if (op == ReduceOp::kAvg) detail::divide_elements(out.dtype, out.data, out.count, world_size());
  }

  void run_allgather(const BufferView& in, const BufferView& out, uint32_t) override {
    InCall guard(in_call_);
    std::vector<int> counts(static_cast<size_t>(world_size()));
    std::vector<int> displs(static_cast<size_t>(world_size()));
    for (int r = 0; r < world_size(); ++r) {
      auto s = shard_range(out.count, world_size(), r);
      counts[static_cast<size_t>(r)] = to_int(s.count);
      displs[static_cast<size_t>(r)] = to_int(s.offset);
    }
    auto mine = shard_range(out.count, world_size(), rank());
    const size_t esize = dtype_size(out.dtype);
    const void* send = in.data;
    if (in.data == static_cast<uint8_t*>(out.data) + mine.offset * esize) send = MPI_IN_PLACE;
    DNALLM_MPI_CHECK(MPI_Allgatherv(send, to_int(in.count), mpi_type(in.dtype), out.data,
                                    counts.data(), displs.data(), mpi_type(out.dtype), comm_));
  }

  void run_broadcast(const BufferView& buf, int root, uint32_t) override {
    InCall guard(in_call_);
    DNALLM_MPI_CHECK(MPI_Bcast(buf.data, to_int(buf.count), mpi_type(buf.dtype), root, comm_));
  }

  void run_barrier(uint32_t) override {
    InCall guard(in_call_);
    DNALLM_MPI_CHECK(MPI_Barrier(comm_));
  }

 private:
  struct InCall {
    explicit InCall(std::atomic<bool>& f) : flag(f) { flag = true; }
    ~InCall() { flag = false; }
    std::atomic<bool>& flag;
  };

  static int to_int(size_t n) {
    DNALLM_CHECK(n <= static_cast<size_t>(INT32_MAX), ExitCode::kFailure,
                 "mpi: {} elements exceed MPI's int count; split the buffer", n);
    return static_cast<int>(n);
  }

  static MPI_Datatype mpi_type(DType t) { return mpi_datatype(t); }

  MPI_Op mpi_op(DType t, ReduceOp op) const {
    const bool max = op == ReduceOp::kMax;
    if (t == DType::kFloat16) return max ? fp16_max_ : fp16_sum_;
    if (t == DType::kBFloat16) return max ? bf16_max_ : bf16_sum_;
    return max ? MPI_MAX : MPI_SUM;
  }

  bool initialised_here_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op fp16_sum_ = MPI_OP_NULL, fp16_max_ = MPI_OP_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  std::atomic<bool> in_call_{false};
  std::vector<uint8_t> scratch_;  // worker thread only
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& options) {
  bool initialised_here = false;
  int rank = MpiCommunicator::world_rank_from_mpi(&initialised_here);
  int size = MpiCommunicator::world_size_from_mpi();
  return std::make_unique<MpiCommunicator>(options, initialised_here, rank, size);
}

}  // namespace dnallm::comm
