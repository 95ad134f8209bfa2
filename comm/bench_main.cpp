// dnallm-bench-comm: collective bandwidth in the style of nccl-tests.
//
//   size count type redop time(us) algbw(GB/s) busbw(GB/s) #wrong
//
// gloo/nccl read the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
// rank 0 hosts the store at MASTER_PORT); mpi and mpi-raw (plain MPI_Allreduce etc., the
// peer our mpi backend is compared with) run under mpirun. Every element of every result
// is checked against a closed-form value. time = median over --iters timed iterations
// after --warmup untimed ones.
// Beyond the collectives: --op all_to_all (size = what each rank sends, in W balanced
// blocks, shard_range's; busbw = algbw x (W-1)/W as nccl-tests' alltoall) and --op sendrecv
// (a ring exchange: each rank sends size bytes to rank+1 and receives as much from rank-1,
// even ranks issuing the send first, odd ones the recv; busbw = algbw, as nccl-tests').
// DNALLM_EXTERNAL_COORDINATOR=1: a coordinator already serves MASTER_PORT, rank 0 does not host
// one.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#ifdef DNALLM_HAVE_MPI
#include <mpi.h>

#include "comm/mpi/mpi_types.hpp"
#endif
#include "cluster/topology.hpp"
#include "comm/bootstrap.hpp"
#include "comm/communicator.hpp"
#include "comm/half.hpp"
#include "core/cli.hpp"
#include "core/cuda_plugin.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/worker_env.hpp"

namespace {

using namespace dnallm;
using namespace dnallm::comm;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string backend = "gloo";
  std::string op = "allreduce";
  std::string dtype = "fp32";
  std::string redop = "sum";
  size_t min_bytes = 1 << 10;
  size_t max_bytes = 64 << 20;
  int iters = 20;
  int warmup = 5;
  bool json = false;
  bool in_place = false;
  double timeout_s = 60;
};

// Input element i of rank r: small integers, exact in every dtype (bf16 included).
double input_value(int rank, size_t i) { return static_cast<double>((i % 7) + 1 + rank); }

double expected_reduced(int world, size_t i, ReduceOp op) {
  double base = static_cast<double>((i % 7) + 1);
  if (op == ReduceOp::kMax) return base + world - 1;
  double sum = base * world + world * (world - 1) / 2.0;
  if (op == ReduceOp::kAvg) return std::floor(sum / world * 4 + 0.5) / 4;  // see check()
  return sum;
}

// all_to_all's blocks: rank r sends shard_range(count, W, p) of its input to rank p, so it
// receives W blocks of its own shard's size.
std::vector<int64_t> a2a_in_counts(size_t count, int world) {
  std::vector<int64_t> c(static_cast<size_t>(world));
  for (int p = 0; p < world; ++p)
    c[static_cast<size_t>(p)] = static_cast<int64_t>(shard_range(count, world, p).count);
  return c;
}
std::vector<int64_t> a2a_out_counts(size_t count, int world, int rank) {
  return std::vector<int64_t>(static_cast<size_t>(world),
                              static_cast<int64_t>(shard_range(count, world, rank).count));
}

// Where the collective's buffers live: host memory, or (nccl) a device copy of it, through
// the CUDA plugin's runtime calls (Note [Lazy CUDA] in core/cuda_plugin.hpp).
class Mirror {
 public:
  Mirror(bool cuda, int device, void* host, size_t bytes) : host_(host), bytes_(bytes) {
    if (!cuda) return;
    cuda_plugin::require("--backend nccl");
    hooks_ = cuda_plugin::hooks();
    DNALLM_CHECK(hooks_ != nullptr && hooks_->device_alloc != nullptr, ExitCode::kUsage,
                 "this build's CUDA plugin has no CUDA runtime (nccl) support");
    device_ = device;
    dev_ = hooks_->device_alloc(device, bytes);
  }
  ~Mirror() {
    if (dev_) hooks_->device_free(dev_);
  }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  void* data() const { return dev_ ? dev_ : host_; }
  Device device() const { return dev_ ? Device{DeviceType::kCUDA, device_} : Device{}; }
  void upload() {
    if (dev_) hooks_->copy(dev_, host_, bytes_, true);
  }
  void download() {
    if (dev_) hooks_->copy(host_, dev_, bytes_, false);
  }

