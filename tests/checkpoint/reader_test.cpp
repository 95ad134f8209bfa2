#include "checkpoint/reader.hpp"

#include <gtest/gtest.h>

#include "checkpoint/commit.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/reshard.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "test_util.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::checkpoint {
namespace {

using dnallm::testing::expect_error;
using namespace testing;  // NOLINT: tests/checkpoint/test_util.hpp

TEST(CheckpointReaderTest, EveryDTypeRoundTripsWithEachCodec) {
  for (const char* codec : {"none", "zstd"}) {
    TempDir tmp;
    std::vector<std::vector<uint8_t>> data;
    std::vector<TensorSlice> slices;
    int i = 0;
    for (DType t : kAllDTypes) {
      data.push_back(make_data(t, 3 * 1001, 100 + i));
      slices.push_back(
          {spec("t" + std::to_string(i++), t, {3, 1001}), 0, 3003, data.back().data()});
    }
    CodecOptions o = parse_codec(codec);
    o.chunk_bytes = 1000;  // many chunks per tensor
    save_single(tmp.path(), {5, 1, 0, {{"step", 5}}}, slices, o);
    auto r = CheckpointReader::open(tmp.path());
    r.verify();
    EXPECT_EQ(r.step(), 5);
    EXPECT_EQ(r.manifest().state["step"], 5);
    for (size_t k = 0; k < slices.size(); ++k)
      EXPECT_EQ(r.read_tensor(slices[k].spec.name), data[k])
          << codec << " " << dtype_name(slices[k].spec.dtype);
  }
}

// Two ranks, each holding half of one flat buffer, with small chunks: every range,
// including those crossing chunk and shard boundaries, must read back exactly.
TEST(CheckpointReaderTest, PartialRangesAcrossShardAndChunkBoundaries) {
  TempDir tmp;
  const uint64_t n = 1000;
  auto all = make_data(DType::kFloat32, n, 1);
  const TensorSpec flat = spec("flat", DType::kFloat32, {1000});
  CodecOptions o;
  o.chunk_bytes = 4 * 64;
  const auto dir = tmp.path() / step_dir_name(1);
  auto d0 = write_shard(dir, 0, {{flat, 0, 437, all.data()}}, o);
  auto d1 = write_shard(dir, 1, {{flat, 437, n, all.data() + 437 * 4}}, o);
  commit_step(tmp.path(), {1, 2, 1, {}}, {d1, d0});
  auto r = CheckpointReader::open(dir);
  for (auto [b, e] : std::vector<std::pair<uint64_t, uint64_t>>{{0, 0},
                                                                {0, 1},
                                                                {63, 65},
                                                                {400, 500},
                                                                {436, 438},
                                                                {437, 438},
                                                                {0, 1000},
                                                                {999, 1000},
                                                                {100, 900}}) {
    std::vector<uint8_t> got((e - b) * 4);
    r.read_range("flat", b, e, got.data());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), all.begin() + b * 4)) << b << ".." << e;
  }
  std::vector<uint8_t> dummy(8);
  EXPECT_THROW(r.read_range("flat", 999, 1001, dummy.data()), Error);
  EXPECT_THROW(r.read_range("nope", 0, 1, dummy.data()), Error);
}

TEST(CheckpointReaderTest, GapInShardsIsReported) {
  TempDir tmp;
  auto all = make_data(DType::kFloat32, 100, 1);
  const TensorSpec flat = spec("flat", DType::kFloat32, {100});
  const auto dir = tmp.path() / step_dir_name(1);
  auto d0 = write_shard(dir, 0, {{flat, 0, 40, all.data()}}, {});
  auto d1 = write_shard(dir, 1, {{flat, 60, 100, all.data() + 240}}, {});
  commit_step(tmp.path(), {1, 2, 1, {}}, {d0, d1});
  auto r = CheckpointReader::open(dir);
  std::vector<uint8_t> got(400);
  expect_error([&] { r.read_range("flat", 0, 100, got.data()); }, ExitCode::kCheckpointCorrupt,
               {"[40, 100)"});
}

