#include "checkpoint/async_writer.hpp"

#include <gtest/gtest.h>

#include "checkpoint/commit.hpp"

#include "checkpoint/reader.hpp"
#include "core/error.hpp"
#include "test_util.hpp"

namespace dnallm::checkpoint {
namespace {

using testing::make_data;
using testing::spec;
using testing::TempDir;

SaveRequest request(const std::filesystem::path& root, int64_t step, std::vector<uint8_t>& data) {
  SaveRequest r;
  r.root = root;
  r.step = step;
  r.slices = {{spec("w", DType::kFloat32, {static_cast<int64_t>(data.size() / 4)}), 0,
               data.size() / 4, data.data()}};
  r.on_durable = [root, step](const ShardDescriptor& d) {
    LocalCommitChannel channel;  // the one commit path, world size 1
    ShardCommit commit;
    commit.root = root;
    commit.info = CommitInfo{step, 1, 0, {{"step", step}}};
    commit_shard(channel, d, commit);
  };
  return r;
}

TEST(CheckpointAsyncWriterTest, SnapshotIsCopiedAndWaitFlushes) {
  TempDir tmp;
  AsyncWriter writer;
  writer.start();
  auto data = make_data(DType::kFloat32, 1 << 16, 1);
  const auto expected = data;
  const double stall = writer.save(request(tmp.path(), 10, data));
  EXPECT_GE(stall, 0.0);
  std::fill(data.begin(), data.end(), 0);  // the caller reuses its buffer at once
  auto result = writer.wait();
  ASSERT_TRUE(result);
  EXPECT_EQ(result->step, 10);
  EXPECT_EQ(list_committed(tmp.path()).size(), 1u);  // on_durable ran on the writer thread
  EXPECT_GT(result->write_s, 0.0);
  EXPECT_EQ(result->stall_s, stall);
  EXPECT_GT(result->shard.bytes, 0u);
  auto r = CheckpointReader::open(tmp.path());
  EXPECT_EQ(r.step(), 10);
  EXPECT_EQ(r.read_tensor("w"), expected);
  writer.stop();
}

// Zero-copy hand-over (SaveRequest::borrowed): the writer reads the caller's memory only after
// ready() returned, and keeps `borrowed` alive until the write is done.
TEST(CheckpointAsyncWriterTest, BorrowedMemoryIsReadAfterReadyAndKeptAlive) {
  TempDir tmp;
  AsyncWriter writer;
  writer.start();
  const auto expected = make_data(DType::kFloat32, 1 << 16, 4);
  // Zeros at hand-over: ready() stands for the device copy that fills the buffer.
  auto owner = std::make_shared<std::vector<uint8_t>>(expected.size(), 0);
  SaveRequest r = request(tmp.path(), 3, *owner);
  r.borrowed = owner;
  std::weak_ptr<std::vector<uint8_t>> watch = owner;
  r.ready = [raw = owner.get(), &expected] { *raw = expected; };
  owner.reset();  // the request (and then the writer's job) is the only owner
  writer.save(r);
  r = SaveRequest{};  // drop the caller's copy of `borrowed` too
  auto result = writer.wait();
  ASSERT_TRUE(result);
  EXPECT_TRUE(watch.expired()) << "the job kept the borrowed memory after the write";
  EXPECT_EQ(CheckpointReader::open(tmp.path()).read_tensor("w"), expected);
  writer.stop();
}

TEST(CheckpointAsyncWriterTest, SecondSaveWaitsForFirstAndStopDrains) {
  TempDir tmp;
  AsyncWriter writer;
  writer.start();
  auto a = make_data(DType::kFloat32, 1 << 20, 2);
  auto b = make_data(DType::kFloat32, 1 << 20, 3);
  const auto b_copy = b;
  SaveRequest ra = request(tmp.path(), 1, a);
  ra.codec.level = 9;  // slow enough that the second save must wait
  writer.save(ra);
  writer.save(request(tmp.path(), 2, b));
  // save() returned, so the first checkpoint is already durable and committed: at most
  // one snapshot is in flight (Note [One checkpoint in flight]).
  auto first = list_committed(tmp.path());
  ASSERT_GE(first.size(), 1u);
  EXPECT_EQ(first[0].first, 1);
  writer.stop();  // drains the queued save before joining
  auto committed = list_committed(tmp.path());
  ASSERT_EQ(committed.size(), 2u);
  EXPECT_EQ(CheckpointReader::open(tmp.path()).read_tensor("w"), b_copy);
  auto last = writer.wait();
  ASSERT_TRUE(last);
  EXPECT_EQ(last->step, 2);
}

TEST(CheckpointAsyncWriterTest, ErrorIsReportedOnceByWait) {
  TempDir tmp;
  AsyncWriter writer;
  writer.start();
  auto data = make_data(DType::kFloat32, 100, 1);
  SaveRequest bad = request(tmp.path(), 1, data);
  // A commit whose step never completes (rank 1 of 2 never reports) fails on the writer.
  bad.on_durable = [root = tmp.path()](const ShardDescriptor& d) {
    LocalCommitChannel channel;
    ShardCommit commit;
    commit.root = root;
    commit.info = CommitInfo{1, 2, 0, {}};
    commit.timeout = std::chrono::milliseconds(0);
    commit_shard(channel, d, commit);
  };
  writer.save(bad);
  EXPECT_THROW(writer.wait(), Error);
  EXPECT_FALSE(writer.wait_for(std::chrono::milliseconds(10)).has_value());  // reported
  writer.save(request(tmp.path(), 2, data));
  auto ok = writer.wait_for(std::chrono::seconds(30));
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->step, 2);
}

TEST(CheckpointAsyncWriterTest, SaveBeforeStartIsAnError) {
  AsyncWriter writer;
  std::vector<uint8_t> data(16);
  EXPECT_THROW(writer.save(request("/tmp/unused", 1, data)), Error);
}

}  // namespace
}  // namespace dnallm::checkpoint
