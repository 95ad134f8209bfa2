#include "checkpoint/retention.hpp"

#include <gtest/gtest.h>

#include "checkpoint/commit.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/shard_file.hpp"
#include "test_util.hpp"

namespace dnallm::checkpoint {
namespace {

using testing::make_data;
using testing::spec;
using testing::TempDir;

TEST(CheckpointRetentionTest, PolicyKeepsLastEveryProtectedAndLatest) {
  std::vector<int64_t> steps = {100, 200, 300, 400, 500, 600};
  EXPECT_TRUE(steps_to_delete(steps, {0, 0}, std::nullopt, std::nullopt).empty());
  EXPECT_EQ(steps_to_delete(steps, {2, 0}, std::nullopt, std::nullopt),
            (std::vector<int64_t>{100, 200, 300, 400}));
  EXPECT_EQ(steps_to_delete(steps, {2, 200}, std::nullopt, std::nullopt),
            (std::vector<int64_t>{100, 300}));
  EXPECT_EQ(steps_to_delete(steps, {1, 0}, 300, 100), (std::vector<int64_t>{200, 400, 500}));
  EXPECT_TRUE(steps_to_delete(steps, {10, 0}, std::nullopt, std::nullopt).empty());
}

// Retention through the one commit path (commit_shard, the registry decides): every commit
// of a run applies keep_last = 2 with step 1 protected (the step resumed from).
TEST(CheckpointRetentionTest, CommitPathDeletesOnlyOlderCommittedCheckpoints) {
  TempDir tmp;
  auto data = make_data(DType::kFloat32, 10, 1);
  const std::vector<TensorSlice> slices{{spec("w", DType::kFloat32, {10}), 0, 10, data.data()}};
  // An uncommitted newer directory (in flight) must survive retention.
  write_shard(tmp.path() / step_dir_name(6), 0, slices, {});
  LocalCommitChannel channel;  // one registry for the whole run
  std::vector<std::vector<int64_t>> deleted;
  for (int64_t s : {1, 2, 3, 4, 5}) {
    ShardCommit commit;
    commit.root = tmp.path();
    commit.info = {s, 1, 0, {}};
    commit.retention = {2, 0};
    commit.protected_step = 1;
    const auto own = write_shard(tmp.path() / step_dir_name(s), 0, slices, {});
    const auto outcome = commit_shard(channel, own, commit);
    EXPECT_TRUE(outcome.committed);
    deleted.push_back(outcome.deleted);
  }
  EXPECT_EQ(deleted, (std::vector<std::vector<int64_t>>{{}, {}, {}, {2}, {3}}));
  auto left = list_committed(tmp.path());
  ASSERT_EQ(left.size(), 3u);
  EXPECT_EQ(left[0].first, 1);
  EXPECT_EQ(left[1].first, 4);
  EXPECT_EQ(left[2].first, 5);
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / step_dir_name(2)));
  EXPECT_TRUE(std::filesystem::exists(tmp.path() / step_dir_name(6)));
  EXPECT_EQ(CheckpointReader::open(tmp.path()).step(), 5);
}

TEST(CheckpointRetentionTest, RemoveCheckpointDeletesExactlyTheNamedStep) {
  TempDir tmp;
  auto data = make_data(DType::kFloat32, 10, 1);
  for (int64_t s : {1, 2, 3})
    save_single(tmp.path(), {s, 1, 0, {}}, {{spec("w", DType::kFloat32, {10}), 0, 10, data.data()}},
                {});
  EXPECT_TRUE(remove_checkpoint(tmp.path(), 2));
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / step_dir_name(2)));
  EXPECT_FALSE(remove_checkpoint(tmp.path(), 2));  // already gone
  EXPECT_FALSE(remove_checkpoint(tmp.path(), 9));  // never existed
  auto left = list_committed(tmp.path());
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].first, 1);
  EXPECT_EQ(left[1].first, 3);
}

}  // namespace
}  // namespace dnallm::checkpoint
