// The coordinator's wire protocol: length-prefixed binary frames over TCP.
//
// Protocol (also in docs/protocol.md):
//  1. The client connects and sends a HELLO frame: op kHello, u32 protocol version
//     (kProtocolVersion), string job token. The server answers kOk, or kUnauthorized /
//     kBadRequest and closes the connection (logged with the peer address). No other op is
//     accepted before a successful HELLO. kUnauthorized carries a string naming the server
//     (e.g. "dnallm coordinator (pid 123 on host n01)"), so a client that reached another
//     job's coordinator can say so. The HELLO frame may hold at most kMaxHelloBytes and must
//     arrive within the server's handshake timeout (10 s by default), else the connection
//     is closed.
//  2. Every frame is: u32 body length (little endian, excluding these 4 bytes), then the
//     body: u8 op code, then op-specific fields. A body longer than the server's
//     max_frame_bytes, an empty body, an unknown op or a body whose fields do not parse
//     exactly closes the connection (logged); other connections are unaffected.
//  3. Field encodings: u8/u32/i64 little endian; string and bytes = u32 length + raw
//     bytes; a key list = u32 count + strings.
//  4. The client sends one request and reads one response before the next request
//     (no pipelining is needed; the server queues responses in order anyway).
//     A response frame's body is: u8 status (Status), then op-specific fields.
//  5. Requests and their OK responses (each op's request and reply struct, encoded and
//     decoded from one field list, in coordinator/store_wire.hpp; "Message codecs" below):
//       kSet       key, value                          -> (nothing)
//       kSetOwned  key, value                          -> (nothing); the key is deleted
//                                                         when this connection closes
//       kGet       key                                 -> value   (kNotFound if missing)
//       kWait      key list, i64 timeout_ms            -> (nothing) once all exist;
//                                                         kTimeout after timeout_ms
//       kAdd       key, i64 delta                      -> i64 new value
//       kCompareSet key, expected, desired             -> value stored afterwards
//       kDelete    key                                 -> u8 existed
//       kCheck     key list                            -> u8 all exist
//       kNumKeys   (nothing)                           -> i64 count
//       kPing      (nothing)                           -> (nothing)
//  6. New message types (rendezvous, heartbeats) get new op codes and are registered with
//     StoreServer::register_handler; the frame layer does not change. The elastic ops
//     (32..36) are specified, with their encode/decode pairs, in
//     coordinator/elastic_wire.hpp; the checkpoint commit ops (37..38) in
//     coordinator/commit_registry.hpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace dnallm::coordinator {

constexpr uint32_t kProtocolVersion = 1;
constexpr uint32_t kDefaultMaxFrameBytes = 64u << 20;  // 64 MiB
// The largest frame a server accepts before HELLO (a HELLO with a token of up to ~4 KB).
constexpr uint32_t kMaxHelloBytes = 4096;

enum class Op : uint8_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kWait = 4,
  kAdd = 5,
  kCompareSet = 6,
  kDelete = 7,
  kCheck = 8,
  kNumKeys = 9,
  kSetOwned = 10,
  kPing = 11,
  // 32..63: elastic membership (coordinator/elastic_wire.hpp, docs/elastic.md).
  kElasticJoin = 32,
  kElasticHeartbeat = 33,
  kElasticReportFailure = 34,
  kElasticReportSuccess = 35,
  kElasticState = 36,
  // Checkpoint commit through the coordinator (coordinator/commit_registry.hpp).
  kCkptShardDurable = 37,
  kCkptCommitted = 38,
  // 64..127: reserved.
};

enum class Status : uint8_t {
  kOk = 0,
  kNotFound = 1,
  kTimeout = 2,
  kBadRequest = 3,
  kUnauthorized = 4,
};

const char* op_name(uint8_t op);

// Builds a frame body field by field.
class FrameWriter {
 public:
  FrameWriter& u8(uint8_t v);
  FrameWriter& u32(uint32_t v);
  FrameWriter& i64(int64_t v);
  FrameWriter& bytes(const void* data, size_t n);
  FrameWriter& str(const std::string& s) { return bytes(s.data(), s.size()); }
  FrameWriter& blob(const std::vector<uint8_t>& b) { return bytes(b.data(), b.size()); }
  FrameWriter& keys(const std::vector<std::string>& ks);
  // Appends another writer's body (e.g. a reply's fields after its status byte).
  FrameWriter& append(const FrameWriter& other);
  // The whole frame: 4-byte length prefix + body.
  std::vector<uint8_t> frame() const;
  const std::vector<uint8_t>& body() const { return body_; }

 private:
  std::vector<uint8_t> body_;
};

