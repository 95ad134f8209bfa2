// Pure pieces of comm/: shard ranges, all_to_all layouts, split membership, 16-bit
// conversions, CPU reductions, the factory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "comm/bootstrap.hpp"
#include "comm/communicator.hpp"
#include "comm/detail/cpu_reduce.hpp"
#include "comm/half.hpp"
#include "comm/make_communicator.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::comm {
namespace {

using dnallm::testing::expect_error;

// Note [Store bind address], table-driven: (MASTER_ADDR, its resolution here, override)
// -> the address rank 0's store listens on, and whether a warning explains 0.0.0.0.
TEST(StoreBind, NeverEveryInterfaceSilently) {
  struct Case {
    std::string master, resolved, override_addr, expect;
    bool warns;
  };
  const Case cases[] = {
      {"127.0.0.1", "", "", "127.0.0.1", false},
      {"localhost", "", "", "127.0.0.1", false},
      {"127.0.0.2", "", "", "127.0.0.2", false},
      {"10.0.0.1", "10.0.0.1", "", "10.0.0.1", false},
      {"node01", "192.168.1.7", "", "192.168.1.7", false},
      {"node01", "127.0.1.1", "", "0.0.0.0", true},  // Debian's /etc/hosts entry
      {"node01", "127.0.1.1", "192.168.1.7", "192.168.1.7", false},
      {"10.0.0.1", "10.0.0.1", "0.0.0.0", "0.0.0.0", false},  // asked for explicitly
      {"nosuchhost", "", "", "nosuchhost", false},            // bind() names the problem
  };
  for (const auto& c : cases) {
    std::string warning;
    EXPECT_EQ(comm::store_bind_address(c.master, c.resolved, c.override_addr, &warning), c.expect)
        << c.master << " -> " << c.resolved;
    EXPECT_EQ(!warning.empty(), c.warns) << c.master << ": " << warning;
    if (c.warns) {
      EXPECT_NE(warning.find("DNALLM_STORE_BIND"), std::string::npos) << warning;
    }
  }
}

TEST(ShardRange, CoversEveryElementOnceAndIsBalanced) {
  for (size_t n : {0, 1, 3, 7, 8, 13, 1000, 1031}) {
    for (int w = 1; w <= 9; ++w) {
      size_t next = 0, lo = n, hi = 0;
      for (int r = 0; r < w; ++r) {
        auto s = shard_range(n, w, r);
        EXPECT_EQ(s.offset, next) << n << " " << w << " " << r;
        next += s.count;
        lo = std::min(lo, s.count);
        hi = std::max(hi, s.count);
      }
      EXPECT_EQ(next, n);
      EXPECT_LE(hi - lo, 1u);
    }
  }
  EXPECT_EQ(shard_range(7, 3, 0).count, 3u);
  EXPECT_EQ(shard_range(7, 3, 2).offset, 5u);
}

// An Error's message, or "" when `fn` did not throw one.
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kFailure) << e.what();
    return e.what();
  }
  return "";
}

TEST(AllToAllLayout, OffsetsAreRunningSumsOfTheCounts) {
  // Rank 1 of 4: sends 2, 0, 3, 1 and receives 4, 0, 0, 5 (blocks may be empty).
  const auto l = all_to_all_layout("gloo", 4, 1, 6, {2, 0, 3, 1}, 9, {4, 0, 0, 5});
  EXPECT_EQ(l.in_offsets, (std::vector<size_t>{0, 2, 2, 5, 6}));
  EXPECT_EQ(l.out_offsets, (std::vector<size_t>{0, 4, 4, 4, 9}));
  // Nothing at all to move is fine, including the kept block.
  const auto none = all_to_all_layout("mpi", 2, 0, 0, {0, 0}, 0, {0, 0});
  EXPECT_EQ(none.in_offsets, (std::vector<size_t>{0, 0, 0}));
}

