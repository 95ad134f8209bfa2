#include "worker/parallel/plan.hpp"

#include <numeric>
#include <random>
#include <set>

#include <gtest/gtest.h>

namespace dnallm::parallel {
namespace {

// Checks the invariants every layout must satisfy, for any sizes and options.
void check_layout(const std::vector<int64_t>& numels, const LayoutOptions& opt) {
  FlatLayout l = plan_flat_layout(numels, opt);
  const int64_t n = static_cast<int64_t>(numels.size());
  ASSERT_EQ(static_cast<int64_t>(l.offsets.size()), n);
  // Every parameter is in exactly one bucket; buckets list parameters in reverse
  // registration order overall.
  std::vector<int64_t> order;
  for (const auto& b : l.buckets) order.insert(order.end(), b.params.begin(), b.params.end());
  std::vector<int64_t> expected(n);
  std::iota(expected.rbegin(), expected.rend(), 0);
  EXPECT_EQ(order, expected);
  // Buckets tile [0, padded_total) contiguously, and contain their parameters.
  int64_t cursor = 0;
  for (size_t bi = 0; bi < l.buckets.size(); ++bi) {
    const auto& b = l.buckets[bi];
    EXPECT_EQ(b.range.begin, cursor);
    int64_t bytes = 0;
    for (int64_t p : b.params) {
      EXPECT_GE(l.offsets[p], b.range.begin);
      EXPECT_LE(l.offsets[p] + numels[p], b.range.end);
      EXPECT_EQ(l.offsets[p] % opt.align_elements, 0);
      bytes += numels[p] * opt.element_bytes;
    }
    int64_t cap = bi == 0 ? opt.first_bucket_bytes : opt.bucket_cap_bytes;
    if (b.params.size() > 1) {
      EXPECT_LE(bytes, cap) << "bucket " << bi;
    }
    // Greedy: the next parameter would not have fit (except after the last bucket).
    if (bi + 1 < l.buckets.size()) {
      int64_t next = l.buckets[bi + 1].params.front();
      EXPECT_GT(bytes + numels[next] * opt.element_bytes, cap) << "bucket " << bi;
    }
    cursor = b.range.end;
  }
  EXPECT_EQ(cursor, l.padded_total);
  EXPECT_EQ(l.padded_total % opt.world_size, 0);
  EXPECT_GE(l.padded_total, l.total);
  EXPECT_LT(l.padded_total - l.total, opt.world_size);
  // Parameters do not overlap.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t i = 0; i < n; ++i) spans.push_back({l.offsets[i], l.offsets[i] + numels[i]});
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first);
}

TEST(FlatLayout, SmallExampleClosedForm) {
  LayoutOptions opt;
  opt.element_bytes = 4;
  opt.first_bucket_bytes = 40;  // 10 elements
  opt.bucket_cap_bytes = 80;    // 20 elements
  opt.align_elements = 1;
  // Registration order sizes; buckets form over 4,3,2,1,0 = sizes 5,6,7,8,9.
  FlatLayout l = plan_flat_layout({9, 8, 7, 6, 5}, opt);
  ASSERT_EQ(l.buckets.size(), 3u);
  EXPECT_EQ(l.buckets[0].params, (std::vector<int64_t>{4}));     // 5 (+6 > 10)
  EXPECT_EQ(l.buckets[1].params, (std::vector<int64_t>{3, 2}));  // 6+7=13 (+8 > 20)
  EXPECT_EQ(l.buckets[2].params, (std::vector<int64_t>{1, 0}));  // 8+9=17
  EXPECT_EQ(l.offsets, (std::vector<int64_t>{26, 18, 11, 5, 0}));
  EXPECT_EQ(l.total, 35);
  EXPECT_EQ(l.buckets[1].range, (FlatRange{5, 18}));
}

TEST(FlatLayout, OversizedParameterGetsOwnBucket) {
  LayoutOptions opt;
  opt.first_bucket_bytes = 16;
  opt.bucket_cap_bytes = 16;
  opt.align_elements = 1;
  FlatLayout l = plan_flat_layout({1, 100, 1}, opt);
  ASSERT_EQ(l.buckets.size(), 3u);
  EXPECT_EQ(l.buckets[1].params, (std::vector<int64_t>{1}));
}

TEST(FlatLayout, EmptyAndZeroSizedParameters) {
  LayoutOptions opt;
  FlatLayout empty = plan_flat_layout({}, opt);
  EXPECT_TRUE(empty.buckets.empty());
  EXPECT_EQ(empty.padded_total, 0);
  check_layout({0, 3, 0}, opt);
}

TEST(FlatLayout, RandomizedInvariants) {
  std::mt19937_64 rng(123);
  for (int trial = 0; trial < 500; ++trial) {
    int n = static_cast<int>(rng() % 40) + 1;
    std::vector<int64_t> numels(n);
    for (auto& x : numels) x = static_cast<int64_t>(rng() % 5000);
    LayoutOptions opt;
    opt.element_bytes = (rng() % 2) ? 4 : 2;
    opt.first_bucket_bytes = 1 + static_cast<int64_t>(rng() % 4000);
    opt.bucket_cap_bytes = 1 + static_cast<int64_t>(rng() % 20000);
    opt.align_elements = 1 + static_cast<int64_t>(rng() % 32);
    opt.world_size = 1 + static_cast<int64_t>(rng() % 7);
    check_layout(numels, opt);
    if (::testing::Test::HasFailure()) {
      FAIL() << "trial " << trial;
    }
  }
}

TEST(FlatLayout, IdenticalOnEveryRank) {
  // Same sizes -> same plan, independent of anything else (launch order contract).
  LayoutOptions opt;
  opt.world_size = 3;
  std::vector<int64_t> sizes = {1000, 20, 300000, 7, 65536};
  FlatLayout a = plan_flat_layout(sizes, opt);
  FlatLayout b = plan_flat_layout(sizes, opt);
  ASSERT_EQ(a.buckets.size(), b.buckets.size());
  for (size_t i = 0; i < a.buckets.size(); ++i) {
    EXPECT_EQ(a.buckets[i].params, b.buckets[i].params);
    EXPECT_EQ(a.buckets[i].range, b.buckets[i].range);
  }
}

TEST(ShardRange, PartitionsExactly) {
  for (int64_t world = 1; world <= 9; ++world) {
    int64_t total = world * 37;
    int64_t cursor = 0;
    for (int64_t r = 0; r < world; ++r) {
      FlatRange s = shard_range(total, world, r);
      EXPECT_EQ(s.begin, cursor);
      EXPECT_EQ(s.size(), 37);
      cursor = s.end;
    }
    EXPECT_EQ(cursor, total);
  }
  EXPECT_THROW(shard_range(10, 3, 0), std::exception);
  EXPECT_THROW(shard_range(9, 3, 3), std::exception);
}

TEST(ShardRange, Intersect) {
  EXPECT_EQ(intersect({0, 10}, {5, 20}), (FlatRange{5, 10}));
  EXPECT_EQ(intersect({0, 10}, {10, 20}).size(), 0);
  EXPECT_EQ(intersect({5, 8}, {0, 100}), (FlatRange{5, 8}));
}

TEST(MemoryAccount, MatchesZeroPaper) {
  const int64_t psi = 1'000'000;
  for (int64_t n : {1, 2, 4, 8, 64}) {
    MemoryAccount ddp = account_memory(psi, cfg::Precision::kBf16, 0, n);
    EXPECT_EQ(ddp.total(), 16 * psi);
    MemoryAccount z1 = account_memory(psi, cfg::Precision::kBf16, 1, n);
    EXPECT_EQ(z1.total(), 4 * psi + (12 * psi + n - 1) / n);
    MemoryAccount z2 = account_memory(psi, cfg::Precision::kBf16, 2, n);
    EXPECT_EQ(z2.params, 2 * psi);
    EXPECT_EQ(z2.grads + z2.optimizer, (2 * psi + n - 1) / n + (12 * psi + n - 1) / n);
  }
  // fp32 keeps no separate master copy: 4 + 4 + 8.
  EXPECT_EQ(account_memory(psi, cfg::Precision::kFp32, 0, 4).total(), 16 * psi);
  EXPECT_EQ(account_memory(psi, cfg::Precision::kFp32, 2, 4).total(), 4 * psi + psi + 2 * psi);
  // Stage 3: everything / N.
  EXPECT_EQ(account_memory(psi, cfg::Precision::kFp32, 3, 4).total(), 4 * psi);
  EXPECT_EQ(account_memory(psi, cfg::Precision::kBf16, 3, 8).total(), 2 * psi);
  EXPECT_THROW(account_memory(psi, cfg::Precision::kFp32, 4, 4), std::exception);
}

TEST(UnitShards, EveryElementOwnedOnceAndChunksEqual) {
  // Note [Fully sharded layout], exhaustively for small shapes: the owned ranges of all ranks
  // tile the global layout exactly, each unit's chunk is the same on every rank and covers
  // it, and the local offsets are the running sum of the chunks.
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t world = 1 + static_cast<int64_t>(rng() % 6);
    std::vector<int64_t> units(1 + rng() % 6);
    for (auto& n : units) n = static_cast<int64_t>(rng() % 40);  // 0 and < world included
    int64_t total = 0;
    for (auto n : units) total += n;
    std::vector<int> owners(static_cast<size_t>(total), 0);
    for (int64_t r = 0; r < world; ++r) {
      const auto plan = plan_unit_shards(units, world, r);
      ASSERT_EQ(plan.size(), units.size());
      int64_t begin = 0, local = 0;
      for (size_t u = 0; u < units.size(); ++u) {
        EXPECT_EQ(plan[u].begin, begin);
        EXPECT_EQ(plan[u].numel, units[u]);
        EXPECT_EQ(plan[u].chunk * world >= units[u], true);
        EXPECT_LT((plan[u].chunk - 1) * world, std::max<int64_t>(units[u], 1));
        EXPECT_EQ(plan[u].local_offset, local);
        EXPECT_LE(plan[u].owned.size(), plan[u].chunk);
        EXPECT_EQ(plan[u].owned.begin, begin + std::min(units[u], r * plan[u].chunk));
        for (int64_t i = plan[u].owned.begin; i < plan[u].owned.end; ++i) ++owners[size_t(i)];
        begin += units[u];
        local += plan[u].chunk;
      }
    }
    for (int c : owners) ASSERT_EQ(c, 1);
  }
  // A closed form: units of 10 and 3 over 4 ranks.
  const auto r3 = plan_unit_shards({10, 3}, 4, 3);
  EXPECT_EQ(r3[0].chunk, 3);
  EXPECT_EQ(r3[0].owned, (FlatRange{9, 10}));
  EXPECT_EQ(r3[1].chunk, 1);
  EXPECT_EQ(r3[1].local_offset, 3);
  EXPECT_EQ(r3[1].owned.size(), 0);
  EXPECT_THROW(plan_unit_shards({4}, 2, 2), std::exception);
}

}  // namespace
}  // namespace dnallm::parallel
