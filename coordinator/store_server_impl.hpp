// Internal to coordinator/store_server*.cpp: the server's state (StoreServer::Impl) and its
// sessions (Responder::Target), shared by store_server.cpp (connections, the accept loop, the
// public API) and store_server_ops.cpp (the built-in store ops). See Note [Hostile clients]
// in coordinator/store_server.hpp.
#pragma once

#include <atomic>
#include <chrono>
#include <list>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include <spdlog/spdlog.h>
#include <boost/asio.hpp>

#include "coordinator/store.hpp"
#include "coordinator/store_server.hpp"

namespace dnallm::coordinator {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// One client connection. Strictly sequential: read a frame, dispatch, wait for the
// handler's single reply, write it, read the next frame. All on the io thread.
// See Note [Hostile clients] in the header for the deadlines and budgets enforced here.
struct Responder::Target : std::enable_shared_from_this<Responder::Target> {
  Target(StoreServer::Impl& server, tcp::socket socket, uint64_t id);
  void start();
  void read_header();
  void on_header();
  void read_body(uint32_t n);
  void dispatch();
  void on_hello(FrameReader& args);
  void reply(std::vector<uint8_t> frame, bool close_after);
  void close(const std::string& why, bool warn);
  // Arms the single deadline timer (the handshake's or the current frame's); a timer
  // armed again or cancelled never fires its old expiry.
  void arm_deadline(std::chrono::milliseconds after, std::string why);
  void cancel_deadline();
  void release_body();
  void leave_pending();  // out of the server's list of connections waiting for HELLO

  StoreServer::Impl& server_;
  tcp::socket socket_;
  uint64_t id_;
  std::string peer_;
  uint8_t header_[4] = {};
  size_t header_got_ = 0;
  std::vector<uint8_t> body_;
  uint64_t reserved_ = 0;  // bytes of body_ counted in the server's buffered_bytes
  asio::steady_timer deadline_;
  uint64_t deadline_seq_ = 0;
  bool authed_ = false;
  bool awaiting_reply_ = false;
  bool closed_ = false;
  bool pending_ = false;  // in the server's list of connections waiting for HELLO
  std::list<Target*>::iterator pending_it_;
  std::vector<std::string> owned_keys_;
};

namespace detail {

// At most kBurst warnings a second; the rest are counted and reported as one line.
class WarningBudget {
 public:
  static constexpr int kBurst = 10;
  bool allow() {
    auto now = std::chrono::steady_clock::now();
    if (now - window_start_ >= std::chrono::seconds(1)) {
      if (suppressed_ > 0)
        spdlog::warn(
            "coordinator: {} more warning(s) like the above suppressed in the last {:.1f} s",
            suppressed_, std::chrono::duration<double>(now - window_start_).count());
      window_start_ = now;
      in_window_ = 0;
      suppressed_ = 0;
    }
    if (in_window_ < kBurst) {
      ++in_window_;
      return true;
    }
    ++suppressed_;
    return false;
  }

 private:
  std::chrono::steady_clock::time_point window_start_{};
  int in_window_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace detail

struct StoreServer::Impl {
  struct Waiter {
    std::vector<std::string> keys;
    Responder reply;
    std::unique_ptr<asio::steady_timer> timer;
    bool done = false;
  };

  explicit Impl(StoreServerOptions o);

  void accept();
  void accept_ready();
  void on_accepted(int fd);
  void accept_failed(int err, int accepted);
  // Closes the connection that has waited longest for its HELLO; false if none waits.
  bool evict_oldest_pending(const char* why);
  void warn(const std::string& message) {
    if (warnings.allow()) spdlog::warn("coordinator: {}", message);
  }
  void register_builtins();
  // The built-in ops' handlers (coordinator/store_wire.hpp).
  void on_ping(FrameReader& a, Responder r);
  void on_set(FrameReader& a, Responder r);
  void on_set_owned(FrameReader& a, Responder r);
  void on_get(FrameReader& a, Responder r);
  void on_wait(FrameReader& a, Responder r);
  void on_add(FrameReader& a, Responder r);
  void on_compare_set(FrameReader& a, Responder r);
  void on_delete(FrameReader& a, Responder r);
  void on_check(FrameReader& a, Responder r);
  void on_num_keys(FrameReader& a, Responder r);
  void set_value(const std::string& key, Bytes value);  // set: a plain (not owned) key
  void on_write(const std::string& key);                // wakes waiters whose keys now all exist
  void on_session_closed(Responder::Target& s);

  StoreServerOptions options;
  asio::io_context io;
  tcp::acceptor acceptor;
  std::thread thread;
  std::atomic<uint16_t> port{0};
  std::atomic<bool> stopped{false};
  uint64_t next_session_id = 1;
  // Everything below: io thread only.
  std::unordered_map<uint8_t, Handler> handlers;
  detail::KeyValues data;
  std::map<std::string, uint64_t> owner;  // owned key -> session id
  std::list<std::shared_ptr<Waiter>> waiters;
  std::set<std::shared_ptr<Responder::Target>> sessions;
  std::list<Responder::Target*> pending;  // waiting for HELLO, oldest first
  uint64_t buffered_bytes = 0;            // frame bodies being received, all sessions
  asio::steady_timer accept_timer;
  std::chrono::milliseconds accept_backoff{0};
  detail::WarningBudget warnings;
};

}  // namespace dnallm::coordinator
