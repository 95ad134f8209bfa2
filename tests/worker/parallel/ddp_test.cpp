// DataParallel with real backward passes and a real (world-size 1) Gloo communicator: hooks
// launch buckets during backward, unused parameters are named or tolerated.
#include "worker/parallel/ddp.hpp"

#include <gtest/gtest.h>

#include "comm/make_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"

namespace dnallm::parallel {
namespace {

struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    used = register_module("used", torch::nn::Linear(16, 16));
    unused = register_module("unused", torch::nn::Linear(16, 4));
  }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};

struct Fixture {
  std::shared_ptr<TwoLayers> model = std::make_shared<TwoLayers>();
  std::vector<std::pair<std::string, torch::Tensor>> named;
  std::unique_ptr<optim::FlatParameters> flat;
  std::unique_ptr<comm::Communicator> comm;
  Fixture() {
    torch::manual_seed(0);
    for (const auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value());
    flat = std::make_unique<optim::FlatParameters>(bucket_order(named));
    comm::CommOptions o;
    o.backend = "gloo";
    o.store = std::make_shared<coordinator::InMemoryStore>();
    o.loopback = true;
    o.timeout = std::chrono::seconds(10);
    comm = comm::make_communicator(o);
  }
  torch::Tensor loss() { return model->used->forward(torch::randn({8, 16})).pow(2).sum(); }
};

DdpOptions small_buckets(bool find_unused) {
  DdpOptions o;
  o.bucket_cap_bytes = 300;  // several buckets for this model
  o.first_bucket_bytes = 100;
  o.find_unused_parameters = find_unused;
  return o;
}

TEST(DataParallel, UnusedParametersAreNamed) {
  Fixture f;
  DataParallel ddp(*f.flat, f.named, *f.comm, small_buckets(false));
  ddp.begin_micro_step(true);
  f.loss().backward();
  try {
    ddp.finish_step();
    FAIL() << "expected an error naming the unused parameters";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("unused.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("unused.bias"), std::string::npos) << m;
    EXPECT_EQ(m.find("used.weight,"), std::string::npos) << m;
    EXPECT_NE(m.find("find_unused_parameters"), std::string::npos) << m;
  }
}

TEST(DataParallel, FindUnusedParametersReducesTheRest) {
  Fixture f;
  DataParallel ddp(*f.flat, f.named, *f.comm, small_buckets(true));
  EXPECT_GT(ddp.layout().buckets.size(), 2u);
  f.flat->zero_grad();
  ddp.begin_micro_step(true);
  auto loss = f.loss();
  loss.backward();
  EXPECT_NO_THROW(ddp.finish_step());
  // World size 1: the reduced gradient is the local one, unused parameters stay zero.
  EXPECT_GT(f.model->used->weight.grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(f.model->unused->weight.grad().abs().sum().item<double>(), 0.0);
}

TEST(DataParallel, BucketsLaunchDuringBackwardInOrder) {
  Fixture f;
  // Every parameter used: all buckets launch from the hooks, none at finish_step().
  DataParallel ddp(*f.flat, f.named, *f.comm, small_buckets(false));
  ddp.begin_micro_step(true);
  auto x = torch::randn({8, 16});
  (f.model->unused->forward(f.model->used->forward(x)).pow(2).sum()).backward();
  EXPECT_EQ(ddp.buckets_launched_during_backward(),
            static_cast<int64_t>(ddp.layout().buckets.size()));
  EXPECT_NO_THROW(ddp.finish_step());
}

TEST(DataParallel, NoSyncMicroStepsLaunchNothing) {
  Fixture f;
  DataParallel ddp(*f.flat, f.named, *f.comm, small_buckets(false));
  auto x = torch::randn({8, 16});
  ddp.begin_micro_step(false);  // accumulate_sync = "last": not the last micro-step
  (f.model->unused->forward(f.model->used->forward(x)).pow(2).sum()).backward();
  EXPECT_EQ(ddp.buckets_launched_during_backward(), 0);
  ddp.begin_micro_step(true);
  (f.model->unused->forward(f.model->used->forward(x)).pow(2).sum()).backward();
  EXPECT_EQ(ddp.buckets_launched_during_backward(),
            static_cast<int64_t>(ddp.layout().buckets.size()));
  ddp.finish_step();
}

TEST(DataParallel, RejectsFlatBufferNotInBucketOrder) {
  Fixture f;
  optim::FlatParameters wrong(f.named);  // registration order, not bucket order
  EXPECT_THROW(DataParallel(wrong, f.named, *f.comm, small_buckets(false)), Error);
}

}  // namespace
}  // namespace dnallm::parallel
