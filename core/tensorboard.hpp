// TensorBoard event files, written without TensorFlow or protobuf.
//
// Format (what TensorBoard's own reader checks):
//   1. The file is named events.out.tfevents.<unix seconds>.<host>.<pid>.dnallm, in the
//      directory TensorBoard is pointed at (`tensorboard --logdir DIR`).
//   2. It is a sequence of TFRecords: u64 little-endian length, u32 masked CRC32C of those 8
//      bytes, the payload, u32 masked CRC32C of the payload. masked(c) = ((c >> 15) |
//      (c << 17)) + 0xa282ead8, CRC32C = Castagnoli (reflected polynomial 0x82f63b78).
//   3. Each payload is a tensorflow.Event protobuf: wall_time (field 1, double), step
//      (field 2, int64), file_version (field 3, string; the first record is
//      "brain.Event:2"), summary (field 5): Summary.value (field 1, repeated) of
//      {tag (field 1, string), simple_value (field 2, float)}.
// Only rank 0 writes (one writer, one thread); each add_scalars() call is one record, flushed
// to the OS at once so a live TensorBoard sees it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dnallm {

uint32_t crc32c(std::string_view bytes);
uint32_t masked_crc32c(std::string_view bytes);

class EventFileWriter {
 public:
  // Creates `dir` and a new event file in it. Throws Error(kUsage) when it cannot be written.
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One Event at `step` holding every (tag, value). `wall_time` in Unix seconds (< 0: now).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
                   double wall_time = -1.0);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& payload);

  std::string path_;
  std::FILE* file_ = nullptr;
};

// One decoded event (reader for tests and tools; checks framing and both CRCs).
struct TensorBoardEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> scalars;
};
// Throws Error(kBadData) naming the file and byte offset on a bad length, CRC or protobuf.
std::vector<TensorBoardEvent> read_event_file(const std::string& path);

}  // namespace dnallm
