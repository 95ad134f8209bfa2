// comm_test_worker: one rank of a multi-process communicator test, started by
// comm_gloo_test (env RANK, WORLD_SIZE, MASTER_PORT; the test hosts the store) or by
// mpirun (comm_mpi_test). Modes (env DNALLM_TEST_MODE):
//   matrix: every collective x dtype x count x in/out of place, every element checked
//           against a closed form; exit 0 if all match, 1 otherwise (mismatches on stderr).
//   kill:   allreduce in a loop; rank DNALLM_TEST_VICTIM SIGKILLs itself during one; the
//           survivors must get Error(kPeerFailed): print it and exit 4.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/half.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace {

using namespace dnallm;
using namespace dnallm::comm;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// Rank r's element i: small integers, exact in every tested dtype, differing per rank.
double value(int r, size_t i) {
  return static_cast<double>((i * 3 + static_cast<size_t>(r) * 5) % 11 + 1);
}

// What the reduction of element i over all ranks must be, rounded like the backends do.
double reduced(DType t, int world, size_t i, ReduceOp op) {
  double sum = 0, mx = -1e300;
  for (int r = 0; r < world; ++r) {
    sum += value(r, i);
    mx = std::max(mx, value(r, i));
  }
  if (op == ReduceOp::kMax) return mx;
  if (op == ReduceOp::kSum) return sum;
  std::vector<uint8_t> tmp(8);
  if (t == DType::kInt64) return std::floor(sum / world);
  if (t == DType::kFloat64) return sum / world;
  store_element(t, tmp.data(), 0,
                static_cast<double>(static_cast<float>(sum) / static_cast<float>(world)));
  return load_element(t, tmp.data(), 0);
}

struct Checker {
  int rank;
  int failures = 0;
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    if (++failures <= 20) std::cerr << "rank " << rank << ": MISMATCH " << what << "\n";
  }
};

void run_matrix(Communicator& comm) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  Checker check{rank};
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                     DType::kInt64, DType::kFloat64};
  const std::vector<size_t> counts = {3, 5, 13, 1031, 70001};
  int cases = 0;
  for (DType t : dtypes) {
    const size_t es = dtype_size(t);
    for (size_t n : counts) {
      if (n == 70001 && t != DType::kFloat32) continue;
      const auto mine = shard_range(n, world, rank);
      auto label = [&](const char* op, const char* mode, size_t i, double got, double want) {
        return std::string(op) + " " + mode + " " + dtype_name(t) + " n=" + std::to_string(n) +
               " i=" + std::to_string(i) + " got " + std::to_string(got) + " want " +
               std::to_string(want);
      };
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        for (bool in_place : {false, true}) {
          const char* mode = in_place ? "in-place" : "out-of-place";
          // allreduce
          std::vector<uint8_t> in(n * es), out(n * es);
          for (size_t i = 0; i < n; ++i) store_element(t, in.data(), i, value(rank, i));
          BufferView vin{in.data(), n, t, {}};
          BufferView vout{in_place ? in.data() : out.data(), n, t, {}};
          comm.allreduce(vin, vout, op)->wait();
          for (size_t i = 0; i < n; ++i) {
            double got = load_element(t, vout.data, i), want = reduced(t, world, i, op);
            check.expect(got == want,
                         label("allreduce", mode, i, got, want) + " " + reduce_op_name(op));
          }
          if (!in_place)
            for (size_t i = 0; i < n; ++i)
              check.expect(load_element(t, in.data(), i) == value(rank, i),
                           "allreduce modified its input");
          // reduce_scatter
          for (size_t i = 0; i < n; ++i) store_element(t, in.data(), i, value(rank, i));
          std::vector<uint8_t> shard(mine.count * es + 1);
          BufferView sout{
              in_place ? in.data() + mine.offset * es : shard.data(), mine.count, t, {}};
          comm.reduce_scatter(vin, sout, op)->wait();
          for (size_t i = 0; i < mine.count; ++i) {
            double got = load_element(t, sout.data, i),
                   want = reduced(t, world, mine.offset + i, op);
            check.expect(got == want,
                         label("reduce_scatter", mode, i, got, want) + " " + reduce_op_name(op));
          }
          ++cases;
        }
      }
      for (bool in_place : {false, true}) {
        const char* mode = in_place ? "in-place" : "out-of-place";
        // allgather: shard element j of rank r is value(r, offset_r + j) * (r + 1)
        std::vector<uint8_t> full(n * es), part(mine.count * es + 1);
        for (size_t i = 0; i < n; ++i) store_element(t, full.data(), i, -1);
        void* src = in_place ? full.data() + mine.offset * es : part.data();
        for (size_t j = 0; j < mine.count; ++j)
          store_element(t, src, j, value(rank, mine.offset + j));
        comm.allgather(BufferView{src, mine.count, t, {}}, BufferView{full.data(), n, t, {}})
            ->wait();
        for (int r = 0; r < world; ++r) {
          auto s = shard_range(n, world, r);
          for (size_t j = 0; j < s.count; ++j) {
            double got = load_element(t, full.data(), s.offset + j), want = value(r, s.offset + j);
            check.expect(got == want, label("allgather", mode, s.offset + j, got, want));
          }
        }
        ++cases;
      }
      // broadcast from the last rank
      std::vector<uint8_t> buf(n * es);
      const int root = world - 1;
      for (size_t i = 0; i < n; ++i)
        store_element(t, buf.data(), i, rank == root ? value(root, i) : -1);
      comm.broadcast(BufferView{buf.data(), n, t, {}}, root)->wait();
      for (size_t i = 0; i < n; ++i) {
        double got = load_element(t, buf.data(), i), want = value(root, i);
        check.expect(got == want, label("broadcast", "root=last", i, got, want));
      }
      ++cases;
    }
  }
  // Asynchrony: several collectives in flight, waited in reverse order.
  std::vector<std::vector<float>> bufs(4, std::vector<float>(777));
  std::vector<WorkPtr> works;
  for (size_t k = 0; k < bufs.size(); ++k) {
    for (size_t i = 0; i < 777; ++i) bufs[k][i] = static_cast<float>(k + 1);
    works.push_back(
        comm.allreduce(BufferView{bufs[k].data(), 777, DType::kFloat32, {}}, ReduceOp::kSum));
  }
  works.push_back(comm.barrier());
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  for (auto& w : works) check.expect(w->is_completed(), "work not completed after wait");
  for (size_t k = 0; k < bufs.size(); ++k)
    for (size_t i = 0; i < 777; ++i)
      check.expect(bufs[k][i] == static_cast<float>((k + 1) * world),
                   "queued allreduce " + std::to_string(k));
  if (check.failures > 0) {
    std::cerr << "rank " << rank << ": " << check.failures << " mismatches\n";
    std::exit(1);
  }
  std::cout << "rank " << rank << " backend " << comm.backend() << " world " << world << ": "
            << cases << " cases OK\n";
}

