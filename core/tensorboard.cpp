#include "core/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.hpp"

namespace dnallm {
namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protobuf wire encoding of the few fields an Event needs.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <typename T>
void put_fixed(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // little-endian host (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_varint(out, (uint64_t(field) << 3) | 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}
void put_double(std::string& out, int field, double v) {
  put_varint(out, (uint64_t(field) << 3) | 1);
  put_fixed(out, v);
}
void put_float(std::string& out, int field, float v) {
  put_varint(out, (uint64_t(field) << 3) | 5);
  put_fixed(out, v);
}
void put_int(std::string& out, int field, int64_t v) {
  put_varint(out, uint64_t(field) << 3);
  put_varint(out, static_cast<uint64_t>(v));
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A protobuf message being decoded; every malformed input is Error(kBadData).
class Decoder {
 public:
  Decoder(std::string_view bytes, const std::string& where) : s_(bytes), where_(where) {}
  bool done() const { return pos_ >= s_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      need(1);
      const auto b = static_cast<uint8_t>(s_[pos_++]);
      v |= uint64_t(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail(ExitCode::kBadData, "{}: varint longer than 10 bytes", where_);
  }
  template <typename T>
  T fixed() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view bytes() {
    const auto n = varint();
    need(n);
    auto v = s_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  void skip(int wire) {
    switch (wire) {
      case 0:
        varint();
        break;
      case 1:
        fixed<uint64_t>();
        break;
      case 2:
        bytes();
        break;
      case 5:
        fixed<uint32_t>();
        break;
      default:
        fail(ExitCode::kBadData, "{}: protobuf wire type {} is not valid", where_, wire);
    }
  }

 private:
  void need(uint64_t n) const {
    DNALLM_CHECK(n <= s_.size() - pos_, ExitCode::kBadData, "{}: truncated protobuf", where_);
  }
  std::string_view s_;
  size_t pos_ = 0;
  const std::string& where_;
};

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  const auto& t = crc_table();
  uint32_t c = 0xffffffffu;
  for (unsigned char b : bytes) c = t[(c ^ b) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

EventFileWriter::EventFileWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const auto seconds = static_cast<int64_t>(now_s());
  path_ = dir + "/events.out.tfevents." + std::to_string(seconds) + "." + host + "." +
          std::to_string(::getpid()) + ".dnallm";
  file_ = std::fopen(path_.c_str(), "wb");
  DNALLM_CHECK(file_ != nullptr, ExitCode::kUsage,
               "cannot write a TensorBoard event file in logging.tensorboard_dir = \"{}\": {}", dir,
               errno_string());
  std::string event;
  put_double(event, 1, now_s());
  put_bytes(event, 3, "brain.Event:2");
  write_record(event);
}

EventFileWriter::~EventFileWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void EventFileWriter::add_scalars(int64_t step,
                                  const std::vector<std::pair<std::string, double>>& scalars,
                                  double wall_time) {
  if (scalars.empty()) return;
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_float(v, 2, static_cast<float>(value));
    put_bytes(summary, 1, v);
  }
  std::string event;
  put_double(event, 1, wall_time < 0 ? now_s() : wall_time);
  put_int(event, 2, step);
  put_bytes(event, 5, summary);
  write_record(event);
}

void EventFileWriter::write_record(const std::string& payload) {
  std::string header;
  put_fixed<uint64_t>(header, payload.size());
  std::string record = header;
  put_fixed<uint32_t>(record, masked_crc32c(header));
  record += payload;
  put_fixed<uint32_t>(record, masked_crc32c(payload));
  const bool ok = std::fwrite(record.data(), 1, record.size(), file_) == record.size() &&
                  std::fflush(file_) == 0;
  DNALLM_CHECK(ok, ExitCode::kFailure, "write to {} failed: {}", path_, errno_string());
}

std::vector<TensorBoardEvent> read_event_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DNALLM_CHECK(f.good(), ExitCode::kBadData, "cannot read {}: {}", path, errno_string());
  const std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<TensorBoardEvent> events;
  size_t pos = 0;
  while (pos < data.size()) {
    const std::string where = path + " at byte " + std::to_string(pos);
    DNALLM_CHECK(data.size() - pos >= 12, ExitCode::kBadData, "{}: truncated record header", where);
    const std::string_view header(data.data() + pos, 8);
    uint64_t len;
    uint32_t len_crc;
    std::memcpy(&len, header.data(), 8);
    std::memcpy(&len_crc, data.data() + pos + 8, 4);
    DNALLM_CHECK(len_crc == masked_crc32c(header), ExitCode::kBadData,
                 "{}: the length's masked CRC32C does not match", where);
    DNALLM_CHECK(len <= data.size() - pos - 12 && data.size() - pos - 12 - len >= 4,
                 ExitCode::kBadData, "{}: record of {} bytes runs past the end", where, len);
    const std::string_view payload(data.data() + pos + 12, len);
    uint32_t data_crc;
    std::memcpy(&data_crc, data.data() + pos + 12 + len, 4);
    DNALLM_CHECK(data_crc == masked_crc32c(payload), ExitCode::kBadData,
                 "{}: the payload's masked CRC32C does not match", where);
    pos += 12 + len + 4;

    TensorBoardEvent e;
    Decoder d(payload, where);
    while (!d.done()) {
      const auto key = d.varint();
      const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
      if (field == 1 && wire == 1) {
        e.wall_time = d.fixed<double>();
      } else if (field == 2 && wire == 0) {
        e.step = static_cast<int64_t>(d.varint());
      } else if (field == 3 && wire == 2) {
        e.file_version = std::string(d.bytes());
      } else if (field == 5 && wire == 2) {
        Decoder summary(d.bytes(), where);
        while (!summary.done()) {
          const auto skey = summary.varint();
          if (skey != ((1 << 3) | 2)) {
            summary.skip(static_cast<int>(skey & 7));
            continue;
          }
          Decoder value(summary.bytes(), where);
          std::string tag;
          float simple = 0;
          while (!value.done()) {
            const auto vkey = value.varint();
            if (vkey == ((1 << 3) | 2)) {
              tag = std::string(value.bytes());
            } else if (vkey == ((2 << 3) | 5)) {
              simple = value.fixed<float>();
            } else {
              value.skip(static_cast<int>(vkey & 7));
            }
          }
          e.scalars.emplace_back(tag, simple);
        }
      } else {
        d.skip(wire);
      }
    }
    events.push_back(std::move(e));
  }
  return events;
}

}  // namespace dnallm
