#include "coordinator/store_server.hpp"

#include <atomic>
#include <list>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include <spdlog/spdlog.h>
#include <boost/asio.hpp>

#include "coordinator/store.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// One client connection. Strictly sequential: read a frame, dispatch, wait for the
// handler's single reply, write it, read the next frame. All on the io thread.
struct Responder::Target : std::enable_shared_from_this<Responder::Target> {
  Target(StoreServer::Impl& server, tcp::socket socket, uint64_t id);
  void start() { read_header(); }
  void read_header();
  void read_body(uint32_t n);
  void dispatch();
  void reply(std::vector<uint8_t> frame, bool close_after);
  void close(const std::string& why, bool warn);

  StoreServer::Impl& server_;
  tcp::socket socket_;
  uint64_t id_;
  std::string peer_;
  uint8_t header_[4] = {};
  std::vector<uint8_t> body_;
  bool authed_ = false;
  bool awaiting_reply_ = false;
  bool closed_ = false;
  std::vector<std::string> owned_keys_;
};

struct StoreServer::Impl {
  struct Waiter {
    std::vector<std::string> keys;
    Responder reply;
    std::unique_ptr<asio::steady_timer> timer;
    bool done = false;
  };

  explicit Impl(StoreServerOptions o) : options(std::move(o)), acceptor(io) {}

  void accept();
  void register_builtins();
  void on_write(const std::string& key);  // wakes waiters whose keys now all exist
  void on_session_closed(Responder::Target& s);
  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (data.count(k) == 0) return false;
    return true;
  }

  StoreServerOptions options;
  asio::io_context io;
  tcp::acceptor acceptor;
  std::thread thread;
  std::atomic<uint16_t> port{0};
  std::atomic<bool> stopped{false};
  uint64_t next_session_id = 1;
  // Everything below: io thread only.
  std::unordered_map<uint8_t, Handler> handlers;
  std::map<std::string, Bytes> data;
  std::map<std::string, uint64_t> owner;  // owned key -> session id
  std::list<std::shared_ptr<Waiter>> waiters;
  std::set<std::shared_ptr<Responder::Target>> sessions;
};

// ---------------------------------------------------------------- Responder

void Responder::send(Status status, const FrameWriter& fields) const {
  if (!target_ || target_->closed_) return;
  FrameWriter out;
  out.u8(static_cast<uint8_t>(status));
  std::vector<uint8_t> body = out.body();
  body.insert(body.end(), fields.body().begin(), fields.body().end());
  std::vector<uint8_t> frame(4 + body.size());
  auto n = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<uint8_t>(n >> (8 * i));
  std::copy(body.begin(), body.end(), frame.begin() + 4);
  target_->reply(std::move(frame), status == Status::kUnauthorized);
}

uint64_t Responder::session_id() const { return target_ ? target_->id_ : 0; }

// ---------------------------------------------------------------- Session

Responder::Target::Target(StoreServer::Impl& server, tcp::socket socket, uint64_t id)
    : server_(server), socket_(std::move(socket)), id_(id) {
  boost::system::error_code ec;
  auto ep = socket_.remote_endpoint(ec);
  peer_ = ec ? std::string("?") : ep.address().to_string() + ":" + std::to_string(ep.port());
  socket_.set_option(tcp::no_delay(true), ec);
}

void Responder::Target::read_header() {
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(header_),
                   [this, self](boost::system::error_code ec, size_t) {
                     if (ec) {
                       close(ec == asio::error::eof ? "closed by peer" : ec.message(), false);
                       return;
                     }
                     uint32_t n = decode_u32_le(header_);
                     if (n == 0 || n > server_.options.max_frame_bytes) {
                       close(fmt::format("frame of {} bytes rejected (limit {} bytes)", n,
                                         server_.options.max_frame_bytes),
                             true);
                       return;
                     }
                     read_body(n);
                   });
}

