// TensorBoard event files: CRC32C against its published check value, and files read back by
// the format's own rules (TFRecord framing, masked CRC32C of length and payload, Event and
// Summary protobuf fields), including damaged files.
#include "core/tensorboard.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/process.hpp"

namespace dnallm {
namespace {

using dnallm::testing::expect_error;
using dnallm::testing::make_temp_dir;

namespace fs = std::filesystem;

// The path of a new event file in `dir` holding one record: `scalars` at `step`.
std::string write_one_record(const fs::path& dir, int64_t step,
                             const std::vector<std::pair<std::string, double>>& scalars,
                             double wall_time = -1.0) {
  EventFileWriter w(dir.string());
  w.add_scalars(step, scalars, wall_time);
  return w.path();
}

// The whole file at `path`, byte for byte.
std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

TEST(TensorBoardTest, Crc32cCheckValues) {
  // The CRC-32C check value (RFC 3720 / the CRC catalogue) and iSCSI's 32 zero bytes.
  EXPECT_EQ(crc32c("123456789"), 0xe3069283u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8a9136aau);
  EXPECT_EQ(crc32c(""), 0u);
  // masked = rotate right by 15, plus 0xa282ead8 (TFRecord's mask).
  const uint32_t c = crc32c("123456789");
  EXPECT_EQ(masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoardTest, ScalarsReadBack) {
  const auto dir = fs::path(make_temp_dir("tb_roundtrip"));
  std::string path;
  {
    EventFileWriter w(dir.string());
    path = w.path();
    w.add_scalars(1, {{"train/loss", 2.5}, {"train/lr", 1e-4}}, 1700000000.25);
    w.add_scalars(300, {{"eval/bits_per_base", 1.93}});
    w.add_scalars(5, {});  // nothing to write: no record
  }
  EXPECT_EQ(fs::path(path).parent_path(), dir);
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
  const auto events = read_event_file(path);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_GT(events[0].wall_time, 1.6e9);
  EXPECT_EQ(events[1].step, 1);
  EXPECT_EQ(events[1].wall_time, 1700000000.25);
  ASSERT_EQ(events[1].scalars.size(), 2u);
  EXPECT_EQ(events[1].scalars[0].first, "train/loss");
  EXPECT_EQ(events[1].scalars[0].second, 2.5f);
  EXPECT_EQ(events[1].scalars[1].first, "train/lr");
  EXPECT_EQ(events[1].scalars[1].second, 1e-4f);
  EXPECT_EQ(events[2].step, 300);
  EXPECT_EQ(events[2].scalars.at(0).second, 1.93f);
  fs::remove_all(dir);
}

// Hand-checked bytes of one record: a reader written from the format's description (not our
// encoder) must find the same fields at the same offsets.
TEST(TensorBoardTest, RecordBytesFollowTheFormat) {
  const auto dir = fs::path(make_temp_dir("tb_bytes"));
  const std::string data = read_bytes(write_one_record(dir, 7, {{"a", 1.0}}, 0.5));
  // First record: file_version. Skip it using its length.
  uint64_t len0;
  std::memcpy(&len0, data.data(), 8);
  const size_t second = 12 + len0 + 4;
  uint64_t len;
  std::memcpy(&len, data.data() + second, 8);
  // Event: 09 <double 0.5> 10 07 2a 0a [ 0a 08 [ 0a 01 'a' 15 <float 1.0> ] ]
  const std::string expected_payload = std::string("\x09", 1) +
                                       std::string("\0\0\0\0\0\0\xe0\x3f", 8) +
                                       std::string(
                                           "\x10\x07\x2a\x0a\x0a\x08\x0a\x01"
                                           "a"
                                           "\x15",
                                           10) +
                                       std::string("\0\0\x80\x3f", 4);
  ASSERT_EQ(len, expected_payload.size());
  EXPECT_EQ(data.substr(second + 12, len), expected_payload);
  uint32_t crc;
  std::memcpy(&crc, data.data() + second + 12 + len, 4);
  EXPECT_EQ(crc, masked_crc32c(expected_payload));
  EXPECT_EQ(data.size(), second + 12 + len + 4);
  fs::remove_all(dir);
}

TEST(TensorBoardTest, DamagedFilesAreBadData) {
  const auto dir = fs::path(make_temp_dir("tb_damaged"));
  const std::string path = write_one_record(dir, 1, {{"train/loss", 2.0}});
  const std::string data = read_bytes(path);
  auto expect_bad = [&](std::string bytes, const std::string& needle) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    expect_error([&] { read_event_file(path); }, ExitCode::kBadData, {needle});
  };
  std::string flipped = data;
  flipped[data.size() - 6] ^= 0x01;  // inside the last payload
  expect_bad(flipped, "payload's masked CRC32C");
  std::string bad_len = data;
  bad_len[0] ^= 0x01;
  expect_bad(bad_len, "length's masked CRC32C");
  expect_bad(data.substr(0, data.size() - 3), "past the end");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dnallm