 private:
  const cuda_plugin::Hooks* hooks_ = nullptr;
  void* host_;
  size_t bytes_;
  void* dev_ = nullptr;
  int device_ = 0;
};

// The abstract "run one collective" the sweep times: our Communicator, or raw MPI.
struct Runner {
  virtual ~Runner() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual void run(const std::string& op, BufferView in, BufferView out, ReduceOp redop) = 0;
  virtual int64_t sum_wrong(int64_t wrong) = 0;
};

struct CommRunner final : Runner {
  ProcessGroup group;  // store server (rank 0), store client, communicator
  int rank() const override { return group.comm->rank(); }
  int world() const override { return group.comm->world_size(); }
  void run(const std::string& op, BufferView in, BufferView out, ReduceOp redop) override {
    WorkPtr w;
    if (op == "allreduce")
      w = group.comm->allreduce(in, out, redop);
    else if (op == "reduce_scatter")
      w = group.comm->reduce_scatter(in, out, redop);
    else if (op == "allgather")
      w = group.comm->allgather(in, out);
    else if (op == "all_to_all")
      w = group.comm->all_to_all(in, a2a_in_counts(in.count, world()), out,
                                 a2a_out_counts(in.count, world(), rank()));
    else if (op == "sendrecv")
      return ring_exchange(in, out);
    else
      w = group.comm->broadcast(out, 0);
    w->wait();
  }
  // See the header: even ranks send first (nccl's send waits on its stream for the recv).
  void ring_exchange(BufferView in, BufferView out) {
    Communicator& c = *group.comm;
    const int right = (rank() + 1) % world(), left = (rank() + world() - 1) % world();
    WorkPtr first, second;
    if (rank() % 2 == 0) {
      first = c.send(in, right, 0);
      second = c.recv(out, left, 0);
    } else {
      first = c.recv(out, left, 0);
      second = c.send(in, right, 0);
    }
    first->wait();
    second->wait();
  }
  int64_t sum_wrong(int64_t wrong) override {
    const bool cuda = std::string(group.comm->backend()) == "nccl";
    Mirror m(cuda, cuda_device, &wrong, sizeof(wrong));
    m.upload();
    group.comm->allreduce(BufferView{m.data(), 1, DType::kInt64, m.device()}, ReduceOp::kSum)
        ->wait();
    m.download();
    return wrong;
  }
  int cuda_device = 0;
};

#ifdef DNALLM_HAVE_MPI
struct RawMpiRunner final : Runner {
  RawMpiRunner() {
    // DNALLM_BENCH_MPI_THREADS=<level>: request an MPI thread level (our mpi backend asks
    // for MPI_THREAD_MULTIPLE = 3), to compare like with like.
    if (std::getenv("DNALLM_BENCH_MPI_THREADS") != nullptr) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, std::atoi(std::getenv("DNALLM_BENCH_MPI_THREADS")),
                      &provided);
    } else {
      MPI_Init(nullptr, nullptr);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
  }
  ~RawMpiRunner() override { MPI_Finalize(); }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  static MPI_Datatype type(DType t) {
    // MPI's built-in MPI_SUM cannot add fp16/bf16 (the backend uses its own op for them);
    // the bench checks values in the four types below only.
    if (t != DType::kFloat32 && t != DType::kFloat64 && t != DType::kInt64 && t != DType::kInt32) {
      fail(ExitCode::kUsage, "--backend mpi-raw supports fp32, fp64, int64, int32");
    }
    return mpi_datatype(t);
  }
  void run(const std::string& op, BufferView in, BufferView out, ReduceOp redop) override {
    if (op == "all_to_all") {
      std::vector<int> sc(static_cast<size_t>(world_)), sd(sc), rc(sc), rd(sc);
      for (int p = 0; p < world_; ++p) {
        const auto u = static_cast<size_t>(p);
        const auto s = shard_range(in.count, world_, p);
        const auto mine = shard_range(in.count, world_, rank_);
        sc[u] = static_cast<int>(s.count);
        sd[u] = static_cast<int>(s.offset);
        rc[u] = static_cast<int>(mine.count);
        rd[u] = static_cast<int>(mine.count * u);
      }
      MPI_Alltoallv(in.data, sc.data(), sd.data(), mpi_datatype(in.dtype), out.data, rc.data(),
                    rd.data(), mpi_datatype(out.dtype), MPI_COMM_WORLD);
      return;
    }
    if (op == "sendrecv") {
      MPI_Sendrecv(in.data, static_cast<int>(in.count), mpi_datatype(in.dtype),
                   (rank_ + 1) % world_, 0, out.data, static_cast<int>(out.count),
                   mpi_datatype(out.dtype), (rank_ + world_ - 1) % world_, 0, MPI_COMM_WORLD,
                   MPI_STATUS_IGNORE);
      return;
    }
    DNALLM_CHECK(op == "allreduce" && redop != ReduceOp::kAvg, ExitCode::kUsage,
                 "--backend mpi-raw runs --op allreduce (sum or max), all_to_all or sendrecv");
    MPI_Allreduce(in.data, out.data, static_cast<int>(in.count), type(in.dtype),
                  redop == ReduceOp::kMax ? MPI_MAX : MPI_SUM, MPI_COMM_WORLD);
  }
  int64_t sum_wrong(int64_t wrong) override {
    int64_t total = 0;
    MPI_Allreduce(&wrong, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    return total;
  }
  int rank_ = 0, world_ = 1;
};
#endif

