#define OMPI_SKIP_MPICXX 1
#include "comm/mpi/mpi_communicator.hpp"
#include "comm/mpi/mpi_types.hpp"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <string>
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

// The process's MPI: initialised by the first mpi communicator unless the program already
// did, finalised (then) when the last communicator made from it, sub-groups included, is
// destroyed. MPI_THREAD_MULTIPLE is asked for: a sub-group's worker and the completion
// thread of send / recv (Note [Posted transfers]) call MPI beside the worker thread.
struct MpiRuntime {
  bool initialised_here = false;
  int thread_level = MPI_THREAD_SINGLE;
  MpiRuntime() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      DNALLM_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &thread_level));
      initialised_here = true;
    } else {
      DNALLM_MPI_CHECK(MPI_Query_thread(&thread_level));
    }
    DNALLM_CHECK(thread_level >= MPI_THREAD_SERIALIZED, ExitCode::kFailure,
                 "this MPI provides thread level {} < MPI_THREAD_SERIALIZED", thread_level);
  }
  ~MpiRuntime() {
    if (initialised_here) MPI_Finalize();
  }
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
};

int comm_rank(MPI_Comm c) {
  int rank = 0;
  MPI_Comm_rank(c, &rank);
  return rank;
}

int comm_size(MPI_Comm c) {
  int size = 1;
  MPI_Comm_size(c, &size);
  return size;
}

