// Note [Hyena context parallelism] with real Gloo groups of 2 and 4 ranks in one process
// (threads, one in-memory store): the shards each rank computes, gathered, against the same
// computation on the whole sequence in one process (the model's own fft_long_conv and the
// short filter's conv1d), forward and backward. A misordered all-to-all block or a halo from
// the wrong neighbour moves values to other positions or channels and fails these.
#include "worker/parallel/context_parallel.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"
#include "tests/worker/parallel/context_ranks.hpp"
#include "worker/models/hyena/hyena.hpp"

namespace dnallm::parallel {
namespace {

using torch::Tensor;

constexpr double kHyenaTolerance = 1e-6;

using context_test::expect_no_errors;
using context_test::gloo_available;
using context_test::leaf;
using context_test::run_on_ranks;
using context_test::shard_of;

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  context_test::expect_close(got, want, what, kHyenaTolerance);
}

struct Shape {
  int64_t batch = 2, length = 64, channels = 12;
};

class ContextParallel : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!gloo_available()) GTEST_SKIP() << "gloo was not built";
  }
  int world() const { return GetParam(); }
};

TEST_P(ContextParallel, AllToAllRoundTripIsExactAndChannelShardsAreTheWholeSequence) {
  const Shape s;
  torch::manual_seed(1);
  const auto x = torch::randn({s.batch, s.length, s.channels});
  const int C = world();
  std::vector<Tensor> channels(C), back(C);
  expect_no_errors(run_on_ranks(C, "a2a", [&](int r, comm::Communicator& group) {
    const auto mine = shard_of(x, 1, C, r);
    channels[r] = sequence_to_channels(mine, group);
    back[r] = channels_to_sequence(channels[r], group);
  }));
  for (int r = 0; r < C; ++r) {
    const auto block = channel_block(s.channels, C, r);
    ASSERT_TRUE(channels[r].defined()) << "rank " << r;
    // Every position of this rank's channels, in order: checks the block order itself.
    EXPECT_TRUE(channels[r].equal(x.slice(2, block.first, block.last))) << "rank " << r;
    EXPECT_TRUE(back[r].equal(shard_of(x, 1, C, r))) << "rank " << r;
  }
}

TEST_P(ContextParallel, LongConvMatchesTheWholeSequenceForwardAndBackward) {
  const Shape s;
  const int C = world();
  torch::manual_seed(2);
  const auto u = leaf(torch::randn({s.batch, s.length, s.channels}));
  const auto k = leaf(torch::randn({s.channels, s.length}) / std::sqrt(double(s.length)));
  const auto bias = leaf(torch::randn({s.channels}));
  const auto grad_out = torch::randn({s.batch, s.length, s.channels});
  // The reference: the model's long convolution on the whole sequence ([B, D, L] layout).
  const auto y = models::hyena::fft_long_conv(u.transpose(1, 2), k, bias).transpose(1, 2);
  (y * grad_out).sum().backward();

  // Each rank holds the whole filter (only its rows are read) or only its rows.
  for (const bool local_filter : {false, true}) {
    SCOPED_TRACE(local_filter ? "filter rows of the rank" : "whole filter");
    std::vector<Tensor> ys(C), du(C), dk(C), dbias(C);
    expect_no_errors(run_on_ranks(C, "long_conv", [&](int r, comm::Communicator& group) {
      const auto block = channel_block(s.channels, C, r);
      auto mine = leaf(shard_of(u, 1, C, r));
      auto k_r = leaf(local_filter ? k.slice(0, block.first, block.last) : k);
      auto bias_r = leaf(local_filter ? bias.slice(0, block.first, block.last) : bias);
      ys[r] = models::hyena::context_parallel_long_conv(mine, k_r, bias_r, group);
      (ys[r] * shard_of(grad_out, 1, C, r)).sum().backward();
      du[r] = mine.grad();
      dk[r] = k_r.grad();
      dbias[r] = bias_r.grad();
    }));
    if (HasFailure()) return;
    expect_close(torch::cat(ys, 1), y.detach(), "long conv output C=" + std::to_string(C));
    expect_close(torch::cat(du, 1), u.grad(), "long conv input gradient C=" + std::to_string(C));
    if (local_filter) {
      expect_close(torch::cat(dk, 0), k.grad(), "filter rows gradient C=" + std::to_string(C));
      expect_close(torch::cat(dbias, 0), bias.grad(), "bias rows gradient C=" + std::to_string(C));
    } else {
      // Only a rank's own rows get gradients; the sum over the group is the whole gradient.
      for (int r = 0; r < C; ++r) {
        const auto block = channel_block(s.channels, C, r);
        EXPECT_EQ(dk[r].slice(0, 0, block.first).abs().sum().item<float>(), 0.0f);
        EXPECT_EQ(dk[r].slice(0, block.last).abs().sum().item<float>(), 0.0f);
      }
      expect_close(torch::stack(dk).sum(0), k.grad(),
                   "filter gradient summed over the group C=" + std::to_string(C));
      expect_close(torch::stack(dbias).sum(0), bias.grad(),
                   "bias gradient summed over the group C=" + std::to_string(C));
    }
  }
}

