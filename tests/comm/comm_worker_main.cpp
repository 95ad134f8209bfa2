// comm_test_worker: one rank of a multi-process communicator test, started by
// comm_gloo_test (env RANK, WORLD_SIZE, MASTER_PORT; the test hosts the store) or by
// mpirun (comm_mpi_test). Modes (env DNALLM_TEST_MODE):
//   matrix: every collective x dtype x count x in/out of place, every element checked
//           against a closed form; exit 0 if all match, 1 otherwise (mismatches on stderr).
//   kill:   allreduce in a loop; rank DNALLM_TEST_VICTIM SIGKILLs itself during one; the
//           survivors must get Error(kPeerFailed): print it and exit 4.
//   groups: split (two halves; keys reversing the order; a rank in no group), all_to_all
//           with uneven and empty blocks in every dtype, send / recv (a ring, tags out of
//           order, a recv whose send comes late), each result checked element by element;
//           exit 0 and "groups OK" if all match, 1 otherwise.
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
#include "comm/make_communicator.hpp"
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

// ---------------------------------------------------------------- groups mode

// all_to_all element `idx` of the block that rank `src` sends to rank `dst`: exact in every
// dtype for world <= 4 (at most 127) as long as blocks hold at most 8 elements.
double a2a_value(int world, int src, int dst, size_t idx) {
  return static_cast<double>((src * world + dst) * 8) + static_cast<double>(idx);
}

// Runs one all_to_all where rank src sends count(src, dst) elements to dst; checks every
// element received.
template <typename Count>
void check_all_to_all(Communicator& comm, DType t, Count count, const std::string& what,
                      Checker& check) {
  const int me = comm.rank();
  const int world = comm.world_size();
  const size_t es = dtype_size(t);
  std::vector<int64_t> in_counts(static_cast<size_t>(world)), out_counts(in_counts);
  size_t n_in = 0, n_out = 0;
  for (int p = 0; p < world; ++p) {
    in_counts[static_cast<size_t>(p)] = count(me, p);
    out_counts[static_cast<size_t>(p)] = count(p, me);
    n_in += static_cast<size_t>(count(me, p));
    n_out += static_cast<size_t>(count(p, me));
  }
  std::vector<uint8_t> in(n_in * es + 1), out(n_out * es + 1);
  size_t at = 0;
  for (int p = 0; p < world; ++p)
    for (int64_t i = 0; i < count(me, p); ++i)
      store_element(t, in.data(), at++, a2a_value(world, me, p, static_cast<size_t>(i)));
  for (size_t i = 0; i < n_out; ++i) store_element(t, out.data(), i, -1);
  comm.all_to_all(BufferView{n_in ? in.data() : nullptr, n_in, t, {}}, in_counts,
                  BufferView{n_out ? out.data() : nullptr, n_out, t, {}}, out_counts)
      ->wait();
  at = 0;
  for (int p = 0; p < world; ++p)
    for (int64_t i = 0; i < count(p, me); ++i, ++at) {
      const double got = load_element(t, out.data(), at);
      const double want = a2a_value(world, p, me, static_cast<size_t>(i));
      check.expect(got == want, "all_to_all " + what + " " + dtype_name(t) + " from rank " +
                                    std::to_string(p) + " i=" + std::to_string(i) + " got " +
                                    std::to_string(got) + " want " + std::to_string(want));
    }
}

