// StoreServer: the coordinator's TCP key-value service (Boost.Asio, one io thread).
//
// Speaks the frame protocol documented in coordinator/protocol.hpp (numbered steps) and
// docs/protocol.md. Robustness: a frame larger than max_frame_bytes, a malformed frame,
// an unknown op or a wrong job token closes only that connection, with a warning naming
// the peer; the server and other clients are unaffected.
//
// Note [Hostile clients]: the coordinator is the job's single point of contact, so what an
// unauthenticated client can cost is bounded:
//  - before a successful HELLO a frame may hold at most max_hello_bytes, and the whole HELLO
//    must arrive within handshake_timeout of the accept (idle and slow-drip clients are cut);
//  - after HELLO, a frame whose first byte arrived must be complete within frame_timeout;
//  - at most max_pending_connections connections may be waiting for their HELLO: a new one
//    beyond that evicts the oldest pending one (a legitimate client sends HELLO at once, so
//    a flood cannot starve it), and at most max_connections are open in all;
//  - frame bodies being received hold at most max_buffered_bytes in total;
//  - when accept() fails (EMFILE: the descriptor limit), the server evicts the older half
//    of the pending connections and accepts again after 10 ms if the last round accepted
//    some, else after a back-off (100 ms, doubling to 1 s): never a busy loop;
//  - every socket is close-on-exec, so workers spawned by the launcher never hold them.
// Warnings about refused clients are rate limited (a burst, then a count once a second).
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
  // See Note [Hostile clients].
  uint32_t max_hello_bytes = kMaxHelloBytes;
  std::chrono::milliseconds handshake_timeout{10000};
  std::chrono::milliseconds frame_timeout{30000};
  size_t max_pending_connections = 128;
  size_t max_connections = 4096;
  uint64_t max_buffered_bytes = 256ull << 20;
  // Told to a client whose job token is wrong (in the UNAUTHORIZED reply), so that one that
  // reached another job's coordinator can say what it reached. Default: "dnallm coordinator
  // (pid P on host H)".
  std::string identity = "";
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