// The torchrun and DNALLM_* variables, read once (core/worker_env.hpp defines their names).
const WorkerEnv& worker_env() {
  static const WorkerEnv env = WorkerEnv::from_environment(cluster::current_env());
  return env;
}

std::unique_ptr<Runner> make_runner(const Args& a) {
#ifdef DNALLM_HAVE_MPI
  if (a.backend == "mpi-raw") return std::make_unique<RawMpiRunner>();
#endif
  auto r = std::make_unique<CommRunner>();
  ProcessGroupOptions o;
  o.backend = a.backend;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  o.name = "bench";
  if (a.backend == "mpi") {
    o.master_addr = "";  // MPI bootstraps itself; no store
  } else {
    const WorkerEnv& env = worker_env();
    o.rank = env.rank.value_or(0);
    o.world_size = env.world_size.value_or(1);
    o.master_addr = env.master_addr.value_or("127.0.0.1");
    o.master_port = env.master_port.value_or(29500);
    o.token = env.job_token;
    // Rank 0 hosts the store unless a coordinator already serves MASTER_PORT.
    o.rank0_hosts_store = !env.external_coordinator;
    if (a.backend == "nccl") o.device = Device{DeviceType::kCUDA, env.local_rank.value_or(0)};
    r->cuda_device = o.device.index;
  }
  r->group = connect_process_group(o);
  return r;
}

// What one message size is run with.
struct Sweep {
  const Args& args;
  Runner& runner;
  DType dtype;
  ReduceOp redop;
  int rank = 0, world = 1;
  bool cuda = false;
  int cuda_device = 0;
};

// One size's host buffers: the input (each rank's closed-form values) and the output
// (broadcast: the root's values on rank 0, -1 elsewhere).
struct HostBuffers {
  std::vector<uint8_t> in, out;
  size_t in_count = 0, out_count = 0;
};

HostBuffers make_buffers(const Sweep& s, size_t count, ShardRange mine) {
  const std::string& op = s.args.op;
  const size_t esize = dtype_size(s.dtype);
  HostBuffers b;
  b.in_count = op == "allgather" ? mine.count : count;
  b.out_count = op == "reduce_scatter" ? mine.count : count;
  if (op == "all_to_all") b.out_count = mine.count * static_cast<size_t>(s.world);
  b.in.resize(b.in_count * esize);
  b.out.resize(b.out_count * esize);
  for (size_t i = 0; i < b.in_count; ++i) {
    size_t global = op == "allgather" ? mine.offset + i : i;
    store_element(s.dtype, b.in.data(), i,
                  op == "allgather" ? input_value(0, global) + 0 : input_value(s.rank, global));
  }
  if (op == "broadcast")
    for (size_t i = 0; i < count; ++i)
      store_element(s.dtype, b.out.data(), i, s.rank == 0 ? input_value(0, i) : -1.0);
  if (op == "all_to_all" || op == "sendrecv")
    for (size_t i = 0; i < b.out_count; ++i) store_element(s.dtype, b.out.data(), i, -1.0);
  return b;
}

