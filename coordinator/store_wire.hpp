// The key-value store's messages on the frame protocol (coordinator/protocol.hpp, steps 1
// and 5): one struct per request and reply shape, with its field list (wire_fields), so that
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

// Field lists (protocol.hpp, "Message codecs").
constexpr auto wire_fields(const HelloRequest*) {
  return std::make_tuple(&HelloRequest::version, &HelloRequest::token);
}
constexpr auto wire_fields(const KeyValueRequest*) {
  return std::make_tuple(&KeyValueRequest::key, &KeyValueRequest::value);
}
constexpr auto wire_fields(const KeyRequest*) { return std::make_tuple(&KeyRequest::key); }
constexpr auto wire_fields(const KeysRequest*) { return std::make_tuple(&KeysRequest::keys); }
constexpr auto wire_fields(const WaitRequest*) {
  return std::make_tuple(&WaitRequest::keys, &WaitRequest::timeout_ms);
}
constexpr auto wire_fields(const AddRequest*) {
  return std::make_tuple(&AddRequest::key, &AddRequest::delta);
}
constexpr auto wire_fields(const CompareSetRequest*) {
  return std::make_tuple(&CompareSetRequest::key, &CompareSetRequest::expected,
                         &CompareSetRequest::desired);
}
constexpr auto wire_fields(const NoFields*) { return std::make_tuple(); }
constexpr auto wire_fields(const ValueReply*) { return std::make_tuple(&ValueReply::value); }
constexpr auto wire_fields(const CountReply*) { return std::make_tuple(&CountReply::value); }
constexpr auto wire_fields(const FlagReply*) { return std::make_tuple(&FlagReply::value); }

}  // namespace dnallm::coordinator