TEST(AllToAllLayout, BadCountsAreNamedWithTheRank) {
  std::string msg = error_of([] { all_to_all_layout("gloo", 3, 2, 3, {1, 2}, 3, {1, 1, 1}); });
  EXPECT_NE(msg.find("gloo all_to_all on rank 2: in_counts has 2 counts, expected one per rank "
                     "(3)"),
            std::string::npos)
      << msg;
  msg = error_of([] { all_to_all_layout("mpi", 2, 0, 2, {1, 1}, 2, {1, 1, 0}); });
  EXPECT_NE(msg.find("out_counts has 3 counts"), std::string::npos) << msg;
  msg = error_of([] { all_to_all_layout("gloo", 2, 0, 1, {2, -1}, 2, {2, 0}); });
  EXPECT_NE(msg.find("in_counts[1] = -1 is negative"), std::string::npos) << msg;
  msg = error_of([] { all_to_all_layout("gloo", 2, 0, 5, {1, 3}, 2, {1, 1}); });
  EXPECT_NE(msg.find("in_counts add up to 4 elements but the buffer holds 5"), std::string::npos)
      << msg;
  msg = error_of([] { all_to_all_layout("gloo", 2, 1, 2, {1, 1}, 3, {1, 2}); });
  EXPECT_NE(msg.find("the block kept here differs in size: in_counts[1] = 1, out_counts[1] = 2"),
            std::string::npos)
      << msg;
}

TEST(SplitMembers, SameColorOrderedByKeyThenRank) {
  //                     rank: 0  1  2  3  4   5
  const std::vector<int> colors{0, 1, 0, 1, -1, 0};
  const std::vector<int> keys{5, 0, 5, 1, 0, 2};
  EXPECT_EQ(split_members(colors, keys, 0), (std::vector<int>{5, 0, 2}));  // 0 and 2 tie: rank
  EXPECT_EQ(split_members(colors, keys, 2), (std::vector<int>{5, 0, 2}));
  EXPECT_EQ(split_members(colors, keys, 3), (std::vector<int>{1, 3}));
  EXPECT_TRUE(split_members(colors, keys, 4).empty());  // a negative color: no group
  // Keys reversing the order.
  EXPECT_EQ(split_members({0, 0, 0, 0}, {4, 3, 2, 1}, 1), (std::vector<int>{3, 2, 1, 0}));
}

TEST(SplitMembers, EveryRankLandsInExactlyOneConsistentGroup) {
  uint32_t seed = 12345;
  auto next = [&](int n) {
    seed = seed * 1103515245u + 12345u;
    return static_cast<int>((seed >> 16) % static_cast<uint32_t>(n));
  };
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 1 + next(9);
    std::vector<int> colors(static_cast<size_t>(world)), keys(colors.size());
    for (int r = 0; r < world; ++r) {
      colors[static_cast<size_t>(r)] = next(4) - 1;  // -1 .. 2
      keys[static_cast<size_t>(r)] = next(3);
    }
    for (int r = 0; r < world; ++r) {
      const auto members = split_members(colors, keys, r);
      const int color = colors[static_cast<size_t>(r)];
      if (color < 0) {
        EXPECT_TRUE(members.empty());
        continue;
      }
      // Every member of my group computes the same list, and it holds every rank of my color.
      int with_color = 0;
      for (int q = 0; q < world; ++q) with_color += colors[static_cast<size_t>(q)] == color;
      EXPECT_EQ(members.size(), static_cast<size_t>(with_color));
      EXPECT_EQ(std::count(members.begin(), members.end(), r), 1);
      for (int q : members) EXPECT_EQ(split_members(colors, keys, q), members);
      for (size_t i = 1; i < members.size(); ++i) {
        const auto a = static_cast<size_t>(members[i - 1]), b = static_cast<size_t>(members[i]);
        EXPECT_TRUE(keys[a] < keys[b] || (keys[a] == keys[b] && a < b));
      }
    }
  }
  EXPECT_EQ(split_name("train", 2, 1), "train.split2.c1");
}

TEST(Half, Fp16RoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = fp16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_fp16(f), h) << h;
  }
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f)), 1.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_to_float(float_to_fp16(1e6f))));
  // Ties round to even: 2049 lies between 2048 and 2050 in fp16.
  EXPECT_EQ(fp16_to_float(float_to_fp16(2049.0f)), 2048.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(2051.0f)), 2052.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
}