// Parses a frame body. Every accessor throws ProtocolError on truncation.
class FrameReader {
 public:
  FrameReader(const uint8_t* data, size_t n) : data_(data), n_(n) {}
  uint8_t u8();
  uint32_t u32();
  int64_t i64();
  std::vector<uint8_t> blob();
  std::string str();
  std::vector<std::string> keys();
  bool done() const { return pos_ == n_; }
  size_t remaining() const { return n_ - pos_; }
  // Throws ProtocolError unless every byte was consumed.
  void expect_done() const;

 private:
  void need(size_t k) const;
  const uint8_t* data_;
  size_t n_;
  size_t pos_ = 0;
};

struct ProtocolError : std::exception {
  explicit ProtocolError(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
  std::string message;
};

uint32_t decode_u32_le(const uint8_t* p);

// ---------------------------------------------------------------- Message codecs
//
// Every op's request and reply is a struct whose fields are listed once, in wire order, by
// a `wire_fields` function next to the op's documentation (coordinator/store_wire.hpp,
// coordinator/elastic_wire.hpp), found by argument-dependent lookup:
//
//   constexpr auto wire_fields(const AddRequest*) {
//     return std::make_tuple(&AddRequest::key, &AddRequest::delta);
//   }
//
// encode_request / encode_reply and decode_message all follow that one list, so an op's
// encoder and decoder cannot disagree. A field is written by write_field and read by
// read_field:
//   uint8_t, bool (u8 0/1; any non-zero byte reads as true), uint32_t, int64_t,
//   int (as i64), std::string (string), std::vector<uint8_t> (bytes),
//   std::vector<std::string> (key list), std::vector<int64_t> (u32 count + i64 each),
//   std::optional<T> (u8 present, then T when 1), and any type with a wire_fields list
//   (its fields inline). An enum gets its own write_field/read_field overloads (found by
//   argument-dependent lookup) that check its range.
void write_field(FrameWriter& w, uint8_t v);
void write_field(FrameWriter& w, bool v);
void write_field(FrameWriter& w, uint32_t v);
void write_field(FrameWriter& w, int64_t v);
void write_field(FrameWriter& w, int v);
void write_field(FrameWriter& w, const std::string& v);
void write_field(FrameWriter& w, const std::vector<uint8_t>& v);
void write_field(FrameWriter& w, const std::vector<std::string>& v);
void write_field(FrameWriter& w, const std::vector<int64_t>& v);
void read_field(FrameReader& r, uint8_t& v);
void read_field(FrameReader& r, bool& v);
void read_field(FrameReader& r, uint32_t& v);
void read_field(FrameReader& r, int64_t& v);
void read_field(FrameReader& r, int& v);
void read_field(FrameReader& r, std::string& v);
void read_field(FrameReader& r, std::vector<uint8_t>& v);
void read_field(FrameReader& r, std::vector<std::string>& v);
// Throws ProtocolError when the count exceeds what the frame can hold.
void read_field(FrameReader& r, std::vector<int64_t>& v);

template <class T>
void write_field(FrameWriter& w, const std::optional<T>& v) {
  write_field(w, v.has_value());
  if (v) write_field(w, *v);
}

template <class T>
void read_field(FrameReader& r, std::optional<T>& v) {
  bool present = false;
  read_field(r, present);
  v.reset();
  if (!present) return;
  T t{};
  read_field(r, t);
  v = std::move(t);
}

// A message: its wire_fields, in order.
template <class M>
void write_field(FrameWriter& w, const M& m) {
  std::apply([&](auto... field) { (write_field(w, m.*field), ...); },
             wire_fields(static_cast<const M*>(nullptr)));
}

template <class M>
void read_field(FrameReader& r, M& m) {
  std::apply([&](auto... field) { (read_field(r, m.*field), ...); },
             wire_fields(static_cast<const M*>(nullptr)));
}

// A request body: the op byte, then the message's fields.
template <class M>
FrameWriter encode_request(Op op, const M& m) {
  FrameWriter w;
  w.u8(static_cast<uint8_t>(op));
  write_field(w, m);
  return w;
}

// A reply's fields (Responder::send puts the status byte in front).
template <class M>
FrameWriter encode_reply(const M& m) {
  FrameWriter w;
  write_field(w, m);
  return w;
}

// Reads a whole message (a request after its op byte, or a reply after its status byte):
// throws ProtocolError on truncation or trailing bytes.
template <class M>
M decode_message(FrameReader& r) {
  M m{};
  read_field(r, m);
  r.expect_done();
  return m;
}

// The same, over a reply's fields as TcpStoreClient returns them.
template <class M>
M decode_message(const std::vector<uint8_t>& body) {
  FrameReader r(body.data(), body.size());
  return decode_message<M>(r);
}

}  // namespace dnallm::coordinator