void Responder::Target::read_body(uint32_t n) {
  body_.resize(n);
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(body_),
                   [this, self](boost::system::error_code ec, size_t) {
                     if (ec) {
                       close("connection lost mid-frame: " + ec.message(), true);
                       return;
                     }
                     dispatch();
                   });
}

void Responder::Target::dispatch() {
  FrameReader args(body_.data(), body_.size());
  uint8_t op = 0;
  try {
    op = args.u8();
    if (!authed_) {
      if (op != static_cast<uint8_t>(Op::kHello)) {
        close(fmt::format("op '{}' ({}) before HELLO", op_name(op), op), true);
        return;
      }
      uint32_t version = args.u32();
      std::string token = args.str();
      args.expect_done();
      awaiting_reply_ = true;
      if (version != kProtocolVersion) {
        spdlog::warn("coordinator: refused {}: protocol version {} (expected {})", peer_, version,
                     kProtocolVersion);
        Responder(shared_from_this()).send(Status::kUnauthorized);
        return;
      }
      if (token != server_.options.token) {
        spdlog::warn("coordinator: refused {}: wrong job token (check DNALLM_JOB_TOKEN)", peer_);
        Responder(shared_from_this()).send(Status::kUnauthorized);
        return;
      }
      authed_ = true;
      Responder(shared_from_this()).send(Status::kOk);
      return;
    }
    auto it = server_.handlers.find(op);
    if (it == server_.handlers.end()) {
      close(fmt::format("unknown op {}", op), true);
      return;
    }
    awaiting_reply_ = true;
    it->second(args, Responder(shared_from_this()));
  } catch (const ProtocolError& e) {
    close(fmt::format("malformed '{}' frame: {}", op_name(op), e.what()), true);
  } catch (const std::exception& e) {
    // A handler's own failure (e.g. add() on a non-integer value): report, keep the session.
    spdlog::warn("coordinator: request '{}' from {} failed: {}", op_name(op), peer_, e.what());
    if (awaiting_reply_)
      Responder(shared_from_this()).send(Status::kBadRequest, FrameWriter().str(e.what()));
  }
}

void Responder::Target::reply(std::vector<uint8_t> frame, bool close_after) {
  if (closed_ || !awaiting_reply_) return;
  awaiting_reply_ = false;
  auto self = shared_from_this();
  auto buf = std::make_shared<std::vector<uint8_t>>(std::move(frame));
  asio::async_write(socket_, asio::buffer(*buf),
                    [this, self, buf, close_after](boost::system::error_code ec, size_t) {
                      if (ec) {
                        close("write failed: " + ec.message(), false);
                      } else if (close_after) {
                        close("refused", false);
                      } else {
                        read_header();
                      }
                    });
}

void Responder::Target::close(const std::string& why, bool warn) {
  if (closed_) return;
  closed_ = true;
  if (warn)
    spdlog::warn("coordinator: closing connection from {}: {}", peer_, why);
  else
    spdlog::debug("coordinator: connection from {} ended: {}", peer_, why);
  boost::system::error_code ec;
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  server_.on_session_closed(*this);
}

// ---------------------------------------------------------------- Server

void StoreServer::Impl::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec != asio::error::operation_aborted)
        spdlog::warn("coordinator: accept failed: {}", ec.message());
      if (!acceptor.is_open()) return;
    } else {
      auto s = std::make_shared<Responder::Target>(*this, std::move(socket), next_session_id++);
      sessions.insert(s);
      s->start();
    }
    accept();
  });
}

void StoreServer::Impl::on_session_closed(Responder::Target& s) {
  for (const auto& key : s.owned_keys_) {
    auto it = owner.find(key);
    if (it != owner.end() && it->second == s.id_) {
      owner.erase(it);
      data.erase(key);
    }
  }
  // Defer the erase: the session may be running one of its own handlers right now.
  auto self = s.shared_from_this();
  asio::post(io, [this, self] { sessions.erase(self); });
}

