// StoreServer: the coordinator's TCP key-value service (Boost.Asio, one io thread).
//
// Speaks the frame protocol documented in coordinator/protocol.hpp (numbered steps) and
// docs/protocol.md. Robustness: a frame larger than max_frame_bytes, a malformed frame,
// an unknown op or a wrong job token closes only that connection, with a warning naming
// the peer; the server and other clients are unaffected.
//
// Threads: start() spawns the io thread that owns all server state (the key-value map,
// waiters, sessions): handlers run on it and need no locks. stop() may be called from any
// thread (including a signal-watching one); join() waits for the io thread. The
// destructor calls stop() and join().
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/protocol.hpp"

namespace dnallm::coordinator {

struct StoreServerOptions {
  std::string host = "0.0.0.0";  // bind address ("127.0.0.1" for loopback-only)
  uint16_t port = 0;             // 0: the kernel picks one; read it back with port()
  std::string token;             // job token every client must present in HELLO
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
};

// Sends the single response to one request. Copyable; valid only on the io thread (a
// handler may keep it and answer later, e.g. when a waited-for key appears). Answering
// after the connection closed is a no-op.
class Responder {
 public:
  struct Target;  // opaque: the session
  Responder() = default;
  explicit Responder(std::shared_ptr<Target> t) : target_(std::move(t)) {}
  void send(Status status, const FrameWriter& fields = FrameWriter()) const;
  // Identifies the connection (stable for its lifetime; never reused).
  uint64_t session_id() const;

 private:
  std::shared_ptr<Target> target_;
};

class StoreServer {
 public:
  // A request handler: runs on the io thread; parses `args` (throwing ProtocolError closes
  // the connection) and must eventually call reply.send() exactly once.
  using Handler = std::function<void(FrameReader& args, Responder reply)>;

  explicit StoreServer(StoreServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // Adds a message type (rendezvous, heartbeats). Call before start(); op must not be a
  // built-in one.
  void register_handler(uint8_t op, Handler handler);

  // Binds and listens (throws Error(kUsage) if the address is unusable), then starts the
  // io thread. Returns once port() is valid.
  void start();
  // The bound port (valid after start()).
  uint16_t port() const;
  // Deletes every key that starts with one of `prefixes` (owned keys too). Any thread;
  // asynchronous: it runs on the io thread after the requests queued before it, and
  // waiters on those keys keep waiting (for a new value). A no-op before start().
  void erase_prefixes(std::vector<std::string> prefixes);
  // Closes the listener and every connection and stops the io thread. Idempotent.
  void stop();
  // Waits for the io thread to end (after stop()).
  void join();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dnallm::coordinator