TEST(CheckpointReshardTest, PlanIsContiguousEvenAndComplete) {
  std::vector<TensorSpec> layout = {spec("a", DType::kFloat32, {10}),
                                    spec("b", DType::kBFloat16, {2, 3}),
                                    spec("c", DType::kInt64, {1})};
  for (int w = 1; w <= 12; ++w) {
    auto plan = plan_reshard(layout, w);
    ASSERT_EQ(plan.size(), static_cast<size_t>(w));
    for (const auto& t : layout) {
      uint64_t at = 0;
      uint64_t min_len = UINT64_MAX, max_len = 0;
      int holders = 0;
      for (const auto& ranks : plan)
        for (const auto& r : ranks)
          if (r.tensor == t.name) {
            EXPECT_EQ(r.begin, at);
            EXPECT_LT(r.begin, r.end);
            at = r.end;
            min_len = std::min(min_len, r.end - r.begin);
            max_len = std::max(max_len, r.end - r.begin);
            ++holders;
          }
      EXPECT_EQ(at, t.numel()) << t.name << " w=" << w;
      EXPECT_LE(max_len - min_len, 1u);
      EXPECT_EQ(holders, static_cast<int>(std::min<uint64_t>(w, t.numel())));
    }
  }
}

TEST(CheckpointReshardTest, TwoToThreeToOneKeepsEveryByte) {
  TempDir tmp;
  // Rank 0 holds whole tensor "w" and the first half of flat buffer "m"; rank 1 the rest.
  auto w = make_data(DType::kBFloat16, 30 * 17, 11);
  auto m = make_data(DType::kFloat32, 2001, 12);
  auto ids = make_data(DType::kInt64, 5, 13);
  const auto sw = spec("w", DType::kBFloat16, {30, 17});
  const auto sm = spec("m", DType::kFloat32, {2001});
  const auto si = spec("ids", DType::kInt64, {5});
  CodecOptions o;
  o.chunk_bytes = 256;
  const auto dir = tmp.path() / "a" / step_dir_name(7);
  auto d0 = write_shard(dir, 0, {{sw, 0, 510, w.data()}, {sm, 0, 1000, m.data()}}, o);
  auto d1 = write_shard(dir, 1, {{sm, 1000, 2001, m.data() + 4000}, {si, 0, 5, ids.data()}}, o);
  nlohmann::json state = {{"step", 7}, {"tokenizer", {{"kind", "kmer"}, {"k", 6}}}};
  commit_step(tmp.path() / "a", {7, 2, 1, state}, {d0, d1});

  auto r2 = CheckpointReader::open(tmp.path() / "a");
  auto dir3 = reshard(r2, tmp.path() / "b", 3, o);
  auto r3 = CheckpointReader::open(dir3);
  r3.verify();
  EXPECT_EQ(r3.manifest().world_size, 3);
  EXPECT_EQ(r3.manifest().state, state);
  // The 3-way rule: rank 1 of 3 holds [667, 1334) of m.
  bool found = false;
  for (const auto& range : r3.manifest().shards[1].ranges)
    if (range.tensor == "m") {
      EXPECT_EQ(range.begin, 667u);
      EXPECT_EQ(range.end, 1334u);
      found = true;
    }
  EXPECT_TRUE(found);
  auto dir1 = reshard(r3, tmp.path() / "c", 1, parse_codec("none"));
  auto r1 = CheckpointReader::open(tmp.path() / "c");
  r1.verify();
  EXPECT_EQ(r1.dir(), dir1);
  EXPECT_EQ(r1.manifest().world_size, 1);
  EXPECT_EQ(r1.read_tensor("w"), w);
  EXPECT_EQ(r1.read_tensor("m"), m);
  EXPECT_EQ(r1.read_tensor("ids"), ids);
  EXPECT_EQ(r3.read_tensor("m"), m);
}

}  // namespace
}  // namespace dnallm::checkpoint