void StoreServer::Impl::on_write(const std::string& key) {
  for (auto it = waiters.begin(); it != waiters.end();) {
    auto& w = **it;
    bool relevant = false;
    for (const auto& k : w.keys) relevant = relevant || k == key;
    if (relevant && has_all(w.keys)) {
      w.done = true;
      w.timer->cancel();
      w.reply.send(Status::kOk);
      it = waiters.erase(it);
    } else {
      ++it;
    }
  }
}

void StoreServer::Impl::register_builtins() {
  auto set_value = [this](const std::string& key, Bytes value) {
    data[key] = std::move(value);
    owner.erase(key);
    on_write(key);
  };
  handlers[static_cast<uint8_t>(Op::kPing)] = [](FrameReader& a, Responder r) {
    a.expect_done();
    r.send(Status::kOk);
  };
  handlers[static_cast<uint8_t>(Op::kSet)] = [set_value](FrameReader& a, Responder r) {
    auto key = a.str();
    auto value = a.blob();
    a.expect_done();
    set_value(key, std::move(value));
    r.send(Status::kOk);
  };
  handlers[static_cast<uint8_t>(Op::kSetOwned)] = [this, set_value](FrameReader& a, Responder r) {
    auto key = a.str();
    auto value = a.blob();
    a.expect_done();
    set_value(key, std::move(value));
    owner[key] = r.session_id();
    for (auto& s : sessions)
      if (s->id_ == r.session_id()) s->owned_keys_.push_back(key);
    r.send(Status::kOk);
  };
  handlers[static_cast<uint8_t>(Op::kGet)] = [this](FrameReader& a, Responder r) {
    auto key = a.str();
    a.expect_done();
    auto it = data.find(key);
    if (it == data.end())
      r.send(Status::kNotFound);
    else
      r.send(Status::kOk, FrameWriter().blob(it->second));
  };
  handlers[static_cast<uint8_t>(Op::kWait)] = [this](FrameReader& a, Responder r) {
    auto keys = a.keys();
    int64_t timeout_ms = a.i64();
    a.expect_done();
    if (has_all(keys)) {
      r.send(Status::kOk);
      return;
    }
    auto w = std::make_shared<Waiter>();
    w->keys = std::move(keys);
    w->reply = r;
    w->timer = std::make_unique<asio::steady_timer>(io);
    w->timer->expires_after(std::chrono::milliseconds(std::max<int64_t>(0, timeout_ms)));
    waiters.push_back(w);
    w->timer->async_wait([this, w](boost::system::error_code ec) {
      if (ec || w->done) return;
      w->done = true;
      waiters.remove(w);
      w->reply.send(Status::kTimeout);
    });
  };
  handlers[static_cast<uint8_t>(Op::kAdd)] = [this](FrameReader& a, Responder r) {
    auto key = a.str();
    int64_t delta = a.i64();
    a.expect_done();
    auto it = data.find(key);
    int64_t v = (it == data.end() ? 0 : detail::parse_counter(it->second, key)) + delta;
    data[key] = to_bytes(std::to_string(v));
    on_write(key);
    r.send(Status::kOk, FrameWriter().i64(v));
  };
  handlers[static_cast<uint8_t>(Op::kCompareSet)] = [this](FrameReader& a, Responder r) {
    auto key = a.str();
    auto expected = a.blob();
    auto desired = a.blob();
    a.expect_done();
    auto it = data.find(key);
    if ((it == data.end() && expected.empty()) || (it != data.end() && it->second == expected)) {
      data[key] = desired;
      owner.erase(key);
      on_write(key);
      r.send(Status::kOk, FrameWriter().blob(desired));
    } else {
      r.send(Status::kOk, FrameWriter().blob(it == data.end() ? Bytes{} : it->second));
    }
  };
  handlers[static_cast<uint8_t>(Op::kDelete)] = [this](FrameReader& a, Responder r) {
    auto key = a.str();
    a.expect_done();
    owner.erase(key);
    r.send(Status::kOk, FrameWriter().u8(data.erase(key) > 0 ? 1 : 0));
  };
  handlers[static_cast<uint8_t>(Op::kCheck)] = [this](FrameReader& a, Responder r) {
    auto keys = a.keys();
    a.expect_done();
    r.send(Status::kOk, FrameWriter().u8(has_all(keys) ? 1 : 0));
  };
  handlers[static_cast<uint8_t>(Op::kNumKeys)] = [this](FrameReader& a, Responder r) {
    a.expect_done();
    r.send(Status::kOk, FrameWriter().i64(static_cast<int64_t>(data.size())));
  };
}

