// Commit protocol, resume selection with fallback, compatibility checks, faults.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include <gtest/gtest.h>

#include "checkpoint/commit.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "test_util.hpp"

namespace dnallm::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::flip_byte;
using testing::make_data;
using testing::spec;
using testing::TempDir;

const nlohmann::json kTokenizer = {{"kind", "kmer"}, {"k", 6}};

// A two-rank checkpoint of step `step`: tensor "w" whole on rank 0, flat "m" split.
struct Saved {
  std::vector<uint8_t> w, m;
};
Saved save_two_ranks(const fs::path& root, int64_t step, bool commit = true) {
  Saved s{make_data(DType::kFloat32, 600, step), make_data(DType::kBFloat16, 1000, step + 1)};
  CodecOptions o;
  o.chunk_bytes = 512;
  const auto dir = root / step_dir_name(step);
  auto d0 = write_shard(dir, 0,
                        {{spec("w", DType::kFloat32, {20, 30}), 0, 600, s.w.data()},
                         {spec("m", DType::kBFloat16, {1000}), 0, 500, s.m.data()}},
                        o);
  auto d1 =
      write_shard(dir, 1, {{spec("m", DType::kBFloat16, {1000}), 500, 1000, s.m.data() + 1000}}, o);
  if (commit)
    commit_step(
        root, {step, 2, 1, {{"step", step}, {"config_hash", "abc123"}, {"tokenizer", kTokenizer}}},
        {d0, d1});
  return s;
}

TEST(CheckpointCommitTest, LayoutAndLatest) {
  TempDir tmp;
  save_two_ranks(tmp.path(), 1200);
  const auto dir = tmp.path() / "step_000001200";
  EXPECT_TRUE(fs::exists(dir / "shard_00000.dnc"));
  EXPECT_TRUE(fs::exists(dir / "shard_00001.dnc"));
  EXPECT_TRUE(fs::exists(dir / "manifest.json"));
  std::ifstream latest(tmp.path() / "LATEST");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step_000001200");
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  auto m = read_manifest(dir);
  EXPECT_EQ(m.world_size, 2);
  EXPECT_EQ(m.zero_stage, 1);
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_EQ(m.shards[1].ranges[0].begin, 500u);
}

TEST(CheckpointCommitTest, DescriptorsTravelAsJson) {
  TempDir tmp;
  auto w = make_data(DType::kFloat32, 600, 1);
  const auto dir = tmp.path() / step_dir_name(4);
  auto d = write_shard(dir, 0, {{spec("w", DType::kFloat32, {20, 30}), 100, 600, w.data()}}, {});
  auto back = descriptor_from_json(nlohmann::json::parse(descriptor_to_json(d).dump()));
  EXPECT_EQ(back.xxh64, d.xxh64);
  EXPECT_EQ(back.bytes, d.bytes);
  EXPECT_EQ(back.tensors, d.tensors);
  EXPECT_EQ(back.ranges[0].begin, 100u);
  EXPECT_THROW(descriptor_from_json({{"rank", 0}}), Error);
}

