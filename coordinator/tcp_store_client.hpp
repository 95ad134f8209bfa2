// TcpStoreClient: a blocking Store on one TCP connection to a StoreServer.
//
// Contracts:
//  - Thread-safe: calls are serialised on an internal mutex (one request in flight per
//    connection; a long `wait` delays other callers of the same client).
//  - Every operation has a deadline: `timeout` for get/wait, `op_timeout` for the others.
//    Expiry throws Error(ExitCode::kPeerFailed) naming the coordinator address and op.
//  - Connection loss: the next call reconnects (retrying until connect_timeout, since the
//    server may still be starting), re-presents the token and re-sets this client's owned
//    keys. Idempotent ops (everything except add and compare_and_set) are retried once
//    after a reconnect; the others throw.
//  - A wrong token throws Error(ExitCode::kUsage) without retrying.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "coordinator/protocol.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {

struct TcpStoreClientOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::string token;
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};  // first connect/reconnect
  std::chrono::milliseconds op_timeout{std::chrono::seconds(30)};       // non-waiting ops
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
};

class TcpStoreClient final : public Store {
 public:
  // Connects now (blocking, up to connect_timeout).
  explicit TcpStoreClient(TcpStoreClientOptions options);
  ~TcpStoreClient() override;

  void set(const std::string& key, const Bytes& value) override;
  void set_owned(const std::string& key, const Bytes& value) override;
  std::optional<Bytes> try_get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_and_set(const std::string& key, const Bytes& expected,
                        const Bytes& desired) override;
  bool remove(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t num_keys() override;
  void ping();

  // Drops the connection (for tests of reconnect); the next call reconnects.
  void disconnect();
  std::string address() const;

  // One request of a registered (non-store) message type, e.g. the elastic ops: `req` is the
  // whole body (op first). Same deadline, reconnect and retry rules as the store ops; a
  // kBadRequest reply throws Error(kFailure) with the server's message.
  struct Response {
    Status status;
    std::vector<uint8_t> body;  // fields after the status byte
  };
  Response request(const FrameWriter& req, std::chrono::milliseconds timeout, bool idempotent);
  // The fields of a reply to `op` as message M (decode_message); a malformed reply throws
  // Error(kPeerFailed) naming the coordinator and the op.
  template <class M>
  M decode_reply(const Response& reply, uint8_t op) const {
    try {
      return decode_message<M>(reply.body);
    } catch (const ProtocolError& e) {
      fail(ExitCode::kPeerFailed, "coordinator {} sent a malformed '{}' reply: {}", address(),
           op_name(op), e.what());
    }
  }
  const TcpStoreClientOptions& options() const { return options_; }

  struct Connection;

 private:
  void connect_locked(std::chrono::steady_clock::time_point deadline);
  // One connection attempt: connects, says HELLO and re-sets the owned keys. Throws
  // IoFailure (tcp_store_client.cpp) on a failure worth retrying.
  std::unique_ptr<Connection> try_connect_locked(std::chrono::steady_clock::time_point deadline);
  void restore_owned_locked(Connection& conn, std::chrono::steady_clock::time_point deadline);
  // request() of a store op's message (coordinator/store_wire.hpp).
  template <class Message>
  Response send(Op op, const Message& message, std::chrono::milliseconds timeout, bool idempotent);

  TcpStoreClientOptions options_;
  std::mutex mutex_;                    // serialises requests
  std::unique_ptr<Connection> conn_;    // guarded by mutex_
  std::map<std::string, Bytes> owned_;  // guarded by mutex_; re-set on reconnect
};

}  // namespace dnallm::coordinator