StoreServer::StoreServer(StoreServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->register_builtins();
}

StoreServer::~StoreServer() {
  stop();
  join();
}

void StoreServer::register_handler(uint8_t op, Handler handler) {
  DNALLM_CHECK(!impl_->thread.joinable(), ExitCode::kFailure,
               "register_handler(op {}) after start()", op);
  DNALLM_CHECK(impl_->handlers.count(op) == 0 && op != static_cast<uint8_t>(Op::kHello),
               ExitCode::kFailure, "op {} is already handled", op);
  impl_->handlers[op] = std::move(handler);
}

void StoreServer::start() {
  boost::system::error_code ec;
  auto address = asio::ip::make_address(impl_->options.host, ec);
  if (ec) {
    // A host name: resolve it.
    tcp::resolver resolver(impl_->io);
    auto results = resolver.resolve(impl_->options.host, "", ec);
    DNALLM_CHECK(!ec && !results.empty(), ExitCode::kUsage,
                 "coordinator: cannot resolve bind host '{}': {}; pass an IP address with --host",
                 impl_->options.host, ec.message());
    address = results.begin()->endpoint().address();
  }
  tcp::endpoint ep(address, impl_->options.port);
  auto& acc = impl_->acceptor;
  acc.open(ep.protocol(), ec);
  if (!ec) acc.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acc.bind(ep, ec);
  if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
  DNALLM_CHECK(!ec, ExitCode::kUsage,
               "coordinator: cannot listen on {}:{}: {}; choose another --port",
               impl_->options.host, impl_->options.port, ec.message());
  impl_->port = acc.local_endpoint().port();
  impl_->accept();
  impl_->thread = std::thread([impl = impl_.get()] {
    try {
      impl->io.run();
    } catch (const std::exception& e) {
      spdlog::error("coordinator: io thread failed: {}", e.what());
    }
  });
  spdlog::info("coordinator: store listening on {}:{}", impl_->options.host, impl_->port.load());
}

uint16_t StoreServer::port() const { return impl_->port; }

void StoreServer::erase_prefixes(std::vector<std::string> prefixes) {
  if (!impl_->thread.joinable() || impl_->stopped) return;
  asio::post(impl_->io, [impl = impl_.get(), prefixes = std::move(prefixes)] {
    size_t erased = 0;
    for (const auto& prefix : prefixes) {
      for (auto it = impl->data.lower_bound(prefix);
           it != impl->data.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
        impl->owner.erase(it->first);
        it = impl->data.erase(it);
        ++erased;
      }
    }
    spdlog::debug("coordinator: erased {} key(s) under {} prefix(es)", erased, prefixes.size());
  });
}

void StoreServer::stop() {
  if (impl_->stopped.exchange(true)) return;
  if (!impl_->thread.joinable()) return;
  asio::post(impl_->io, [impl = impl_.get()] {
    boost::system::error_code ec;
    impl->acceptor.close(ec);
    auto sessions = impl->sessions;
    for (auto& s : sessions) s->close("server stopping", false);
    for (auto& w : impl->waiters) w->timer->cancel();
    impl->waiters.clear();
    impl->io.stop();
  });
}

void StoreServer::join() {
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace dnallm::coordinator
