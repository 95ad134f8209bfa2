// The micro-batch search and accumulation plan of training.batch_size = "auto", with a fake
// probe (the real trial forward/backward is tested in auto_batch_test.cpp).
#include "worker/train/batch_search.hpp"

#include <gtest/gtest.h>

#include <set>

#include "core/error.hpp"

namespace dnallm::train {
namespace {

// A fake device: a micro-batch fits when it is at most `limit`; records every size tried.
struct FakeProbe {
  int64_t limit;
  std::vector<int64_t> tried;
  MicroBatchProbe probe() {
    return [this](int64_t m) {
      tried.push_back(m);
      return m <= limit;
    };
  }
};

TEST(MicroBatchSearch, FindsTheLargestFittingSizeForEveryLimit) {
  for (int64_t max : {1, 2, 7, 8, 64, 100}) {
    for (int64_t limit = 1; limit <= 130; ++limit) {
      FakeProbe fake{limit, {}};
      auto r = search_micro_batch(fake.probe(), {1, max});
      EXPECT_EQ(r.largest_fit, std::min(limit, max)) << "limit " << limit << " max " << max;
      for (auto m : fake.tried) {
        EXPECT_LE(m, max) << "tried above max";
        EXPECT_GE(m, 1);
      }
      // No size is tried twice, and the trial log matches the probe's calls.
      EXPECT_EQ(std::set<int64_t>(fake.tried.begin(), fake.tried.end()).size(), fake.tried.size());
      ASSERT_EQ(r.trials.size(), fake.tried.size());
      for (size_t i = 0; i < r.trials.size(); ++i) {
        EXPECT_EQ(r.trials[i].first, fake.tried[i]);
        EXPECT_EQ(r.trials[i].second, fake.tried[i] <= limit);
      }
      // Doubling then bisection: logarithmic in the answer, not linear.
      EXPECT_LE(fake.tried.size(), 2u * 8u + 2u);
    }
  }
}

TEST(MicroBatchSearch, DoublesThenBacksOff) {
  FakeProbe fake{12, {}};
  auto r = search_micro_batch(fake.probe(), {1, 1024});
  EXPECT_EQ(r.largest_fit, 12);
  // 1 2 4 8 16(fails) then bisect (8, 16): 12 fits, 14 fails, 13 fails.
  EXPECT_EQ(fake.tried, (std::vector<int64_t>{1, 2, 4, 8, 16, 12, 14, 13}));
}

TEST(MicroBatchSearch, ClampsTheLastDoublingToMax) {
  FakeProbe fake{1000, {}};
  auto r = search_micro_batch(fake.probe(), {1, 24});
  EXPECT_EQ(r.largest_fit, 24);
  EXPECT_EQ(fake.tried, (std::vector<int64_t>{1, 2, 4, 8, 16, 24}));
}

TEST(MicroBatchSearch, NothingFitsGivesZero) {
  FakeProbe fake{0, {}};
  auto r = search_micro_batch(fake.probe(), {1, 64});
  EXPECT_EQ(r.largest_fit, 0);
  EXPECT_EQ(fake.tried, (std::vector<int64_t>{1}));
}

TEST(MicroBatchSearch, StartAboveOneIsRespected) {
  FakeProbe fake{5, {}};
  auto r = search_micro_batch(fake.probe(), {4, 64});
  EXPECT_EQ(r.largest_fit, 5);
  EXPECT_EQ(fake.tried.front(), 4);
}

TEST(MicroBatchSearch, RejectsBadOptions) {
  FakeProbe fake{5, {}};
  EXPECT_THROW(search_micro_batch(fake.probe(), {0, 8}), Error);
  EXPECT_THROW(search_micro_batch(fake.probe(), {4, 2}), Error);
  EXPECT_TRUE(fake.tried.empty());
}

TEST(BatchPlan, KeepsTheGlobalBatchExactly) {
  for (int64_t per_rank = 1; per_rank <= 96; ++per_rank) {
    for (int64_t fit = 1; fit <= 100; ++fit) {
      auto p = plan_accumulation(per_rank, fit);
      EXPECT_EQ(p.micro_batch_size * p.grad_accum_steps, per_rank);
      EXPECT_LE(p.micro_batch_size, fit);
      // The largest divisor of per_rank not above fit.
      for (int64_t m = p.micro_batch_size + 1; m <= std::min(fit, per_rank); ++m) {
        EXPECT_NE(per_rank % m, 0) << per_rank << " " << fit << " skipped divisor " << m;
      }
      EXPECT_EQ(p.reduced_to_divide, p.micro_batch_size < std::min(fit, per_rank));
    }
  }
}

TEST(BatchPlan, ExamplesAndTheMessageSaysWhenItCannotDivide) {
  auto p = plan_accumulation(32, 64);  // everything fits: one micro-step
  EXPECT_EQ(p.micro_batch_size, 32);
  EXPECT_EQ(p.grad_accum_steps, 1);
  EXPECT_FALSE(p.reduced_to_divide);
  p = plan_accumulation(32, 8);
  EXPECT_EQ(p.micro_batch_size, 8);
  EXPECT_EQ(p.grad_accum_steps, 4);
  EXPECT_FALSE(p.reduced_to_divide);
  p = plan_accumulation(32, 12);  // 12 fits but does not divide 32
  EXPECT_EQ(p.micro_batch_size, 8);
  EXPECT_EQ(p.grad_accum_steps, 4);
  EXPECT_TRUE(p.reduced_to_divide);
  const auto msg = describe_batch_plan(p, 12, 32, 2);
  EXPECT_NE(msg.find("global batch 64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("12 does not divide the per-rank batch 32"), std::string::npos) << msg;
  EXPECT_NE(msg.find("multiple of 12"), std::string::npos) << msg;
  EXPECT_EQ(describe_batch_plan(plan_accumulation(32, 8), 8, 32, 2).find("does not divide"),
            std::string::npos);
  p = plan_accumulation(7, 6);  // a prime per-rank batch: only 1 divides below 7
  EXPECT_EQ(p.micro_batch_size, 1);
  EXPECT_EQ(p.grad_accum_steps, 7);
  EXPECT_THROW(plan_accumulation(0, 4), Error);
  EXPECT_THROW(plan_accumulation(4, 0), Error);
}

}  // namespace
}  // namespace dnallm::train
