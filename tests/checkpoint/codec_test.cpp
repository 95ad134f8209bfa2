#include "checkpoint/codec.hpp"

#include <cstring>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_util.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::checkpoint {
namespace {

using dnallm::testing::expect_error;

using testing::kAllDTypes;
using testing::make_data;

TEST(CheckpointCodecTest, GroupUngroupRoundTrip) {
  std::vector<uint8_t> in = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<uint8_t> g(in.size()), back(in.size());
  group_bytes(in.data(), 3, 4, g.data());
  EXPECT_EQ(g, (std::vector<uint8_t>{1, 5, 9, 2, 6, 10, 3, 7, 11, 4, 8, 12}));
  ungroup_bytes(g.data(), 3, 4, back.data());
  EXPECT_EQ(back, in);
}

TEST(CheckpointCodecTest, EveryDTypeAndCodecRoundTrips) {
  for (DType t : kAllDTypes) {
    for (const char* codec : {"none", "zstd", "zstd:9"}) {
      for (bool grouping : {false, true}) {
        CodecOptions o = parse_codec(codec);
        o.byte_grouping = grouping;
        auto raw = make_data(t, 10007, 7);
        std::vector<uint8_t> stored;
        ChunkEncoding enc = encode_chunk(raw.data(), raw.size(), t, o, stored);
        if (o.codec == Codec::kNone) {
          EXPECT_EQ(enc, ChunkEncoding::kRaw);
        }
        std::vector<uint8_t> back(raw.size());
        decode_chunk(stored.data(), stored.size(), enc, t, back.data(), back.size(), "test");
        EXPECT_EQ(back, raw) << dtype_name(t) << " " << codec << " grouping=" << grouping;
      }
    }
  }
}

TEST(CheckpointCodecTest, ByteGroupingBeatsPlainZstdOnNormalWeights) {
  auto raw = make_data(DType::kFloat32, 1 << 18, 3);
  CodecOptions grouped = parse_codec("zstd"), plain = grouped;
  plain.byte_grouping = false;
  std::vector<uint8_t> a, b;
  EXPECT_EQ(encode_chunk(raw.data(), raw.size(), DType::kFloat32, grouped, a),
            ChunkEncoding::kGroupedZstd);
  encode_chunk(raw.data(), raw.size(), DType::kFloat32, plain, b);
  EXPECT_LT(a.size(), b.size());
  EXPECT_GT(static_cast<double>(raw.size()) / a.size(), 1.15);
}

// Small chunks too: each plane is its own zstd frame (Note [Grouped chunk layout]).
TEST(CheckpointCodecTest, GroupingMeetsRatioTargetsOnSmallChunks) {
  for (auto [dtype, target] : {std::pair<DType, double>{DType::kFloat32, 1.15},
                               std::pair<DType, double>{DType::kBFloat16, 1.3}}) {
    auto raw = make_data(dtype, 16384, 4);
    std::vector<uint8_t> stored;
    ASSERT_EQ(encode_chunk(raw.data(), raw.size(), dtype, parse_codec("zstd"), stored),
              ChunkEncoding::kGroupedZstd);
    EXPECT_GT(static_cast<double>(raw.size()) / stored.size(), target) << dtype_name(dtype);
  }
}

TEST(CheckpointCodecTest, RotationPutsExponentInTopByte) {
  float f = -1.5f;  // sign 1, exponent 127, mantissa 0x400000
  std::vector<uint8_t> b(4);
  std::memcpy(b.data(), &f, 4);
  rotate_sign_to_low_bit(b.data(), 1, DType::kFloat32);
  EXPECT_EQ(b[3], 127);
  EXPECT_EQ(b[0] & 1, 1);
  rotate_sign_to_high_bit(b.data(), 1, DType::kFloat32);
  float back;
  std::memcpy(&back, b.data(), 4);
  EXPECT_EQ(back, f);
}

TEST(CheckpointCodecTest, DamagedPlaneSizeIsCheckpointCorrupt) {
  auto raw = make_data(DType::kFloat32, 4096, 5);
  std::vector<uint8_t> stored;
  auto enc = encode_chunk(raw.data(), raw.size(), DType::kFloat32, parse_codec("zstd"), stored);
  ASSERT_EQ(enc, ChunkEncoding::kGroupedZstd);
  stored[12] ^= 0x40;  // size of plane 3
  std::vector<uint8_t> back(raw.size());
  EXPECT_THROW(decode_chunk(stored.data(), stored.size(), enc, DType::kFloat32, back.data(),
                            back.size(), "x"),
               Error);
}

TEST(CheckpointCodecTest, IncompressibleFallsBackToRaw) {
  auto raw = make_data(DType::kUInt8, 4096, 5);  // uniform random bytes
  std::vector<uint8_t> stored;
  EXPECT_EQ(encode_chunk(raw.data(), raw.size(), DType::kUInt8, parse_codec("zstd"), stored),
            ChunkEncoding::kRaw);
  EXPECT_EQ(stored, raw);
}

TEST(CheckpointCodecTest, CorruptZstdIsCheckpointCorrupt) {
  auto raw = make_data(DType::kFloat32, 4096, 5);
  std::vector<uint8_t> stored;
  auto enc = encode_chunk(raw.data(), raw.size(), DType::kFloat32, parse_codec("zstd"), stored);
  stored.resize(stored.size() / 2);
  std::vector<uint8_t> back(raw.size());
  expect_error(
      [&] {
        decode_chunk(stored.data(), stored.size(), enc, DType::kFloat32, back.data(), back.size(),
                     "here");
      },
      ExitCode::kCheckpointCorrupt, {"here"});
}

TEST(CheckpointCodecTest, ParseCodec) {
  EXPECT_EQ(parse_codec("none").codec, Codec::kNone);
  EXPECT_EQ(parse_codec("zstd:7").level, 7);
  EXPECT_THROW(parse_codec("lz4"), Error);
  EXPECT_THROW(parse_codec("zstd:99"), Error);
}

}  // namespace
}  // namespace dnallm::checkpoint