TEST(CheckpointCommitTest, AShardHoldsSeveralPiecesOfOneTensor) {
  // Note [Pieces of a tensor]: a fully sharded rank owns a piece of every unit. Units of 300,
  // 100 and 200 elements over 2 ranks: rank 0 [0,150) [300,350) [400,500), rank 1 the rest.
  TempDir tmp;
  auto m = make_data(DType::kFloat32, 600, 3);
  const auto dir = tmp.path() / step_dir_name(7);
  const auto t = spec("flat", DType::kFloat32, {600});
  CodecOptions o;
  o.chunk_bytes = 256;  // several chunks a piece
  auto piece = [&](uint64_t b, uint64_t e) { return TensorSlice{t, b, e, m.data() + 4 * b}; };
  auto d0 = write_shard(dir, 0, {piece(0, 150), piece(300, 350), piece(400, 500)}, o);
  auto d1 = write_shard(dir, 1, {piece(150, 300), piece(350, 400), piece(500, 600)}, o);
  EXPECT_EQ(d0.ranges.size(), 3u);
  commit_step(tmp.path(), {7, 2, 3, {{"step", 7}}}, {d0, d1});
  const auto r = CheckpointReader::open(tmp.path());
  r.verify();
  ASSERT_EQ(r.manifest().tensors.size(), 1u);
  std::vector<uint8_t> all(600 * 4);
  r.read_range("flat", 0, 600, all.data());
  EXPECT_EQ(all, m);
  std::vector<uint8_t> across(200 * 4);  // spans pieces of both shards
  r.read_range("flat", 280, 480, across.data());
  EXPECT_TRUE(std::equal(across.begin(), across.end(), m.begin() + 4 * 280));
  // Overlapping pieces in one shard are a caller's error, and nothing is written.
  const auto bad = tmp.path() / step_dir_name(8);
  EXPECT_NE(error_of(
                [&] {
                  write_shard(bad, 0, {piece(0, 150), piece(100, 200)}, o);
                },
                ExitCode::kUsage)
                .find("overlap"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(bad / shard_file_name(0)));
}

TEST(CheckpointCommitTest, MissingRankOrWrongSizeIsNotCommitted) {
  TempDir tmp;
  save_two_ranks(tmp.path(), 1);
  const auto dir = tmp.path() / step_dir_name(2);
  auto w = make_data(DType::kFloat32, 600, 1);
  auto d0 = write_shard(dir, 0, {{spec("w", DType::kFloat32, {20, 30}), 0, 600, w.data()}}, {});
  error_of([&] { commit_step(tmp.path(), {2, 2, 0, {}}, {d0}); }, ExitCode::kUsage);
  auto bad = d0;
  bad.bytes += 1;
  error_of([&] { commit_step(tmp.path(), {2, 1, 0, {}}, {bad}); }, ExitCode::kCheckpointCorrupt);
  EXPECT_FALSE(fs::exists(dir / kManifestName));
  EXPECT_EQ(CheckpointReader::open(tmp.path()).step(), 1);
}

TEST(CheckpointCommitTest, StepWithoutManifestIsNeverLoadedAndIsCleanedUp) {
  TempDir tmp;
  save_two_ranks(tmp.path(), 10);
  save_two_ranks(tmp.path(), 20, /*commit=*/false);  // crashed before the manifest
  save_two_ranks(tmp.path(), 40, /*commit=*/false);  // in flight, newer than the commit
  auto r = find_resume(tmp.path(), cfg::Resume::automatic());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->step(), 10);
  error_of([&] { CheckpointReader::open(tmp.path() / step_dir_name(20)); },
           ExitCode::kCheckpointCorrupt);
  save_two_ranks(tmp.path(), 30);  // the committer cleans older uncommitted dirs
  EXPECT_FALSE(fs::exists(tmp.path() / step_dir_name(20)));
  EXPECT_TRUE(fs::exists(tmp.path() / step_dir_name(40)));
  EXPECT_EQ(find_resume(tmp.path(), cfg::Resume::automatic())->step(), 30);
}

TEST(CheckpointCommitTest, ResumeNoneAndEmptyRoot) {
  TempDir tmp;
  EXPECT_FALSE(find_resume(tmp.path(), cfg::Resume::automatic()));
  save_two_ranks(tmp.path(), 3);
  EXPECT_FALSE(find_resume(tmp.path(), cfg::Resume::none()));
  EXPECT_EQ(find_resume("/unused", cfg::Resume::from_path((tmp.path() / step_dir_name(3)).string()))
                ->step(),
            3);
  EXPECT_EQ(find_resume("/unused", cfg::Resume::from_path(tmp.path().string()))->step(), 3);
}

TEST(CheckpointCommitTest, LatestMissingFallsBackToScan) {
  TempDir tmp;
  save_two_ranks(tmp.path(), 3);
  save_two_ranks(tmp.path(), 9);
  fs::remove(tmp.path() / kLatestName);
  EXPECT_EQ(find_resume(tmp.path(), cfg::Resume::automatic())->step(), 9);
}

// Each damage of the newest checkpoint: detected with a message naming the file, resume
// falls back to the previous one, which reads back intact.
class CheckpointDamageTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointDamageTest, FallsBackToPreviousCommitted) {
  TempDir tmp;
  Saved good = save_two_ranks(tmp.path(), 100);
  save_two_ranks(tmp.path(), 200);
  const auto bad_dir = tmp.path() / step_dir_name(200);
  const auto shard = bad_dir / "shard_00001.dnc";
  const std::string kind = GetParam();
  if (kind == "truncated") {
    fs::resize_file(shard, fs::file_size(shard) - 100);
  } else if (kind == "flipped_chunk") {
    flip_byte(shard, 20);  // inside the first chunk
  } else if (kind == "flipped_footer") {
    flip_byte(shard, -3);
  } else if (kind == "missing") {
    fs::remove(shard);
  } else if (kind == "bad_manifest") {
    std::ofstream(bad_dir / kManifestName) << "{ not json";
  }
  const std::string msg = error_of(
      [&] {
        auto r = CheckpointReader::open(bad_dir);
        r.verify();
      },
      ExitCode::kCheckpointCorrupt);
  const std::string named = kind == "bad_manifest" ? "manifest.json" : "shard_00001.dnc";
  EXPECT_NE(msg.find(named), std::string::npos) << msg;
  if (kind == "flipped_chunk") {
    EXPECT_NE(msg.find("chunk 0"), std::string::npos) << msg;
  }