void run_splits(Communicator& comm, Checker& check) {
  const int me = comm.rank();
  const int world = comm.world_size();
  // Two halves (2 groups of 2 out of 4): an allreduce in each sums over its half only.
  const int color = me * 2 / world;
  auto half = comm.split(color, 0);
  check.expect(half != nullptr, "split: no communicator for color " + std::to_string(color));
  if (half) {
    std::vector<int> members;
    for (int r = 0; r < world; ++r)
      if (r * 2 / world == color) members.push_back(r);
    check.expect(half->world_size() == static_cast<int>(members.size()) &&
                     half->rank() == me - members.front(),
                 "split halves: rank " + std::to_string(half->rank()) + " of " +
                     std::to_string(half->world_size()));
    std::vector<float> buf(1031);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(value(me, i));
    half->allreduce(BufferView{buf.data(), buf.size(), DType::kFloat32, {}}, ReduceOp::kSum)
        ->wait();
    for (size_t i = 0; i < buf.size(); ++i) {
      double want = 0;
      for (int r : members) want += value(r, i);
      check.expect(buf[i] == static_cast<float>(want),
                   "allreduce in half " + std::to_string(color) + " i=" + std::to_string(i) +
                       " got " + std::to_string(buf[i]) + " want " + std::to_string(want));
    }
    // A ring inside the group: its ranks, not the parent's.
    if (half->world_size() > 1) {
      const int hr = half->rank(), hw = half->world_size();
      std::vector<int32_t> out(5), in(5, -1);
      for (size_t i = 0; i < out.size(); ++i) out[i] = me * 100 + static_cast<int32_t>(i);
      auto s = half->send(BufferView{out.data(), out.size(), DType::kInt32, {}}, (hr + 1) % hw, 0);
      half->recv(BufferView{in.data(), in.size(), DType::kInt32, {}}, (hr + hw - 1) % hw, 0)
          ->wait();
      s->wait();
      const int left = members[static_cast<size_t>((hr + hw - 1) % hw)];
      for (size_t i = 0; i < in.size(); ++i)
        check.expect(in[i] == left * 100 + static_cast<int32_t>(i), "ring in half");
    }
  }
  // Keys reversing the order: new rank = world - 1 - rank; an allgather shows the order.
  auto reversed = comm.split(7, world - me);
  check.expect(reversed && reversed->rank() == world - 1 - me && reversed->world_size() == world,
               "split with reversed keys");
  if (reversed) {
    std::vector<int64_t> all(static_cast<size_t>(world), -1);
    int64_t mine = me;
    reversed
        ->allgather(BufferView{&mine, 1, DType::kInt64, {}},
                    BufferView{all.data(), all.size(), DType::kInt64, {}})
        ->wait();
    for (int i = 0; i < world; ++i)
      check.expect(all[static_cast<size_t>(i)] == world - 1 - i,
                   "reversed group's rank " + std::to_string(i) + " is parent rank " +
                       std::to_string(all[static_cast<size_t>(i)]));
  }
  // A negative color joins no group; the others carry on without rank 0.
  auto rest = comm.split(me == 0 ? -1 : 3, me);
  if (me == 0) {
    check.expect(rest == nullptr, "negative color gave a communicator");
  } else {
    check.expect(rest && rest->world_size() == world - 1 && rest->rank() == me - 1,
                 "split without rank 0");
    if (rest) {
      int64_t one = me;
      rest->allreduce(BufferView{&one, 1, DType::kInt64, {}}, ReduceOp::kSum)->wait();
      check.expect(one == static_cast<int64_t>(world) * (world - 1) / 2,
                   "allreduce without rank 0: " + std::to_string(one));
    }
  }
  // The parent still works after its splits, with sub-groups alive beside it.
  int64_t total = 1;
  comm.allreduce(BufferView{&total, 1, DType::kInt64, {}}, ReduceOp::kSum)->wait();
  check.expect(total == world, "parent allreduce after splits");
}

void run_all_to_alls(Communicator& comm, Checker& check) {
  const int world = comm.world_size();
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt64,
                  DType::kFloat64, DType::kInt32, DType::kUInt8, DType::kInt8}) {
    // Rank r sends r + p + 1 elements to peer p.
    check_all_to_all(
        comm, t, [](int src, int dst) { return static_cast<int64_t>(src + dst + 1); }, "uneven",
        check);
    // Empty blocks: nothing to the next rank, nothing kept on rank 1, rank 0 sends nothing.
    check_all_to_all(
        comm, t,
        [world](int src, int dst) -> int64_t {
          if (src == 0 || dst == (src + 1) % world || (src == 1 && dst == 1)) return 0;
          return src + dst + 1;
        },
        "with empty blocks", check);
  }
}