int run_kill(Communicator& comm) {
  const int victim = env_int("DNALLM_TEST_VICTIM", 1);
  std::vector<float> buf(1 << 20, 1.0f);
  std::atomic<bool> armed{false};
  std::thread killer;
  if (comm.rank() == victim && env_int("DNALLM_TEST_STALL", 0) == 0) {
    killer = std::thread([&] {
      while (!armed) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      ::kill(::getpid(), SIGKILL);
    });
  }
  const bool stall = env_int("DNALLM_TEST_STALL", 0) != 0;
  if (stall && comm.rank() == victim) {
    // Alive but absent: skip the collectives the others are in, then leave quietly.
    if (killer.joinable()) {
      armed = true;
      killer.join();
    }
    for (int it = 0; it < 3; ++it)
      comm.allreduce(BufferView{buf.data(), buf.size(), DType::kFloat32, {}}, ReduceOp::kMax)
          ->wait();
    std::this_thread::sleep_for(
        std::chrono::milliseconds(env_int("DNALLM_TEST_TIMEOUT_MS", 3000) + 3000));
    return 0;
  }
  try {
    for (int it = 0; it < 100000; ++it) {
      if (it == 3) armed = true;
      comm.allreduce(BufferView{buf.data(), buf.size(), DType::kFloat32, {}}, ReduceOp::kMax)
          ->wait();
    }
  } catch (const Error& e) {
    std::cerr << "ERROR code=" << e.exit_code() << ": " << e.what() << "\n";
    if (killer.joinable()) killer.join();
    return e.exit_code();
  }
  if (killer.joinable()) killer.join();
  std::cerr << "no failure seen\n";
  return 0;
}

}  // namespace

int main() {
  try {
    init_logging("comm-test", "warn");
    CommOptions o;
    o.backend = std::getenv("DNALLM_TEST_BACKEND") ? std::getenv("DNALLM_TEST_BACKEND") : "auto";
    o.rank = env_int("RANK", 0);
    o.world_size = env_int("WORLD_SIZE", 1);
    o.timeout = std::chrono::milliseconds(env_int("DNALLM_TEST_TIMEOUT_MS", 20000));
    o.loopback = true;
    o.name = "test";
    if (env_int("MASTER_PORT", 0) != 0) {
      coordinator::TcpStoreClientOptions so;
      so.port = static_cast<uint16_t>(env_int("MASTER_PORT", 0));
      so.token = "test-token";
      so.connect_timeout = std::chrono::seconds(20);
      o.store = std::make_shared<coordinator::TcpStoreClient>(so);
    }
    auto comm = make_communicator(o);
    set_log_identity(comm->rank());
    const char* mode = std::getenv("DNALLM_TEST_MODE");
    if (mode && std::string(mode) == "kill") return run_kill(*comm);
    run_matrix(*comm);
    return 0;
  } catch (const Error& e) {
    std::cerr << "ERROR code=" << e.exit_code() << ": " << e.what() << "\n";
    return e.exit_code();
  }
}