// The short filter as HyenaOperatorImpl runs it: depthwise conv1d, kernel 3, padding 2, the
// first L outputs ([B, D, L]); on a shard, the same conv without padding after causal_halo.
void check_short_conv(int C, int64_t length) {
  Shape s;
  s.length = length;
  constexpr int64_t kKernel = 3;
  torch::manual_seed(3);
  const auto x = leaf(torch::randn({s.batch, s.length, s.channels}));
  const auto weight = leaf(torch::randn({s.channels, 1, kKernel}));
  const auto bias = leaf(torch::randn({s.channels}));
  const auto grad_out = torch::randn({s.batch, s.channels, s.length});
  const auto y = torch::conv1d(x.transpose(1, 2), weight, bias, 1, kKernel - 1, 1, s.channels)
                     .slice(-1, 0, s.length);
  (y * grad_out).sum().backward();

  std::vector<Tensor> ys(C), dx(C), dw(C), db(C);
  expect_no_errors(run_on_ranks(C, "halo", [&](int r, comm::Communicator& group) {
    auto mine = leaf(shard_of(x, 1, C, r));
    auto w_r = leaf(weight), b_r = leaf(bias);
    const auto with_halo = causal_halo(mine, kKernel - 1, group);
    const int64_t no_padding = 0;  // (a literal 0 would also convert to the string overload)
    ys[r] = torch::conv1d(with_halo.transpose(1, 2), w_r, b_r, 1, no_padding, 1, s.channels);
    (ys[r] * shard_of(grad_out, 2, C, r)).sum().backward();
    dx[r] = mine.grad();
    dw[r] = w_r.grad();
    db[r] = b_r.grad();
  }));
  if (::testing::Test::HasFailure()) return;
  const std::string tag = " C=" + std::to_string(C) + " L=" + std::to_string(length);
  expect_close(torch::cat(ys, 2), y.detach(), "short conv output" + tag);
  expect_close(torch::cat(dx, 1), x.grad(), "short conv input gradient" + tag);
  expect_close(torch::stack(dw).sum(0), weight.grad(), "short conv weight gradient" + tag);
  expect_close(torch::stack(db).sum(0), bias.grad(), "short conv bias gradient" + tag);
}

TEST_P(ContextParallel, ShortConvWithCausalHaloMatchesTheWholeSequence) {
  check_short_conv(world(), 64);
}

TEST_P(ContextParallel, ShortConvWithAHaloAsLongAsTheShard) {
  check_short_conv(world(), 2 * world());  // two positions a rank: the halo is the whole shard
}

TEST_P(ContextParallel, ChannelsNotDivisibleByTheGroupAreOneClearError) {
  const int C = world();
  const int64_t channels = 4 * C + 1;
  const auto errors = run_on_ranks(C, "bad", [&](int, comm::Communicator& group) {
    try {
      sequence_to_channels(torch::zeros({1, 8, channels}), group);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      throw;
    }
  });
  for (int r = 0; r < C; ++r) {
    const auto& e = errors[r];
    EXPECT_NE(e.find(std::to_string(channels) +
                     " channels are not divisible by the context "
                     "group's " +
                     std::to_string(C) + " ranks"),
              std::string::npos)
        << "rank " << r << ": " << e;
  }
  // The long conv checks the same before communicating, and a halo longer than a shard.
  const auto conv_errors = run_on_ranks(C, "bad_conv", [&](int, comm::Communicator& group) {
    models::hyena::context_parallel_long_conv(torch::zeros({1, 8, channels}),
                                              torch::zeros({channels, 8 * C}),
                                              torch::zeros({channels}), group);
  });
  for (const auto& e : conv_errors) EXPECT_NE(e.find("not divisible"), std::string::npos) << e;
  const auto halo_errors = run_on_ranks(C, "bad_halo", [&](int, comm::Communicator& group) {
    causal_halo(torch::zeros({1, 2, 4}), 3, group);
  });
  for (const auto& e : halo_errors)
    EXPECT_NE(e.find("a halo of 3 positions"), std::string::npos) << e;
}

INSTANTIATE_TEST_SUITE_P(Ranks, ContextParallel, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "C" + std::to_string(info.param);
                         });

TEST(ChannelBlock, SplitsChannelsInRankOrder) {
  EXPECT_EQ(channel_block(12, 4, 0).first, 0);
  EXPECT_EQ(channel_block(12, 4, 3).first, 9);
  EXPECT_EQ(channel_block(12, 4, 3).last, 12);
  EXPECT_THROW(channel_block(10, 4, 0), Error);
}

}  // namespace
}  // namespace dnallm::parallel
