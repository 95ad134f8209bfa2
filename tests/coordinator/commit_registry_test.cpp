// The checkpoint commit registry (checkpoint/commit.hpp): a step completes only when every
// rank's durable shard was reported, reports are idempotent, inconsistent and stale reports
// are refused, retention is decided here (newest, protected and LATEST steps are never
// deleted); and the two ops over real TCP through the ElasticService and CommitClient, and
// through a plain StoreServer (register_commit_ops, as rank 0's store in static runs).
#include <gtest/gtest.h>

#include "coordinator/commit_registry.hpp"
#include "coordinator/elastic_service.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {
namespace {

using checkpoint::CommitRegistry;
using checkpoint::CommittedReport;
using checkpoint::ShardReport;

ShardReport shard(int64_t step, int64_t rank, int64_t world, int64_t generation = 1) {
  ShardReport r;
  r.root = "/ckpt";
  r.generation = generation;
  r.step = step;
  r.rank = rank;
  r.world_size = world;
  r.descriptor =
      "d" + std::to_string(step) + "." + std::to_string(rank) + ".g" + std::to_string(generation);
  return r;
}

TEST(CommitRegistryTest, StepCompletesWhenEveryRankReportedInRankOrder) {
  CommitRegistry reg;
  EXPECT_FALSE(reg.shard_durable(shard(4, 2, 3)));
  EXPECT_FALSE(reg.shard_durable(shard(4, 0, 3)));
  EXPECT_FALSE(reg.shard_durable(shard(4, 0, 3)));  // a repeat is not a third rank
  auto all = reg.shard_durable(shard(4, 1, 3));
  ASSERT_TRUE(all);
  EXPECT_EQ(*all, (std::vector<std::string>{"d4.0.g1", "d4.1.g1", "d4.2.g1"}));
  // Rank 0 asking again gets the same answer.
  EXPECT_TRUE(reg.shard_durable(shard(4, 0, 3)));
  // Another root is another job.
  ShardReport other = shard(4, 0, 3);
  other.root = "/other";
  EXPECT_FALSE(reg.shard_durable(other));
}

TEST(CommitRegistryTest, BadAndStaleReportsAreRefused) {
  CommitRegistry reg;
  EXPECT_THROW(reg.shard_durable(shard(4, 3, 3)), Error);   // rank outside the world
  EXPECT_THROW(reg.shard_durable(shard(4, 0, 0)), Error);   // empty world
  EXPECT_THROW(reg.shard_durable(shard(-1, 0, 2)), Error);  // negative step
  ShardReport no_root = shard(4, 0, 2);
  no_root.root.clear();
  EXPECT_THROW(reg.shard_durable(no_root), Error);
  EXPECT_FALSE(reg.shard_durable(shard(4, 0, 2)));
  EXPECT_THROW(reg.shard_durable(shard(4, 1, 3)), Error);  // world size differs
  // Generation 2 restarted: generation 1's rank 0 shard must not complete step 8 with
  // generation 2's rank 1, and a late generation-1 report is refused.
  EXPECT_FALSE(reg.shard_durable(shard(8, 0, 2, 1)));
  EXPECT_FALSE(reg.shard_durable(shard(8, 1, 2, 2)));
  EXPECT_THROW(reg.shard_durable(shard(8, 0, 2, 1)), Error);
  auto all = reg.shard_durable(shard(8, 0, 2, 2));
  ASSERT_TRUE(all);
  EXPECT_EQ(*all, (std::vector<std::string>{"d8.0.g2", "d8.1.g2"}));
}

TEST(CommitRegistryTest, RetentionIsDecidedHereAndNeverTouchesTheNewestOrProtected) {
  CommitRegistry reg;
  CommittedReport c;
  c.root = "/ckpt";
  c.keep_last = 2;
  c.protected_step = 2;
  c.on_disk = {2, 4};  // found on disk by rank 0 (e.g. from a run before this job)
  c.step = 6;
  c.latest_step = 6;
  EXPECT_EQ(reg.committed(c), (std::vector<int64_t>{}));  // 2 is protected
  c.step = 8;
  c.latest_step = 8;
  c.on_disk = {2, 4, 6, 8};
  EXPECT_EQ(reg.committed(c), (std::vector<int64_t>{4}));
  c.step = 10;
  c.latest_step = 10;
  c.on_disk = {2, 6, 8, 10};
  EXPECT_EQ(reg.committed(c), (std::vector<int64_t>{6}));
  EXPECT_EQ(reg.committed_steps("/ckpt"), (std::vector<int64_t>{2, 8, 10}));
  c.keep_last = 0;  // keep all
  c.step = 12;
  EXPECT_EQ(reg.committed(c), (std::vector<int64_t>{}));
}

TEST(CommitRegistryTest, OpsOverTcpThroughTheElasticService) {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  so.token = "t";
  StoreServer server(so);
  ElasticService service(server, ElasticServiceOptions{});
  server.start();
  service.start();
  TcpStoreClientOptions o;
  o.port = server.port();
  o.token = "t";
  TcpStoreClient c0(o), c1(o);
  CommitClient rank0(c0, 3), rank1(c1, 3);
  ShardReport r = shard(4, 0, 2, /*generation: stamped by the client*/ 0);
  EXPECT_FALSE(rank0.shard_durable(r));
  r.rank = 1;
  r.descriptor = "second";
  auto all = rank1.shard_durable(r);
  ASSERT_TRUE(all);
  EXPECT_EQ(*all, (std::vector<std::string>{"d4.0.g0", "second"}));
  // The generation travels: a report stamped generation 2 is now stale.
  CommitClient old(c1, 2);
  EXPECT_THROW(old.shard_durable(r), Error);
  CommittedReport done;
  done.root = "/ckpt";
  done.step = 4;
  done.on_disk = {1, 2, 3, 4};
  done.keep_last = 2;
  done.latest_step = 4;
  EXPECT_EQ(rank0.committed(done), (std::vector<int64_t>{1, 2}));
  service.stop();
  server.stop();
  service.join();
  server.join();
}

// Static multi-rank runs: rank 0's store (a StoreServer without the ElasticService) serves
// the same ops once register_commit_ops() ran; commit_channel_for picks the TCP channel for a
// TcpStoreClient and none for an in-memory store.
TEST(CommitRegistryTest, OpsOverTcpThroughAPlainStoreServer) {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  so.token = "t";
  StoreServer server(so);
  register_commit_ops(server);
  server.start();
  TcpStoreClientOptions o;
  o.port = server.port();
  o.token = "t";
  auto store = std::make_shared<TcpStoreClient>(o);
  auto channel = commit_channel_for(store, 0);
  ASSERT_NE(channel, nullptr);
  EXPECT_EQ(channel->describe(), "the coordinator");
  EXPECT_EQ(commit_channel_for(std::make_shared<InMemoryStore>(), 0), nullptr);
  EXPECT_EQ(commit_channel_for(nullptr, 0), nullptr);
  ShardReport r = shard(6, 1, 2, 0);
  EXPECT_FALSE(channel->shard_durable(r));
  r = shard(6, 0, 2, 0);
  auto all = channel->shard_durable(r);
  ASSERT_TRUE(all);
  EXPECT_EQ(*all, (std::vector<std::string>{"d6.0.g0", "d6.1.g0"}));  // rank order
  CommittedReport done;
  done.root = "/ckpt";
  done.step = 6;
  done.on_disk = {2, 4, 6};
  done.keep_last = 1;
  done.protected_step = 2;
  done.latest_step = 6;
  EXPECT_EQ(channel->committed(done), (std::vector<int64_t>{4}));
  server.stop();
  server.join();
}

}  // namespace
}  // namespace dnallm::coordinator