// Elements of `result` (out_count of them) that differ from the closed-form value.
int64_t count_wrong(const Sweep& s, const void* result, size_t out_count, ShardRange mine) {
  const std::string& op = s.args.op;
  int64_t wrong = 0;
  for (size_t i = 0; i < out_count; ++i) {
    double got = load_element(s.dtype, result, i);
    double want;
    if (op == "allreduce") {
      want = expected_reduced(s.world, i, s.redop);
    } else if (op == "reduce_scatter") {
      want = expected_reduced(s.world, mine.offset + i, s.redop);
    } else if (op == "all_to_all") {
      // Block p (mine.count elements) is rank p's input at my shard's place.
      const size_t p = mine.count > 0 ? i / mine.count : 0;
      want = input_value(static_cast<int>(p), mine.offset + (i - p * mine.count));
    } else if (op == "sendrecv") {
      want = input_value((s.rank + s.world - 1) % s.world, i);  // from the left neighbour
    } else {
      want = input_value(0, i);
    }
    if ((op == "allreduce" || op == "reduce_scatter") && s.redop == ReduceOp::kAvg) {
      double sum =
          expected_reduced(s.world, op == "allreduce" ? i : mine.offset + i, ReduceOp::kSum);
      want = dtype_is_floating(s.dtype) ? sum / s.world : std::floor(sum / s.world);
      if (std::abs(got - want) > 1e-2 * std::abs(want)) ++wrong;  // 16-bit rounding
      continue;
    }
    if (got != want) ++wrong;
  }
  return wrong;
}

struct SizeResult {
  double time_us = 0;  // median of the timed iterations
  int64_t wrong = 0;   // over every rank
};

// --warmup + --iters runs of the collective on `count` elements, then the check.
SizeResult run_size(const Sweep& s, size_t count) {
  const Args& a = s.args;
  const auto mine = shard_range(count, s.world, s.rank);
  HostBuffers b = make_buffers(s, count, mine);
  Mirror in_mem(s.cuda, s.cuda_device, b.in.data(), b.in.size());
  Mirror out_mem(s.cuda, s.cuda_device, b.out.data(), b.out.size());
  in_mem.upload();
  out_mem.upload();
  BufferView in{in_mem.data(), b.in_count, s.dtype, in_mem.device()};
  BufferView out{out_mem.data(), b.out_count, s.dtype, out_mem.device()};
  const bool in_place = a.in_place && a.op == "allreduce";
  if (in_place) out = in;
  std::vector<double> times;
  for (int it = 0; it < a.warmup + a.iters; ++it) {
    if (in_place) {  // restore the input that the previous iteration reduced in place
      for (size_t i = 0; i < b.in_count; ++i)
        store_element(s.dtype, b.in.data(), i, input_value(s.rank, i));
      in_mem.upload();
    }
    auto t0 = Clock::now();
    s.runner.run(a.op, in, out, s.redop);
    auto dt = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (it >= a.warmup) times.push_back(dt);
  }
  (in_place ? in_mem : out_mem).download();
  const void* result = in_place ? b.in.data() : b.out.data();
  std::sort(times.begin(), times.end());
  SizeResult r;
  r.time_us = times.empty() ? 0 : times[times.size() / 2];
  r.wrong = s.runner.sum_wrong(count_wrong(s, result, b.out_count, mine));
  return r;
}

// nccl-tests' bus bandwidth factor of the collective at `world` ranks.
double busbw_factor(const std::string& op, int world) {
  if (op == "allreduce") return 2.0 * (world - 1) / world;
  if (op == "reduce_scatter" || op == "allgather" || op == "all_to_all")
    return static_cast<double>(world - 1) / world;
  return 1.0;  // broadcast, sendrecv
}