// An MPI_Isend / MPI_Irecv (Note [Posted transfers]). One the completion thread gave up on
// (timeout) is cancelled and freed.
class MpiTransfer final : public detail::QueuedCommunicator::PostedTransfer {
 public:
  MpiTransfer(const BufferView& buf, MPI_Datatype type, int count, bool is_send, int peer, int tag,
              MPI_Comm comm)
      : type_(type), count_(count), is_send_(is_send), peer_(peer), tag_(tag) {
    if (is_send)
      DNALLM_MPI_CHECK(MPI_Isend(buf.data, count, type, peer, tag, comm, &request_));
    else
      DNALLM_MPI_CHECK(MPI_Irecv(buf.data, count, type, peer, tag, comm, &request_));
  }
  ~MpiTransfer() override {
    if (request_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&request_);
      MPI_Request_free(&request_);
    }
  }
  MpiTransfer(const MpiTransfer&) = delete;
  MpiTransfer& operator=(const MpiTransfer&) = delete;

  void wait_until(std::chrono::steady_clock::time_point deadline) override {
    // MPI_Wait has no timeout: poll, yielding for the first millisecond (a matched message
    // on a quiet machine), then sleeping between polls.
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
    while (true) {
      int done = 0;
      MPI_Status status;
      DNALLM_MPI_CHECK(MPI_Test(&request_, &done, &status));
      if (done) {
        if (!is_send_) {
          int got = 0;
          DNALLM_MPI_CHECK(MPI_Get_count(&status, type_, &got));
          if (got != count_)
            throw std::runtime_error(
                fmt::format("recv from rank {} tag {}: the message holds {} elements, expected {}",
                            peer_, tag_, got, count_));
        }
        return;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline)
        throw std::runtime_error(fmt::format("{} rank {} tag {} not matched before the timeout",
                                             is_send_ ? "send to" : "recv from", peer_, tag_));
      if (now < spin_until)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  MPI_Request request_ = MPI_REQUEST_NULL;
  MPI_Datatype type_;
  int count_;
  bool is_send_;
  int peer_;
  int tag_;
};

class MpiCommunicator final : public detail::QueuedCommunicator {
 public:
  // Takes ownership of `comm` (a duplicate of MPI_COMM_WORLD, or a sub-group's).
  // `parent_ranks`: a sub-group's members as ranks of its parent (for errors).
  MpiCommunicator(const CommOptions& o, std::shared_ptr<MpiRuntime> runtime, MPI_Comm comm,
                  const std::vector<int>& parent_ranks = {})
      : QueuedCommunicator(o, comm_rank(comm), comm_size(comm), "mpi", /*spin_wait=*/false),
        runtime_(std::move(runtime)),
        comm_(comm) {
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kFloat16, ReduceOp::kSum>, 1, &fp16_sum_));
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kFloat16, ReduceOp::kMax>, 1, &fp16_max_));
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kBFloat16, ReduceOp::kSum>, 1, &bf16_sum_));
    DNALLM_MPI_CHECK(MPI_Op_create(&half_reduce<DType::kBFloat16, ReduceOp::kMax>, 1, &bf16_max_));
    void* tag_ub = nullptr;
    int has_tag_ub = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_tag_ub);
    if (has_tag_ub && tag_ub != nullptr) set_max_tag(*static_cast<int*>(tag_ub));
    if (!parent_ranks.empty()) set_parent_ranks(parent_ranks);
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
    // runtime_ goes last: MPI_Finalize when this was the last communicator.
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

  void run_all_to_all(const BufferView& in, const BufferView& out, const AllToAllLayout& layout,
                      uint32_t) override {
    InCall guard(in_call_);
    const auto w = static_cast<size_t>(world_size());
    std::vector<int> in_counts(w), in_displs(w), out_counts(w), out_displs(w);
    for (size_t p = 0; p < w; ++p) {
      in_counts[p] = to_int(layout.in_offsets[p + 1] - layout.in_offsets[p]);
      in_displs[p] = to_int(layout.in_offsets[p]);
      out_counts[p] = to_int(layout.out_offsets[p + 1] - layout.out_offsets[p]);
      out_displs[p] = to_int(layout.out_offsets[p]);
    }
    DNALLM_MPI_CHECK(MPI_Alltoallv(in.data, in_counts.data(), in_displs.data(), mpi_type(in.dtype),
                                   out.data, out_counts.data(), out_displs.data(),
                                   mpi_type(out.dtype), comm_));
  }

  std::unique_ptr<PostedTransfer> post_send(const BufferView& buf, int peer, int tag) override {
    return std::make_unique<MpiTransfer>(buf, mpi_type(buf.dtype), to_int(buf.count), true, peer,
                                         tag, comm_);
  }

  std::unique_ptr<PostedTransfer> post_recv(const BufferView& buf, int peer, int tag) override {
    return std::make_unique<MpiTransfer>(buf, mpi_type(buf.dtype), to_int(buf.count), false, peer,
                                         tag, comm_);
  }

  std::unique_ptr<Communicator> run_split(int color, int key, const std::string& name) override {
    MPI_Comm sub = MPI_COMM_NULL;
    {
      InCall guard(in_call_);
      DNALLM_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
    }
    if (sub == MPI_COMM_NULL) return nullptr;
    // The members as ranks of this communicator, for the sub-group's errors.
    const int n = comm_size(sub);
    std::vector<int> sub_ranks(static_cast<size_t>(n)), parent_ranks(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) sub_ranks[static_cast<size_t>(i)] = i;
    MPI_Group sub_group = MPI_GROUP_NULL, parent_group = MPI_GROUP_NULL;
    MPI_Comm_group(sub, &sub_group);
    MPI_Comm_group(comm_, &parent_group);
    MPI_Group_translate_ranks(sub_group, n, sub_ranks.data(), parent_group, parent_ranks.data());
    MPI_Group_free(&sub_group);
    MPI_Group_free(&parent_group);
    CommOptions o = options();
    o.name = name;
    return std::make_unique<MpiCommunicator>(o, runtime_, sub, parent_ranks);
  }

  std::string unsupported(const char* op) const override {
    if (runtime_->thread_level >= MPI_THREAD_MULTIPLE) return "";
    return fmt::format(
        "this MPI provides thread level {} and {} needs MPI_THREAD_MULTIPLE (a second thread "
        "calls MPI); use an MPI built with thread support, or the gloo backend",
        runtime_->thread_level, op);
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

  std::shared_ptr<MpiRuntime> runtime_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op fp16_sum_ = MPI_OP_NULL, fp16_max_ = MPI_OP_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  std::atomic<bool> in_call_{false};
  std::vector<uint8_t> scratch_;  // worker thread only
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& options) {
  auto runtime = std::make_shared<MpiRuntime>();
  MPI_Comm world = MPI_COMM_NULL;
  DNALLM_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &world));
  return std::make_unique<MpiCommunicator>(options, std::move(runtime), world);
}

}  // namespace dnallm::comm