  auto r = find_resume(tmp.path(), cfg::Resume::automatic());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->step(), 100);
  EXPECT_EQ(r->read_tensor("w"), good.w);
  EXPECT_EQ(r->read_tensor("m"), good.m);
  // An explicit PATH to the damaged step does not fall back.
  error_of([&] { find_resume(tmp.path(), cfg::Resume::from_path(bad_dir.string())); },
           ExitCode::kCheckpointCorrupt);
}

INSTANTIATE_TEST_SUITE_P(Faults, CheckpointDamageTest,
                         ::testing::Values("truncated", "flipped_chunk", "flipped_footer",
                                           "missing", "bad_manifest"));

TEST(CheckpointCommitTest, AllDamagedIsCheckpointCorrupt) {
  TempDir tmp;
  save_two_ranks(tmp.path(), 1);
  save_two_ranks(tmp.path(), 2);
  flip_byte(tmp.path() / step_dir_name(1) / "shard_00000.dnc", 30);
  fs::remove(tmp.path() / step_dir_name(2) / "shard_00001.dnc");
  const std::string msg = error_of([&] { find_resume(tmp.path(), cfg::Resume::automatic()); },
                                   ExitCode::kCheckpointCorrupt);
  EXPECT_NE(msg.find("no usable checkpoint"), std::string::npos) << msg;
}

TEST(CheckpointCompatTest, OtherModelOrTokenizerIsAClearUsageError) {
  TempDir tmp;
  save_two_ranks(tmp.path(), 5);
  auto r = CheckpointReader::open(tmp.path());
  Expectation ok;
  ok.layout = {spec("w", DType::kFloat32, {20, 30}), spec("m", DType::kBFloat16, {1000})};
  ok.config_hash = "abc123";
  ok.tokenizer = kTokenizer;
  check_compatible(r, ok);

  Expectation shape = ok;
  shape.layout[0].shape = {30, 20};
  EXPECT_NE(error_of([&] { check_compatible(r, shape); }, ExitCode::kUsage).find("'w'"),
            std::string::npos);
  Expectation missing = ok;
  missing.layout.push_back(spec("extra", DType::kFloat32, {1}));
  EXPECT_NE(error_of([&] { check_compatible(r, missing); }, ExitCode::kUsage).find("'extra'"),
            std::string::npos);
  Expectation cfg = ok;
  cfg.config_hash = "zzz";
  EXPECT_NE(error_of([&] { check_compatible(r, cfg); }, ExitCode::kUsage).find("config hash"),
            std::string::npos);
  Expectation tok = ok;
  tok.tokenizer = nlohmann::json{{"kind", "char"}};
  EXPECT_NE(error_of([&] { check_compatible(r, tok); }, ExitCode::kUsage).find("tokenizer"),
            std::string::npos);
}

// Disk filling during a write: a forked child limited by RLIMIT_FSIZE writes a shard
// larger than the limit. The write fails with a clear error, leaves no shard and no
// temporary file, and the previous checkpoint stays committed and loadable.
TEST(CheckpointFaultTest, DiskFullDuringWriteLeavesPreviousIntact) {
  TempDir tmp;
  Saved good = save_two_ranks(tmp.path(), 1);
  const auto dir = tmp.path() / step_dir_name(2);
  const fs::path msg_file = tmp.path() / "child_error.txt";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);  // get EFBIG instead of being killed
    struct rlimit lim {
      64 * 1024, 64 * 1024
    };
    ::setrlimit(RLIMIT_FSIZE, &lim);
    int code = 0;
    std::string what = "no error";
    try {
      auto big = make_data(DType::kUInt8, 1 << 20, 9);  // incompressible 1 MiB
      save_single(tmp.path(), {2, 1, 0, {}},
                  {{spec("big", DType::kUInt8, {1 << 20}), 0, 1 << 20, big.data()}}, {});
    } catch (const Error& e) {
      what = e.what();
      code = 10 + e.exit_code();
    }
    lim.rlim_cur = lim.rlim_max;  // the message file below must fit (limit stays 64 KiB)
    std::ofstream(msg_file) << what;
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  // Note [A failed save]: exit code 2 with the cause, not 1 "internal error".
  EXPECT_EQ(WEXITSTATUS(status), 10 + static_cast<int>(ExitCode::kUsage));
  std::ifstream in(msg_file);
  std::string msg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(msg.find("File too large"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shard_00000.dnc"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(dir / kManifestName));
  if (fs::exists(dir))
    for (const auto& e : fs::directory_iterator(dir)) ADD_FAILURE() << "left " << e.path();
  auto r = find_resume(tmp.path(), cfg::Resume::automatic());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->step(), 1);
  EXPECT_EQ(r->read_tensor("m"), good.m);
}

}  // namespace
}  // namespace dnallm::checkpoint