void run_send_recv(Communicator& comm, bool has_store, Checker& check) {
  const int me = comm.rank();
  const int world = comm.world_size();
  if (world < 2) return;
  // A ring: every rank issues its send first. Would deadlock if a send waited for its
  // peer's recv before the recv was posted.
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kInt64, DType::kUInt8}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{100003}}) {
      const size_t es = dtype_size(t);
      std::vector<uint8_t> out(n * es + 1), in(n * es + 1);
      for (size_t i = 0; i < n; ++i) store_element(t, out.data(), i, (me + 1) * ((i % 50) + 1));
      for (size_t i = 0; i < n; ++i) store_element(t, in.data(), i, -1);
      const int right = (me + 1) % world, left = (me + world - 1) % world;
      auto s = comm.send(BufferView{out.data(), n, t, {}}, right, 5);
      auto r = comm.recv(BufferView{in.data(), n, t, {}}, left, 5);
      r->wait();
      s->wait();
      check.expect(r->is_completed() && s->is_completed(), "ring works not completed");
      for (size_t i = 0; i < n; ++i) {
        const double want = (left + 1) * static_cast<double>((i % 50) + 1);
        const double got = load_element(t, in.data(), i);
        check.expect(got == want,  // at most 200: exact in every dtype here
                     std::string("ring ") + dtype_name(t) + " n=" + std::to_string(n) +
                         " i=" + std::to_string(i) + " got " + std::to_string(got));
      }
    }
  }
  // Tags: rank 0 sends A (tag 1), B (tag 2), C (tag 1) to rank 1, which receives tag 2
  // first: tags pick the message, and the same tag keeps issue order.
  if (me == 0) {
    int64_t a = 111, b = 222, c = 333;
    std::vector<WorkPtr> works;
    works.push_back(comm.send(BufferView{&a, 1, DType::kInt64, {}}, 1, 1));
    works.push_back(comm.send(BufferView{&b, 1, DType::kInt64, {}}, 1, 2));
    works.push_back(comm.send(BufferView{&c, 1, DType::kInt64, {}}, 1, 1));
    for (auto& w : works) w->wait();
  } else if (me == 1) {
    int64_t x = 0, y = 0, z = 0;
    auto wx = comm.recv(BufferView{&x, 1, DType::kInt64, {}}, 0, 2);
    auto wy = comm.recv(BufferView{&y, 1, DType::kInt64, {}}, 0, 1);
    auto wz = comm.recv(BufferView{&z, 1, DType::kInt64, {}}, 0, 1);
    wz->wait();
    wy->wait();
    wx->wait();
    check.expect(x == 222 && y == 111 && z == 333, "tag order: got " + std::to_string(x) + " " +
                                                       std::to_string(y) + " " + std::to_string(z));
  }
  // A recv whose send is not issued yet: not completed, a short wait names the peer and
  // the tag; the send comes after a barrier and the recv completes.
  int64_t late = 0;
  WorkPtr pending;
  if (me == 1) {
    pending = comm.recv(BufferView{&late, 1, DType::kInt64, {}}, 0, 9);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    check.expect(!pending->is_completed(), "recv completed without a send");
    try {
      pending->wait(std::chrono::milliseconds(200));
      check.expect(false, "wait on an unmatched recv returned");
    } catch (const Error& e) {
      const std::string msg = e.what();
      check.expect(e.code() == ExitCode::kPeerFailed, "unmatched recv: wrong exit code");
      check.expect(msg.find("recv from rank 0 tag 9") != std::string::npos &&
                       msg.find("did not complete within 200 ms on rank 1") != std::string::npos &&
                       msg.find(has_store ? "rank 0 is alive but posted no matching send"
                                          : "no coordinator store to tell whether rank 0") !=
                           std::string::npos,
                   "unmatched recv message: " + msg);
    }
  }
  comm.barrier()->wait();
  if (me == 0) {
    int64_t v = 999;
    comm.send(BufferView{&v, 1, DType::kInt64, {}}, 1, 9)->wait();
  } else if (me == 1) {
    pending->wait();
    check.expect(late == 999, "late recv got " + std::to_string(late));
  }
  // Argument checks fail before anything is queued (and the communicator stays usable).
  int64_t dummy = 0;
  try {
    comm.send(BufferView{&dummy, 1, DType::kInt64, {}}, me, 0);
    check.expect(false, "send to self accepted");
  } catch (const Error& e) {
    check.expect(std::string(e.what()).find("is not another rank") != std::string::npos,
                 std::string("send to self: ") + e.what());
  }
}

// `has_store`: the ranks share a coordinator store (gloo; mpi under mpirun has none).
int run_groups(Communicator& comm, bool has_store) {
  Checker check{comm.rank()};
  run_all_to_alls(comm, check);
  run_send_recv(comm, has_store, check);
  run_splits(comm, check);
  comm.barrier()->wait();
  if (check.failures > 0) {
    std::cerr << "rank " << comm.rank() << ": " << check.failures << " mismatches\n";
    return 1;
  }
  std::cout << "rank " << comm.rank() << " backend " << comm.backend() << " world "
            << comm.world_size() << ": groups OK\n";
  return 0;
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
    if (mode && std::string(mode) == "groups") return run_groups(*comm, o.store != nullptr);
    run_matrix(*comm);
    return 0;
  } catch (const Error& e) {
    std::cerr << "ERROR code=" << e.exit_code() << ": " << e.what() << "\n";
    return e.exit_code();
  }
}
