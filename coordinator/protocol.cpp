#include "coordinator/protocol.hpp"

#include <cstring>

namespace dnallm::coordinator {

const char* op_name(uint8_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kHello:
      return "hello";
    case Op::kSet:
      return "set";
    case Op::kGet:
      return "get";
    case Op::kWait:
      return "wait";
    case Op::kAdd:
      return "add";
    case Op::kCompareSet:
      return "compare_set";
    case Op::kDelete:
      return "delete";
    case Op::kCheck:
      return "check";
    case Op::kNumKeys:
      return "num_keys";
    case Op::kSetOwned:
      return "set_owned";
    case Op::kPing:
      return "ping";
    case Op::kElasticJoin:
      return "elastic_join";
    case Op::kElasticHeartbeat:
      return "elastic_heartbeat";
    case Op::kElasticReportFailure:
      return "elastic_report_failure";
    case Op::kElasticReportSuccess:
      return "elastic_report_success";
    case Op::kElasticState:
      return "elastic_state";
    case Op::kCkptShardDurable:
      return "ckpt_shard_durable";
    case Op::kCkptCommitted:
      return "ckpt_committed";
  }
  return "unknown";
}

FrameWriter& FrameWriter::u8(uint8_t v) {
  body_.push_back(v);
  return *this;
}

FrameWriter& FrameWriter::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) body_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  return *this;
}

FrameWriter& FrameWriter::i64(int64_t v) {
  auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) body_.push_back(static_cast<uint8_t>(u >> (8 * i)));
  return *this;
}

FrameWriter& FrameWriter::bytes(const void* data, size_t n) {
  u32(static_cast<uint32_t>(n));
  auto p = static_cast<const uint8_t*>(data);
  body_.insert(body_.end(), p, p + n);
  return *this;
}

FrameWriter& FrameWriter::keys(const std::vector<std::string>& ks) {
  u32(static_cast<uint32_t>(ks.size()));
  for (const auto& k : ks) str(k);
  return *this;
}

FrameWriter& FrameWriter::append(const FrameWriter& other) {
  body_.insert(body_.end(), other.body_.begin(), other.body_.end());
  return *this;
}

std::vector<uint8_t> FrameWriter::frame() const {
  std::vector<uint8_t> out(4 + body_.size());
  auto n = static_cast<uint32_t>(body_.size());
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  if (!body_.empty()) std::memcpy(out.data() + 4, body_.data(), body_.size());
  return out;
}

uint32_t decode_u32_le(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

void FrameReader::need(size_t k) const {
  if (n_ - pos_ < k)
    throw ProtocolError("truncated frame: need " + std::to_string(k) + " more bytes at offset " +
                        std::to_string(pos_) + " of " + std::to_string(n_));
}

uint8_t FrameReader::u8() {
  need(1);
  return data_[pos_++];
}

uint32_t FrameReader::u32() {
  need(4);
  uint32_t v = decode_u32_le(data_ + pos_);
  pos_ += 4;
  return v;
}

int64_t FrameReader::i64() {
  need(8);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(data_[pos_ + i]) << (8 * i);
  pos_ += 8;
  return static_cast<int64_t>(v);
}

std::vector<uint8_t> FrameReader::blob() {
  uint32_t n = u32();
  need(n);
  std::vector<uint8_t> out(data_ + pos_, data_ + pos_ + n);
  pos_ += n;
  return out;
}

std::string FrameReader::str() {
  uint32_t n = u32();
  need(n);
  std::string out(reinterpret_cast<const char*>(data_ + pos_), n);
  pos_ += n;
  return out;
}

std::vector<std::string> FrameReader::keys() {
  uint32_t count = u32();
  // Each key needs at least its 4-byte length: bound the count before reserving.
  if (count > (n_ - pos_) / 4) throw ProtocolError("key count exceeds frame size");
  std::vector<std::string> out;
  out.reserve(count);
  for (uint32_t i = 0; i < count; ++i) out.push_back(str());
  return out;
}

void write_field(FrameWriter& w, uint8_t v) { w.u8(v); }
void write_field(FrameWriter& w, bool v) { w.u8(v ? 1 : 0); }
void write_field(FrameWriter& w, uint32_t v) { w.u32(v); }
void write_field(FrameWriter& w, int64_t v) { w.i64(v); }
void write_field(FrameWriter& w, int v) { w.i64(v); }
void write_field(FrameWriter& w, const std::string& v) { w.str(v); }
void write_field(FrameWriter& w, const std::vector<uint8_t>& v) { w.blob(v); }
void write_field(FrameWriter& w, const std::vector<std::string>& v) { w.keys(v); }

void write_field(FrameWriter& w, const std::vector<int64_t>& v) {
  w.u32(static_cast<uint32_t>(v.size()));
  for (int64_t x : v) w.i64(x);
}

void read_field(FrameReader& r, uint8_t& v) { v = r.u8(); }
void read_field(FrameReader& r, bool& v) { v = r.u8() != 0; }
void read_field(FrameReader& r, uint32_t& v) { v = r.u32(); }
void read_field(FrameReader& r, int64_t& v) { v = r.i64(); }
void read_field(FrameReader& r, int& v) { v = static_cast<int>(r.i64()); }
void read_field(FrameReader& r, std::string& v) { v = r.str(); }
void read_field(FrameReader& r, std::vector<uint8_t>& v) { v = r.blob(); }
void read_field(FrameReader& r, std::vector<std::string>& v) { v = r.keys(); }

void read_field(FrameReader& r, std::vector<int64_t>& v) {
  const uint32_t count = r.u32();
  if (count > r.remaining() / 8) throw ProtocolError("i64 count exceeds frame size");
  v.resize(count);
  for (auto& x : v) x = r.i64();
}

void FrameReader::expect_done() const {
  if (pos_ != n_)
    throw ProtocolError(std::to_string(n_ - pos_) + " trailing bytes after the last field");
}

}  // namespace dnallm::coordinator