// Rank 0's line for one size: a table row, or one JSON object with --json.
void report_size(const Sweep& s, size_t count, const SizeResult& r) {
  const Args& a = s.args;
  const size_t bytes = count * dtype_size(s.dtype);
  const double algbw = r.time_us > 0 ? static_cast<double>(bytes) / (r.time_us * 1e3) : 0;
  const double busbw = algbw * busbw_factor(a.op, s.world);
  if (a.json) {
    nlohmann::json j{{"backend", a.backend},
                     {"op", a.op},
                     {"dtype", dtype_name(s.dtype)},
                     {"redop", a.redop},
                     {"world_size", s.world},
                     {"bytes", bytes},
                     {"count", count},
                     {"time_us", r.time_us},
                     {"algbw_gbs", algbw},
                     {"busbw_gbs", busbw},
                     {"wrong", r.wrong}};
    std::cout << j.dump() << std::endl;
    return;
  }
  fmt::print("{:>12} {:>12} {:>6} {:>6} {:>11.1f} {:>9.3f} {:>9.3f} {:>7}\n", bytes, count,
             dtype_name(s.dtype),
             a.op == "allreduce" || a.op == "reduce_scatter" ? a.redop : "none", r.time_us, algbw,
             busbw, r.wrong);
  std::fflush(stdout);
}

int run(const Args& a) {
  const DType dtype = parse_dtype(a.dtype);
  const ReduceOp redop = parse_reduce_op(a.redop);
  DNALLM_CHECK(a.op == "allreduce" || a.op == "reduce_scatter" || a.op == "allgather" ||
                   a.op == "broadcast" || a.op == "all_to_all" || a.op == "sendrecv",
               ExitCode::kUsage,
               "--op {}: use allreduce, reduce_scatter, allgather, broadcast, all_to_all or "
               "sendrecv",
               a.op);
  const int cuda_device = worker_env().local_rank.value_or(0);
  auto runner = make_runner(a);
  Sweep s{a, *runner, dtype, redop};
  s.rank = runner->rank();
  s.world = runner->world();
  s.cuda = a.backend == "nccl";
  s.cuda_device = cuda_device;
  set_log_identity(s.rank);
  DNALLM_CHECK(a.op != "sendrecv" || s.world > 1, ExitCode::kUsage,
               "--op sendrecv exchanges with the neighbouring ranks: start 2 or more");
  const size_t esize = dtype_size(dtype);
  if (s.rank == 0 && !a.json) {
    fmt::print("# dnallm-bench-comm backend={} op={} world={} warmup={} iters={}\n", a.backend,
               a.op, s.world, a.warmup, a.iters);
    fmt::print("{:>12} {:>12} {:>6} {:>6} {:>11} {:>9} {:>9} {:>7}\n", "size(B)", "count", "type",
               "redop", "time(us)", "algbw", "busbw", "#wrong");
  }
  int64_t total_wrong = 0;
  for (size_t bytes = std::max(a.min_bytes, esize); bytes <= a.max_bytes; bytes *= 2) {
    const size_t count = bytes / esize;
    const SizeResult r = run_size(s, count);
    total_wrong += r.wrong;
    if (s.rank == 0) report_size(s, count, r);
  }
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dnallm-bench-comm: collective bandwidth sweep (nccl-tests style)"};
  Args a;
  app.add_option("--backend", a.backend, "gloo | mpi | nccl | mpi-raw (plain MPI calls)")
      ->check(CLI::IsMember({"gloo", "mpi", "nccl", "mpi-raw"}));
  app.add_option("--op", a.op,
                 "allreduce | reduce_scatter | allgather | broadcast | all_to_all | sendrecv "
                 "(ring exchange)")
      ->check(CLI::IsMember(
          {"allreduce", "reduce_scatter", "allgather", "broadcast", "all_to_all", "sendrecv"}));
  app.add_option("--min-bytes", a.min_bytes, "smallest message (bytes)");
  app.add_option("--max-bytes", a.max_bytes, "largest message (bytes); sizes double");
  app.add_option("--iters", a.iters, "timed iterations per size")->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "untimed iterations per size")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", a.dtype, "fp32 | fp64 | fp16 | bf16 | int64 | int32");
  app.add_option("--redop", a.redop, "sum | avg | max");
  app.add_option("--timeout-s", a.timeout_s, "per-collective timeout in seconds");
  app.add_flag("--in-place", a.in_place, "allreduce: output = input buffer");
  app.add_flag("--json", a.json, "one JSON object per line instead of the table");
  return run_plain_main("dnallm-bench-comm", app, argc, argv, [&] {
    init_logging("bench-comm", "warn");
    return run(a);
  });
}
