// Note [Staged collectives] with a real Gloo world of 2 ranks in one process (threads, an
// in-memory store): every collective through the staging thread gives the closed-form
// result, in issue order, and a failure reaches the waiter and breaks later collectives.
// On CPU the staging copies host buffers (StagingOptions::stage_host_buffers); the CUDA
// variant runs only where LibTorch sees a GPU (two ranks sharing it, as share_gpus does).
#include "worker/parallel/device_group.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

#include "comm/make_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "tests/comm/counting_communicator.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/train/device_stats.hpp"

namespace dnallm::parallel {
namespace {

using dnallm::testing::expect_error;

// At start, before anything asks LibTorch about CUDA: loads the CUDA plugin where a GPU
// shows (Note [Lazy CUDA] in core/cuda_plugin.hpp).
const bool kCuda = train::cuda_usable("auto", "the device tests");

BufferView view(const torch::Tensor& t) {
  BufferView v;
  v.data = t.data_ptr();
  v.count = static_cast<size_t>(t.numel());
  v.dtype = t.scalar_type() == torch::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  v.device = comm_device(t.device());
  return v;
}

BufferView slice(const torch::Tensor& t, int64_t begin, int64_t count) {
  BufferView v = view(t);
  v.data = static_cast<char*>(v.data) + begin * static_cast<int64_t>(t.element_size());
  v.count = static_cast<size_t>(count);
  return v;
}

// Runs `body(rank, communicator)` on 2 ranks, each a staging communicator over gloo.
void on_two_ranks(const torch::Device& device, std::chrono::milliseconds timeout,
                  const std::function<void(int, comm::Communicator&)>& body) {
  if (!comm::backend_available("gloo")) GTEST_SKIP() << "gloo was not built";
  auto store = std::make_shared<coordinator::InMemoryStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        comm::CommOptions o;
        o.backend = "gloo";
        o.rank = r;
        o.world_size = 2;
        o.store = store;
        o.loopback = true;
        o.timeout = timeout;
        o.name = "staged";
        StagingOptions so;
        so.stage_host_buffers = !device.is_cuda();
        auto comm = stage_for_device(comm::make_communicator(o), device, so);
        body(r, *comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Every collective, issued all at once before any wait (as DDP's hooks do), then checked
// against closed-form values: rank r contributes (r + 1) * (i + 1) at element i.
void check_collectives(const torch::Device& device) {
  on_two_ranks(device, std::chrono::seconds(20), [&](int r, comm::Communicator& c) {
    auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    const auto ramp = torch::arange(1, 8, opts);  // 1..7: 7 elements, uneven shards
    torch::Tensor in_place = ramp * (r + 1);
    torch::Tensor src = ramp * (r + 1), dst = torch::zeros({7}, opts);
    torch::Tensor scatter = ramp * (r + 1);
    const auto shard = comm::shard_range(7, 2, r);
    torch::Tensor gather = torch::zeros({7}, opts);
    gather.narrow(0, shard.offset, shard.count).fill_(r + 1);
    torch::Tensor bcast = torch::full({5}, double(r + 10), opts);
    double scalar = r + 1.0;
    std::vector<comm::WorkPtr> works;
    works.push_back(c.allreduce(view(in_place), comm::ReduceOp::kSum));
    works.push_back(c.allreduce(view(src), view(dst), comm::ReduceOp::kMax));
    works.push_back(c.reduce_scatter(view(scatter), slice(scatter, shard.offset, shard.count),
                                     comm::ReduceOp::kSum));
    works.push_back(c.allgather(slice(gather, shard.offset, shard.count), view(gather)));
    works.push_back(c.broadcast(view(bcast), 1));
    works.push_back(
        c.allreduce(BufferView{&scalar, 1, DType::kFloat64, Device{}}, comm::ReduceOp::kSum));
    works.push_back(c.barrier());
    for (auto& w : works) w->wait();
    const auto cpu = [](const torch::Tensor& t) { return t.to(torch::kCPU); };
    EXPECT_TRUE(cpu(in_place).equal(cpu(ramp) * 3));
    EXPECT_TRUE(cpu(dst).equal(cpu(ramp) * 2));
    EXPECT_TRUE(cpu(scatter)
                    .narrow(0, shard.offset, shard.count)
                    .equal(cpu(ramp).narrow(0, shard.offset, shard.count) * 3));
    const auto s0 = comm::shard_range(7, 2, 0);
    auto expect_gather = torch::full({7}, 2.0f);
    expect_gather.narrow(0, s0.offset, s0.count).fill_(1.0f);
    EXPECT_TRUE(cpu(gather).equal(expect_gather)) << cpu(gather);
    EXPECT_TRUE(cpu(bcast).equal(torch::full({5}, 11.0f)));
    EXPECT_EQ(scalar, 3.0);
  });
}

TEST(StagedCollectives, HostStagingGivesClosedFormResultsInIssueOrder) {
  check_collectives(torch::kCPU);
}

TEST(StagedCollectives, AllToAllPointToPointAndSplitGoThroughTheStaging) {
  // The operations context parallelism needs (issue 26), staged like the collectives.
  on_two_ranks(torch::kCPU, std::chrono::seconds(20), [&](int r, comm::Communicator& c) {
    // all_to_all, uneven: rank r sends r + p + 1 elements to peer p, valued 100 r + 10 p + i.
    std::vector<int64_t> in_counts, out_counts;
    std::vector<float> in;
    for (int p = 0; p < 2; ++p) {
      in_counts.push_back(r + p + 1);
      out_counts.push_back(p + r + 1);
      for (int i = 0; i < r + p + 1; ++i) in.push_back(float(100 * r + 10 * p + i));
    }
    auto in_t = torch::tensor(in);
    auto out_t = torch::zeros({out_counts[0] + out_counts[1]});
    c.all_to_all(view(in_t), in_counts, view(out_t), out_counts)->wait();
    int64_t at = 0;
    for (int p = 0; p < 2; ++p) {
      for (int i = 0; i < p + r + 1; ++i) {
        EXPECT_EQ(out_t[at++].item<float>(), float(100 * p + 10 * r + i)) << "from " << p;
      }
    }
    // send/recv as a chain: rank 0 sends, rank 1 receives and answers doubled.
    auto msg = torch::arange(1, 6).to(torch::kFloat32);
    auto got = torch::zeros({5});
    if (r == 0) {
      c.send(view(msg), 1, 7)->wait();
      c.recv(view(got), 1, 8)->wait();
      EXPECT_TRUE(got.equal(msg * 2)) << got;
    } else {
      c.recv(view(got), 0, 7)->wait();
      EXPECT_TRUE(got.equal(msg)) << got;
      auto answer = got * 2;
      c.send(view(answer), 0, 8)->wait();
    }
    // split: both ranks in one group, keys reversed (group rank 1 - r), then an allreduce in it.
    auto group = c.split(0, 1 - r);
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(group->rank(), 1 - r);
    EXPECT_EQ(group->world_size(), 2);
    auto v = torch::full({3}, float(r + 1));
    group->allreduce(view(v), comm::ReduceOp::kSum)->wait();
    EXPECT_TRUE(v.equal(torch::full({3}, 3.0f))) << v;
  });
}

TEST(StagedCollectives, ManyQueuedBucketsKeepTheirOrder) {
  // 40 allreduces issued without waiting, each a different size: a reordering anywhere
  // would pair different collectives across ranks and fail or mix values.
  on_two_ranks(torch::kCPU, std::chrono::seconds(20), [](int r, comm::Communicator& c) {
    std::vector<torch::Tensor> buckets;
    std::vector<comm::WorkPtr> works;
    for (int i = 0; i < 40; ++i) {
      buckets.push_back(torch::full({i + 1}, float(i * 2 + r)));
      works.push_back(c.allreduce(view(buckets.back()), comm::ReduceOp::kSum));
    }
    for (int i = 0; i < 40; ++i) {
      works[i]->wait();
      EXPECT_TRUE(buckets[i].equal(torch::full({i + 1}, float(i * 4 + 1)))) << i;
    }
  });
}

TEST(StagedCollectives, AFailureReachesTheWaiterAndBreaksTheCommunicator) {
  // Rank 1 issues one collective fewer: rank 0's last one times out in gloo, the error
  // comes back through the staged Work, and the next collective fails at once.
  on_two_ranks(torch::kCPU, std::chrono::milliseconds(800), [](int r, comm::Communicator& c) {
    torch::Tensor t = torch::ones({4});
    c.allreduce(view(t), comm::ReduceOp::kSum)->wait();
    if (r == 1) return;
    expect_error([&] { c.allreduce(view(t), comm::ReduceOp::kSum)->wait(); },
                 ExitCode::kPeerFailed);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THROW(c.allreduce(view(t), comm::ReduceOp::kSum)->wait(), Error);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  });
}

TEST(StagedCollectives, NothingToStageOnCpuReturnsTheBackendItself) {
  if (!comm::backend_available("gloo")) GTEST_SKIP() << "gloo was not built";
  comm::CommOptions o;
  o.backend = "gloo";
  o.store = std::make_shared<coordinator::InMemoryStore>();
  o.loopback = true;
  auto inner = comm::make_communicator(o);
  comm::Communicator* raw = inner.get();
  EXPECT_EQ(stage_for_device(std::move(inner), torch::kCPU).get(), raw);
}

// Note [Stream-ordered wait]: over nccl, device buffers are not staged and the caller gets
// NCCL's own Work, so wait_stream() reaches it and the host does not wait.
TEST(StagedCollectives, NcclDeviceBuffersGetTheBackendsWorkForAStreamWait) {
  auto inner = std::make_unique<comm::testing::CountingCommunicator>("nccl", 0, 2);
  auto counts = inner->counts();
  auto c = stage_for_device(std::move(inner), torch::kCPU);
  std::vector<float> a(8), shard(4);
  const Device gpu{DeviceType::kCUDA, 0};  // never dereferenced by the fake
  const BufferView va{a.data(), a.size(), DType::kFloat32, gpu};
  const BufferView vs{shard.data(), shard.size(), DType::kFloat32, gpu};
  c->allgather(vs, va)->wait_stream();
  c->reduce_scatter(va, vs, comm::ReduceOp::kSum)->wait_stream();
  c->allreduce(va, comm::ReduceOp::kSum)->wait_stream();
  c->broadcast(va, 0)->wait_stream();
  EXPECT_EQ(counts->issued.load(), 4);
  EXPECT_EQ(counts->stream.load(), 4);
  EXPECT_EQ(counts->host.load(), 0);
}

// A staged collective's result comes back through the staging thread's copy: wait_stream()
// waits on the host for it (the backend's Work is host-waited by the staging thread), and the
// caller's buffer holds the result when it returns.
TEST(StagedCollectives, AStagedWaitStreamWaitsOnTheHostForTheCopyBack) {
  auto inner = std::make_unique<comm::testing::CountingCommunicator>("gloo", 1, 2);
  auto counts = inner->counts();
  StagingOptions so;
  so.stage_host_buffers = true;
  auto c = stage_for_device(std::move(inner), torch::kCPU, so);
  constexpr int64_t kShard = 1 << 20;  // a copy back long enough to be seen if not waited for
  for (int i = 0; i < 5; ++i) {
    torch::Tensor mine = torch::full({kShard}, float(i + 1)), all = torch::zeros({2 * kShard});
    c->allgather(view(mine), view(all))->wait_stream();
    EXPECT_TRUE(all.narrow(0, kShard, kShard).equal(mine)) << "try " << i;
  }
  EXPECT_EQ(counts->issued.load(), 5);
  EXPECT_EQ(counts->host.load(), 5);  // by the staging thread
  EXPECT_EQ(counts->stream.load(), 0);
}

TEST(RankDevice, CpuStaysCpuAndCudaWithoutAGpuIsAUsageError) {
  Config config;
  config.training.device = cfg::Device::kCpu;
  auto d = select_rank_device(config, 1, 4);  // any local layout is fine on the CPU
  EXPECT_TRUE(d.device.is_cpu());
  EXPECT_FALSE(d.shared);
  if (kCuda) return;
  config.training.device = cfg::Device::kCuda;
  expect_error([&] { select_rank_device(config, 0, 1); }, ExitCode::kUsage);
}

// GPU: two ranks sharing one GPU (parallel.share_gpus) reduce CUDA buffers through pinned
// host memory.
TEST(StagedCollectivesGpu, TwoRanksShareOneGpuThroughHostMemory) {
  if (!kCuda) GTEST_SKIP() << "no CUDA device: LibTorch sees no GPU here";
  check_collectives(torch::Device(torch::kCUDA, 0));
}

// Note [Stream-ordered wait] on the device: NCCL at world size 1 (an all-gather is a copy on
// the communicator's stream). The collective is issued behind ~tens of ms of matrix products
// on the default stream, so it cannot be done when wait_stream() returns; a kernel queued
// right after must still read its output. Without the stream wait it runs beside the copy.
TEST(StagedCollectivesGpu, NcclWaitStreamOrdersTheDefaultStreamAfterTheCollective) {
  if (!kCuda) GTEST_SKIP() << "no CUDA device: LibTorch sees no GPU here";
  if (!comm::backend_available("nccl")) GTEST_SKIP() << "the CUDA plugin has no nccl";
  comm::CommOptions o;
  o.backend = "nccl";
  o.store = std::make_shared<coordinator::InMemoryStore>();
  o.device = Device{DeviceType::kCUDA, 0};
  o.name = "stream_wait";
  o.timeout = std::chrono::seconds(60);
  auto comm = comm::make_communicator(o);
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA, 0);
  const torch::Tensor m = torch::rand({2048, 2048}, opts);
  int went_on = 0;
  for (int i = 0; i < 5; ++i) {
    torch::Tensor busy = m;
    for (int k = 0; k < 40; ++k) busy = torch::mm(busy, m) / 2048;
    // Written on the default stream behind the products: NCCL reads it after them.
    const torch::Tensor src = busy.sum() * 0 + float(i + 3);
    torch::Tensor src_full = src.expand({1 << 24}).contiguous(), out = torch::zeros_like(src_full);
    auto work = comm->allgather(view(src_full), view(out));
    work->wait_stream();
    went_on += work->is_completed() ? 0 : 1;  // informative: the host did not wait
    const torch::Tensor doubled = out * 2;    // queued after the wait
    EXPECT_EQ(doubled.min().item<float>(), 2.0f * float(i + 3)) << "try " << i;
    EXPECT_EQ(doubled.max().item<float>(), 2.0f * float(i + 3)) << "try " << i;
  }
  std::printf("wait_stream returned before the collective completed in %d of 5 tries\n", went_on);
}

TEST(RankDeviceGpu, IndexedCurrentDeviceAndTooManyRanks) {
  if (!kCuda) GTEST_SKIP() << "no CUDA device: LibTorch sees no GPU here";
  const int gpus = static_cast<int>(torch::cuda::device_count());
  Config config;
  config.training.device = cfg::Device::kCuda;
  auto d = select_rank_device(config, gpus - 1, gpus);
  EXPECT_TRUE(d.device.is_cuda());
  EXPECT_EQ(d.device.index(), gpus - 1);
  EXPECT_FALSE(d.shared);
  try {
    select_rank_device(config, 0, gpus + 1);
    FAIL() << gpus + 1 << " ranks accepted on " << gpus << " GPU(s)";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find(std::to_string(gpus + 1) + " ranks"), std::string::npos);
  }
  config.parallel.share_gpus = true;
  auto shared = select_rank_device(config, gpus, gpus + 1);
  EXPECT_TRUE(shared.shared);
  EXPECT_EQ(shared.device.index(), 0);
  select_rank_device(config, 0, 1);  // leave cuda:0 current
}

}  // namespace
}  // namespace dnallm::parallel
