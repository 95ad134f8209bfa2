#include "worker/data/sampler.hpp"

#include <algorithm>
#include <set>

#include <gtest/gtest.h>

#include "core/error.hpp"

namespace dnallm::data {
namespace {

TEST(PermuteIndex, IsABijectionPerEpoch) {
  for (uint64_t n : {1ULL, 2ULL, 3ULL, 7ULL, 64ULL, 100ULL, 1000ULL, 4097ULL}) {
    std::vector<uint64_t> seen(n, 0);
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t j = permute_index(i, n, 42, 0);
      ASSERT_LT(j, n);
      ++seen[j];
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](uint64_t c) { return c == 1; })) << n;
  }
  // Different epochs and seeds give different orders.
  int same_epoch = 0, same_seed = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    same_epoch += permute_index(i, 1000, 42, 0) == permute_index(i, 1000, 42, 1);
    same_seed += permute_index(i, 1000, 42, 0) == permute_index(i, 1000, 43, 0);
  }
  EXPECT_LT(same_epoch, 50);
  EXPECT_LT(same_seed, 50);
}

// The positions of the global batch at `cursor`, gathered from every rank and micro-step.
std::vector<uint64_t> gather(uint64_t cursor, int world, int64_t mbs, int64_t accum) {
  std::vector<uint64_t> all;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(SamplerOptions{1000, 1, true, mbs, accum, r, world});
    for (int64_t m = 0; m < accum; ++m) {
      auto p = s.micro_batch_positions(cursor, m);
      all.insert(all.end(), p.begin(), p.end());
    }
  }
  return all;
}

TEST(DistributedSampler, GlobalBatchIndependentOfWorldSize) {
  auto one = gather(120, 1, 2, 6);
  EXPECT_EQ(one, gather(120, 2, 2, 3));
  EXPECT_EQ(one, gather(120, 3, 2, 2));
  EXPECT_EQ(one, gather(120, 6, 2, 1));
  std::vector<uint64_t> expected(12);
  for (uint64_t i = 0; i < 12; ++i) expected[i] = 120 + i;
  EXPECT_EQ(one, expected);
  // Rank 1 of 3 with accum 2 takes a contiguous slice.
  DistributedSampler s(SamplerOptions{1000, 1, true, 2, 2, 1, 3});
  EXPECT_EQ(s.micro_batch_positions(0, 0), (std::vector<uint64_t>{4, 5}));
  EXPECT_EQ(s.micro_batch_positions(0, 1), (std::vector<uint64_t>{6, 7}));
  EXPECT_EQ(s.global_batch_size(), 12u);
}

TEST(DistributedSampler, EpochsCoverTheDataset) {
  DistributedSampler s(SamplerOptions{10, 5, true, 1, 1, 0, 1});
  std::set<uint64_t> e0, e1;
  for (uint64_t p = 0; p < 10; ++p) e0.insert(s.resolve(p).index);
  for (uint64_t p = 10; p < 20; ++p) {
    EXPECT_EQ(s.resolve(p).epoch, 1u);
    e1.insert(s.resolve(p).index);
  }
  EXPECT_EQ(e0.size(), 10u);
  EXPECT_EQ(e1.size(), 10u);
}

TEST(DistributedSampler, StateJsonRoundTripAndBadOptions) {
  SamplerState st{7, 100, 250, true};
  EXPECT_EQ(st.epoch(), 2u);
  auto back = SamplerState::from_json(nlohmann::json::parse(st.to_json().dump()));
  EXPECT_EQ(back.seed, 7u);
  EXPECT_EQ(back.dataset_size, 100u);
  EXPECT_EQ(back.consumed_samples, 250u);
  EXPECT_EQ(st.to_json()["epoch"], 2);
  EXPECT_THROW(SamplerState::from_json(nlohmann::json{{"seed", 1}}), Error);
  EXPECT_THROW(DistributedSampler(SamplerOptions{10, 1, true, 1, 1, 2, 2}), Error);
  EXPECT_THROW(DistributedSampler(SamplerOptions{10, 1, true, 0, 1, 0, 1}), Error);
}

}  // namespace
}  // namespace dnallm::data
