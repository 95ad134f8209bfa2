// The key-value store's messages on the frame protocol (coordinator/protocol.hpp, steps 1
// and 5): one struct per request and reply shape, with its field list (WireFields), so that
// TcpStoreClient (encode_request, decode_message of the reply) and StoreServer
// (decode_message of the request, encode_reply) share one definition of each op.
//
//   op           request            OK reply
//   kHello       HelloRequest       (nothing); kUnauthorized: reason = the server's identity
//   kSet         KeyValueRequest    (nothing)
//   kSetOwned    KeyValueRequest    (nothing)
//   kGet         KeyRequest         ValueReply (kNotFound: nothing)
//   kWait        WaitRequest        (nothing) (kTimeout: nothing)
//   kAdd         AddRequest         CountReply (the new value)
//   kCompareSet  CompareSetRequest  ValueReply (the value stored afterwards)
//   kDelete      KeyRequest         FlagReply (existed)
//   kCheck       KeysRequest        FlagReply (all exist)
//   kNumKeys     NoFields           CountReply
//   kPing        NoFields           (nothing)
// A kBadRequest reply (any op) carries a reason (encode_reason / decode_reason).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/protocol.hpp"

namespace dnallm::coordinator {

struct HelloRequest {
  uint32_t version = kProtocolVersion;
  std::string token;
};
struct KeyValueRequest {
  std::string key;
  std::vector<uint8_t> value;
};
struct KeyRequest {
  std::string key;
};
struct KeysRequest {
  std::vector<std::string> keys;
};
struct WaitRequest {
  std::vector<std::string> keys;
  int64_t timeout_ms = 0;
};
struct AddRequest {
  std::string key;
  int64_t delta = 0;
};
struct CompareSetRequest {
  std::string key;
  std::vector<uint8_t> expected;
  std::vector<uint8_t> desired;
};
struct NoFields {};

struct ValueReply {
  std::vector<uint8_t> value;
};
struct CountReply {
  int64_t value = 0;
};
struct FlagReply {
  bool value = false;
};

// The fields of a kBadRequest or kUnauthorized reply: one string.
FrameWriter encode_reason(const std::string& reason);
// The reason in such a reply's fields; "" when there is none or it does not parse (a
// refusal is reported either way).
std::string decode_reason(const uint8_t* fields, size_t n);

template <>
struct WireFields<HelloRequest> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.version, m.token);
  }
};
template <>
struct WireFields<KeyValueRequest> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.key, m.value);
  }
};
template <>
struct WireFields<KeyRequest> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.key);
  }
};
template <>
struct WireFields<KeysRequest> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.keys);
  }
};
template <>
struct WireFields<WaitRequest> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.keys, m.timeout_ms);
  }
};
template <>
struct WireFields<AddRequest> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.key, m.delta);
  }
};
template <>
struct WireFields<CompareSetRequest> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.key, m.expected, m.desired);
  }
};
template <>
struct WireFields<NoFields> {
  template <class M, class F>
  static auto of(M&, F&& f) {
    return f();
  }
};
template <>
struct WireFields<ValueReply> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.value);
  }
};
template <>
struct WireFields<CountReply> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.value);
  }
};
template <>
struct WireFields<FlagReply> {
  template <class M, class F>
  static auto of(M& m, F&& f) {
    return f(m.value);
  }
};

}  // namespace dnallm::coordinator
