#include "coordinator/store_server.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "coordinator/store_server_impl.hpp"
#include "coordinator/store_wire.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {

namespace {

std::string default_identity() {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  return fmt::format("dnallm coordinator (pid {} on host {})", ::getpid(), name);
}

void set_cloexec(int fd) {
  int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

// Sends a HELLO with a token no job uses on the connected socket `fd`; returns the reply's
// body (status byte first), or nothing when no whole frame came back within the socket's
// timeouts.
std::vector<uint8_t> probe_hello(int fd) {
  const auto hello = encode_request(Op::kHello, HelloRequest{kProtocolVersion, "\x01port-probe"});
  const auto frame = hello.frame();
  uint8_t buf[1024];
  size_t got = 0;
  if (::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(frame.size())) {
    while (got < sizeof(buf)) {
      ssize_t k = ::recv(fd, buf + got, sizeof(buf) - got, 0);
      if (k <= 0) break;
      got += static_cast<size_t>(k);
      if (got >= 4 && got >= 4 + decode_u32_le(buf)) break;
    }
  }
  if (got < 5 || got < 4 + decode_u32_le(buf)) return {};
  return std::vector<uint8_t>(buf + 4, buf + 4 + decode_u32_le(buf));
}

// What listens on address:port, for the port-clash message: a dnallm coordinator answers
// a HELLO with a token it cannot know by UNAUTHORIZED and its identity.
std::string describe_listener(const asio::ip::address& address, uint16_t port) {
  if (!address.is_v4()) return "another program";
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "another program";
  timeval tv{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  auto bytes = address.to_v4().to_bytes();
  std::memcpy(&sa.sin_addr, bytes.data(), 4);
  if (address.to_v4().is_unspecified()) sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string what = "another program (it does not speak the coordinator protocol)";
  std::vector<uint8_t> reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) reply = probe_hello(fd);
  ::close(fd);
  if (!reply.empty() && reply[0] == static_cast<uint8_t>(Status::kUnauthorized)) {
    const std::string identity = decode_reason(reply.data() + 1, reply.size() - 1);
    what = (identity.empty() ? "a dnallm coordinator" : identity) + " of another job";
  } else if (!reply.empty() && reply[0] == static_cast<uint8_t>(Status::kOk)) {
    what = "a dnallm coordinator that accepts any client (no job token)";
  }
  return what;
}

}  // namespace

StoreServer::Impl::Impl(StoreServerOptions o)
    : options(std::move(o)), acceptor(io), accept_timer(io) {
  if (options.identity.empty()) options.identity = default_identity();
}

// ---------------------------------------------------------------- Responder

void Responder::send(Status status, const FrameWriter& fields) const {
  if (!target_ || target_->closed_) return;
  FrameWriter out;
  out.u8(static_cast<uint8_t>(status)).append(fields);
  target_->reply(out.frame(), status == Status::kUnauthorized);
}

uint64_t Responder::session_id() const { return target_ ? target_->id_ : 0; }

// ---------------------------------------------------------------- Session

Responder::Target::Target(StoreServer::Impl& server, tcp::socket socket, uint64_t id)
    : server_(server), socket_(std::move(socket)), id_(id), deadline_(server.io) {
  boost::system::error_code ec;
  auto ep = socket_.remote_endpoint(ec);
  peer_ = ec ? std::string("?") : ep.address().to_string() + ":" + std::to_string(ep.port());
  socket_.set_option(tcp::no_delay(true), ec);
}

void Responder::Target::start() {
  pending_ = true;
  pending_it_ = server_.pending.insert(server_.pending.end(), this);
  arm_deadline(server_.options.handshake_timeout,
               fmt::format("no HELLO within {} ms of connecting",
                           server_.options.handshake_timeout.count()));
  read_header();
}

void Responder::Target::arm_deadline(std::chrono::milliseconds after, std::string why) {
  const uint64_t seq = ++deadline_seq_;
  deadline_.expires_after(after);
  auto self = shared_from_this();
  deadline_.async_wait([this, self, seq, why = std::move(why)](boost::system::error_code ec) {
    if (ec || closed_ || seq != deadline_seq_) return;
    close(why, true);
  });
}

void Responder::Target::cancel_deadline() {
  ++deadline_seq_;
  deadline_.cancel();
}

void Responder::Target::leave_pending() {
  if (!pending_) return;
  server_.pending.erase(pending_it_);
  pending_ = false;
}

void Responder::Target::release_body() {
  server_.buffered_bytes -= reserved_;
  reserved_ = 0;
  std::vector<uint8_t>().swap(body_);
}

void Responder::Target::read_header() {
  header_got_ = 0;
  auto self = shared_from_this();
  // The first byte starts the frame's deadline (after HELLO; before it the handshake's runs).
  socket_.async_read_some(
      asio::buffer(header_), [this, self](boost::system::error_code ec, size_t k) {
        if (ec) {
          close(ec == asio::error::eof ? "closed by peer" : ec.message(), false);
          return;
        }
        header_got_ = k;
        if (authed_)
          arm_deadline(server_.options.frame_timeout,
                       fmt::format("a frame was not complete {} ms after its first byte",
                                   server_.options.frame_timeout.count()));
        if (header_got_ == 4) {
          on_header();
          return;
        }
        asio::async_read(socket_, asio::buffer(header_ + header_got_, 4 - header_got_),
                         [this, self](boost::system::error_code ec, size_t) {
                           if (ec) {
                             close("connection lost mid-frame: " + ec.message(), !authed_);
                             return;
                           }
                           on_header();
                         });
      });
}

void Responder::Target::on_header() {
  const uint32_t n = decode_u32_le(header_);
  const uint32_t limit =
      authed_ ? server_.options.max_frame_bytes
              : std::min(server_.options.max_hello_bytes, server_.options.max_frame_bytes);
  if (n == 0 || n > limit) {
    close(fmt::format("frame of {} bytes rejected (limit {} bytes{})", n, limit,
                      authed_ ? "" : " before HELLO"),
          true);
    return;
  }
  if (server_.buffered_bytes + n > server_.options.max_buffered_bytes) {
    close(fmt::format("frame of {} bytes rejected: {} bytes of frames are being received from "
                      "all clients (limit {})",
                      n, server_.buffered_bytes, server_.options.max_buffered_bytes),
          true);
    return;
  }
  read_body(n);
}

void Responder::Target::read_body(uint32_t n) {
  body_.resize(n);
  reserved_ = n;
  server_.buffered_bytes += n;
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(body_),
                   [this, self](boost::system::error_code ec, size_t) {
                     if (ec) {
                       close("connection lost mid-frame: " + ec.message(), true);
                       return;
                     }
                     if (authed_) cancel_deadline();
                     dispatch();
                     if (!closed_) release_body();
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
      on_hello(args);
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
      Responder(shared_from_this()).send(Status::kBadRequest, encode_reason(e.what()));
  }
}

// Protocol step 1: the version and the job token decide whether this session may go on.
void Responder::Target::on_hello(FrameReader& args) {
  const auto hello = decode_message<HelloRequest>(args);
  awaiting_reply_ = true;
  std::string refusal;
  if (hello.version != kProtocolVersion) {
    refusal = fmt::format("protocol version {} (expected {})", hello.version, kProtocolVersion);
  } else if (hello.token != server_.options.token) {
    refusal = "wrong job token (check DNALLM_JOB_TOKEN)";
  }
  if (!refusal.empty()) {
    server_.warn(fmt::format("refused {}: {}", peer_, refusal));
    Responder(shared_from_this())
        .send(Status::kUnauthorized, encode_reason(server_.options.identity));
    return;
  }
  authed_ = true;
  cancel_deadline();
  leave_pending();
  Responder(shared_from_this()).send(Status::kOk);
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
    server_.warn(fmt::format("closing connection from {}: {}", peer_, why));
  else
    spdlog::debug("coordinator: connection from {} ended: {}", peer_, why);
  cancel_deadline();
  leave_pending();
  release_body();
  boost::system::error_code ec;
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  server_.on_session_closed(*this);
}

// ---------------------------------------------------------------- Server

// Accepts with accept4(SOCK_CLOEXEC) ourselves (Asio's accept() leaves descriptors
// inheritable), after the listener reports readiness.
void StoreServer::Impl::accept() {
  acceptor.async_wait(tcp::acceptor::wait_read, [this](boost::system::error_code ec) {
    if (ec || !acceptor.is_open() || stopped) return;
    accept_ready();
  });
}

void StoreServer::Impl::accept_ready() {
  int accepted = 0;
  for (int i = 0; i < 64; ++i) {
    int fd = ::accept4(acceptor.native_handle(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) break;
      if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
      accept_failed(err, accepted);  // re-arms accept() after a back-off
      return;
    }
    ++accepted;
    accept_backoff = std::chrono::milliseconds(0);
    on_accepted(fd);
  }
  accept();
}

void StoreServer::Impl::on_accepted(int fd) {
  tcp::socket socket(io);
  boost::system::error_code ec;
  socket.assign(acceptor.local_endpoint(ec).protocol(), fd, ec);
  if (ec) {
    ::close(fd);
    warn(fmt::format("cannot use an accepted connection: {}", ec.message()));
    return;
  }
  if (sessions.size() >= options.max_connections) {
    warn(fmt::format("refusing a connection: {} connections are open (limit {})", sessions.size(),
                     options.max_connections));
    return;  // the socket's destructor closes it
  }
  if (pending.size() >= options.max_pending_connections)
    evict_oldest_pending("too many connections are waiting for their HELLO");
  auto s = std::make_shared<Responder::Target>(*this, std::move(socket), next_session_id++);
  sessions.insert(s);
  s->start();
}

void StoreServer::Impl::accept_failed(int err, int accepted) {
  // Progress (descriptors freed by the last eviction were used): come back soon, to drain
  // the backlog where a legitimate client may wait. None: back off exponentially.
  accept_backoff = accepted > 0 ? std::chrono::milliseconds(10)
                   : accept_backoff.count() == 0
                       ? std::chrono::milliseconds(100)
                       : std::min(accept_backoff * 2, std::chrono::milliseconds(1000));
  warn(
      fmt::format("accept failed: {} ({} connections open, {} waiting for HELLO); retrying in "
                  "{} ms{}",
                  std::strerror(err), sessions.size(), pending.size(), accept_backoff.count(),
                  err == EMFILE || err == ENFILE
                      ? "; raise the descriptor limit (ulimit -n) if clients are legitimate"
                      : ""));
  // Descriptors freed now let the next clients in; a legitimate one sends HELLO at once and
  // leaves the pending list before its turn to be evicted comes.
  for (size_t n = std::max<size_t>(1, pending.size() / 2); n > 0; --n)
    if (!evict_oldest_pending("the coordinator is out of descriptors")) break;
  accept_timer.expires_after(accept_backoff);
  accept_timer.async_wait([this](boost::system::error_code ec) {
    if (ec || stopped) return;
    accept();
  });
}

bool StoreServer::Impl::evict_oldest_pending(const char* why) {
  if (pending.empty()) return false;
  Responder::Target* oldest = pending.front();
  oldest->close(fmt::format("evicted before HELLO: {}", why), true);
  return true;
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
  if (!ec) set_cloexec(acc.native_handle());
  if (!ec) acc.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acc.bind(ep, ec);
  if (ec == asio::error::address_in_use) {
    const std::string what = describe_listener(address, impl_->options.port);
    acc.close(ec);
    fail(ExitCode::kUsage,
         "coordinator: cannot listen on {}:{}: the port is taken by {}; choose "
         "another port (--port, MASTER_PORT or --rdzv-endpoint)",
         impl_->options.host, impl_->options.port, what);
  }
  if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) acc.non_blocking(true, ec);
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
    impl->accept_timer.cancel();
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