TEST(Half, Bf16RoundTripsEveryValueAndRoundsToEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_bf16(f), h) << h;
  }
  EXPECT_EQ(bf16_to_float(float_to_bf16(257.0f)), 256.0f);  // tie -> even
  EXPECT_EQ(bf16_to_float(float_to_bf16(259.0f)), 260.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TEST(CpuReduce, SumMaxDivideForEveryType) {
  float a[3] = {1, 5, -2}, b[3] = {2, 3, -1}, o[3];
  detail::reduce_elements(DType::kFloat32, ReduceOp::kSum, o, a, b, 3);
  EXPECT_EQ(o[0], 3);
  EXPECT_EQ(o[2], -3);
  detail::reduce_elements(DType::kFloat32, ReduceOp::kMax, o, a, b, 3);
  EXPECT_EQ(o[1], 5);
  EXPECT_EQ(o[2], -1);
  uint16_t x[2] = {float_to_bf16(1.5f), float_to_bf16(100.0f)};
  uint16_t y[2] = {float_to_bf16(2.5f), float_to_bf16(-3.0f)};
  detail::reduce_elements(DType::kBFloat16, ReduceOp::kSum, x, x, y, 2);
  EXPECT_EQ(bf16_to_float(x[0]), 4.0f);
  EXPECT_EQ(bf16_to_float(x[1]), 97.0f);
  int64_t i[2] = {7, -7};
  detail::divide_elements(DType::kInt64, i, 2, 2);
  EXPECT_EQ(i[0], 3);
  EXPECT_EQ(i[1], -3);
  uint16_t h[1] = {float_to_fp16(3.0f)};
  detail::divide_elements(DType::kFloat16, h, 1, 4);
  EXPECT_EQ(fp16_to_float(h[0]), 0.75f);
}

TEST(Factory, UnknownBackendIsUsageError) {
  CommOptions o;
  o.backend = "carrier-pigeon";
  expect_error([&] { make_communicator(o); }, ExitCode::kUsage);
  EXPECT_THROW(parse_reduce_op("min"), Error);
}

TEST(Factory, AutoPicksMpiUnderMpirunElseGloo) {
  CommOptions o;
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(resolve_backend(o), "gloo");
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  EXPECT_EQ(resolve_backend(o), backend_available("mpi") ? "mpi" : "gloo");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  o.device = Device{DeviceType::kCUDA, 0};
  EXPECT_EQ(resolve_backend(o), backend_available("nccl") ? "nccl" : "gloo");
}

TEST(Factory, RanksSharingAGpuNeverPickNccl) {
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  CommOptions o;
  o.device = Device{DeviceType::kCUDA, 0};
  o.device_shared = true;  // parallel.share_gpus put two ranks on this GPU
  EXPECT_EQ(resolve_backend(o), "gloo");
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  EXPECT_EQ(resolve_backend(o), backend_available("mpi") ? "mpi" : "gloo");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  // Asking for nccl there is a usage error that says what to do, built with NCCL or not
  // (checked before the CUDA plugin is looked for).
  o.backend = "nccl";
  expect_error([&] { make_communicator(o); }, ExitCode::kUsage, {"two ranks on one GPU"});
}

TEST(Factory, NcclOnTheCpuSaysWhatToSet) {
  CommOptions o;
  o.backend = "nccl";  // device stays the CPU
  expect_error([&] { make_communicator(o); }, ExitCode::kUsage, {"parallel.backend = \"auto\""});
}

// Note [Lazy CUDA]: the CUDA plugin registers nccl when it is loaded; make_communicator then
// makes it through the registry, after the same checks of the options.
int fake_made = 0;
TEST(Factory, ARegisteredBackendIsMadeThroughTheRegistry) {
  register_backend("nccl", [](const CommOptions& o) -> std::unique_ptr<Communicator> {
    fake_made = o.device.index + 1;
    return nullptr;
  });
  EXPECT_TRUE(backend_available("nccl"));
  CommOptions o;
  o.device = Device{DeviceType::kCUDA, 3};
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(resolve_backend(o), "nccl");
  EXPECT_EQ(make_communicator(o), nullptr);
  EXPECT_EQ(fake_made, 4);
  o.device_shared = true;  // the checks still come first
  EXPECT_EQ(resolve_backend(o), "gloo");
  o.backend = "nccl";
  EXPECT_THROW(make_communicator(o), Error);
}

TEST(Factory, GlooNeedsAStore) {
  if (!backend_available("gloo")) GTEST_SKIP();
  CommOptions o;
  o.backend = "gloo";
  expect_error([&] { make_communicator(o); }, ExitCode::kUsage);
}

}  // namespace
}  // namespace dnallm::comm
