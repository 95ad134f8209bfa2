#include "coordinator/tcp_store_client.hpp"

#include <thread>

#include <spdlog/spdlog.h>
#include <boost/asio.hpp>

#include "core/error.hpp"

namespace dnallm::coordinator {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// The extra time a client allows beyond a server-side wait timeout for the reply to come.
constexpr std::chrono::milliseconds kReplySlack{2000};

struct IoFailure {
  std::string what;
};

}  // namespace

// A socket plus the private io_context that drives it. Blocking with deadlines: each
// operation is started asynchronously and the context is run until it completes or the
// deadline passes, in which case the socket is closed (and the connection discarded).
struct TcpStoreClient::Connection {
  asio::io_context io;
  tcp::socket socket{io};

  template <typename Start>
  void run(Start start, Clock::time_point deadline, const char* what) {
    boost::system::error_code result = asio::error::would_block;
    start([&result](boost::system::error_code ec, auto&&...) { result = ec; });
    io.restart();
    while (result == asio::error::would_block) {
      auto now = Clock::now();
      if (now >= deadline || io.run_one_until(deadline) == 0) {
        if (result != asio::error::would_block) break;
        boost::system::error_code ignored;
        socket.close(ignored);
        io.restart();
        io.run();  // completes the aborted handler
        throw IoFailure{std::string(what) + " timed out"};
      }
    }
    if (result) throw IoFailure{std::string(what) + ": " + result.message()};
  }
};

TcpStoreClient::TcpStoreClient(TcpStoreClientOptions options) : options_(std::move(options)) {
  std::lock_guard<std::mutex> lock(mutex_);
  connect_locked(Clock::now() + options_.connect_timeout);
}

TcpStoreClient::~TcpStoreClient() = default;

std::string TcpStoreClient::address() const {
  return options_.host + ":" + std::to_string(options_.port);
}

void TcpStoreClient::disconnect() {
  std::lock_guard<std::mutex> lock(mutex_);
  conn_.reset();
}

void TcpStoreClient::connect_locked(Clock::time_point deadline) {
  std::string last_error = "no attempt";
  while (true) {
    auto conn = std::make_unique<Connection>();
    try {
      tcp::resolver resolver(conn->io);
      boost::system::error_code ec;
      auto endpoints = resolver.resolve(options_.host, std::to_string(options_.port), ec);
      if (ec) throw IoFailure{"resolve: " + ec.message()};
      conn->run([&](auto handler) { asio::async_connect(conn->socket, endpoints, handler); },
                deadline, "connect");
      conn->socket.set_option(tcp::no_delay(true), ec);
      auto hello = FrameWriter()
                       .u8(static_cast<uint8_t>(Op::kHello))
                       .u32(kProtocolVersion)
                       .str(options_.token)
                       .frame();
      conn->run([&](auto h) { asio::async_write(conn->socket, asio::buffer(hello), h); }, deadline,
                "hello");
      uint8_t header[4];
      conn->run([&](auto h) { asio::async_read(conn->socket, asio::buffer(header), h); }, deadline,
                "hello reply");
      uint32_t n = decode_u32_le(header);
      if (n == 0 || n > 1024) throw IoFailure{"bad hello reply"};
      std::vector<uint8_t> body(n);
      conn->run([&](auto h) { asio::async_read(conn->socket, asio::buffer(body), h); }, deadline,
                "hello reply");
      if (static_cast<Status>(body[0]) == Status::kUnauthorized) {
        // Servers name themselves in the refusal (protocol step 1): say what was reached.
        std::string who;
        try {
          FrameReader r(body.data() + 1, body.size() - 1);
          if (!r.done()) who = r.str();
        } catch (const ProtocolError&) {
          who.clear();
        }
        fail(ExitCode::kUsage,
             "coordinator {} refused this client's job token{}; if that is another job's "
             "coordinator, give this job another port (MASTER_PORT or --rdzv-endpoint), else "
             "set the same DNALLM_JOB_TOKEN on every node",
             address(), who.empty() ? std::string() : " (the server there is " + who + ")");
      }
      if (static_cast<Status>(body[0]) != Status::kOk) throw IoFailure{"hello refused"};
      conn_ = std::move(conn);
      // Owned keys died with the previous session: put them back.
      for (const auto& [key, value] : owned_) {
        auto frame =
            FrameWriter().u8(static_cast<uint8_t>(Op::kSetOwned)).str(key).blob(value).frame();
        conn_->run([&](auto h) { asio::async_write(conn_->socket, asio::buffer(frame), h); },
                   deadline, "set_owned");
        conn_->run([&](auto h) { asio::async_read(conn_->socket, asio::buffer(header), h); },
                   deadline, "set_owned reply");
        std::vector<uint8_t> reply(decode_u32_le(header));
        if (reply.empty() || reply.size() > 1024) throw IoFailure{"bad set_owned reply"};
        conn_->run([&](auto h) { asio::async_read(conn_->socket, asio::buffer(reply), h); },
                   deadline, "set_owned reply");
      }
      return;
    } catch (const IoFailure& e) {
      conn_.reset();
      last_error = e.what;
    }
    if (Clock::now() + std::chrono::milliseconds(100) >= deadline)
      fail(ExitCode::kPeerFailed,
           "cannot reach the coordinator at {}: {}; check MASTER_ADDR/MASTER_PORT and that "
           "rank 0 is running",
           address(), last_error);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

TcpStoreClient::Response TcpStoreClient::request(const FrameWriter& req,
                                                 std::chrono::milliseconds timeout,
                                                 bool idempotent) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto deadline = Clock::now() + timeout;
  const uint8_t op = req.body().empty() ? 0 : req.body()[0];
  auto frame = req.frame();
  for (int attempt = 0;; ++attempt) {
    bool sent = false;
    try {
      if (!conn_) connect_locked(std::min(deadline, Clock::now() + options_.connect_timeout));
      auto& c = *conn_;
      c.run([&](auto h) { asio::async_write(c.socket, asio::buffer(frame), h); }, deadline, "send");
      sent = true;
      uint8_t header[4];
      c.run([&](auto h) { asio::async_read(c.socket, asio::buffer(header), h); }, deadline,
            "reply");
      uint32_t n = decode_u32_le(header);
      if (n == 0 || n > options_.max_frame_bytes)
        throw IoFailure{"reply frame of " + std::to_string(n) + " bytes"};
      std::vector<uint8_t> body(n);
      c.run([&](auto h) { asio::async_read(c.socket, asio::buffer(body), h); }, deadline, "reply");
      auto status = static_cast<Status>(body[0]);
      body.erase(body.begin());
      if (status == Status::kBadRequest) {
        FrameReader r(body.data(), body.size());
        std::string why = body.empty() ? std::string("bad request") : r.str();
        fail(ExitCode::kFailure, "coordinator {} rejected '{}': {}", address(), op_name(op), why);
      }
      return Response{status, std::move(body)};
    } catch (const IoFailure& e) {
      conn_.reset();
      bool retry = (idempotent || !sent) && attempt == 0 && Clock::now() < deadline;
      if (!retry)
        fail(ExitCode::kPeerFailed, "coordinator {} failed during '{}': {}", address(), op_name(op),
             e.what);
      spdlog::warn("coordinator {}: '{}' failed ({}), reconnecting", address(), op_name(op),
                   e.what);
    }
  }
}

void TcpStoreClient::set(const std::string& key, const Bytes& value) {
  request(FrameWriter().u8(static_cast<uint8_t>(Op::kSet)).str(key).blob(value),
          options_.op_timeout, true);
}

void TcpStoreClient::set_owned(const std::string& key, const Bytes& value) {
  request(FrameWriter().u8(static_cast<uint8_t>(Op::kSetOwned)).str(key).blob(value),
          options_.op_timeout, true);
  std::lock_guard<std::mutex> lock(mutex_);
  owned_[key] = value;
}

std::optional<Bytes> TcpStoreClient::try_get(const std::string& key) {
  auto r =
      request(FrameWriter().u8(static_cast<uint8_t>(Op::kGet)).str(key), options_.op_timeout, true);
  if (r.status == Status::kNotFound) return std::nullopt;
  FrameReader reader(r.body.data(), r.body.size());
  return reader.blob();
}

Bytes TcpStoreClient::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  auto v = try_get(key);
  DNALLM_CHECK(v.has_value(), ExitCode::kPeerFailed, "store key '{}' was deleted while read", key);
  return *v;
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto r =
      request(FrameWriter().u8(static_cast<uint8_t>(Op::kWait)).keys(keys).i64(timeout.count()),
              timeout + kReplySlack, true);
  if (r.status == Status::kTimeout) {
    std::vector<std::string> missing;
    for (const auto& k : keys)
      if (!check({k})) missing.push_back(k);
    fail(ExitCode::kPeerFailed, "timed out after {} ms waiting for store keys: {} (coordinator {})",
         timeout.count(), detail::join_keys(missing), address());
  }
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta) {
  auto r = request(FrameWriter().u8(static_cast<uint8_t>(Op::kAdd)).str(key).i64(delta),
                   options_.op_timeout, false);
  FrameReader reader(r.body.data(), r.body.size());
  return reader.i64();
}

Bytes TcpStoreClient::compare_and_set(const std::string& key, const Bytes& expected,
                                      const Bytes& desired) {
  auto r = request(
      FrameWriter().u8(static_cast<uint8_t>(Op::kCompareSet)).str(key).blob(expected).blob(desired),
      options_.op_timeout, false);
  FrameReader reader(r.body.data(), r.body.size());
  return reader.blob();
}

bool TcpStoreClient::remove(const std::string& key) {
  auto r = request(FrameWriter().u8(static_cast<uint8_t>(Op::kDelete)).str(key),
                   options_.op_timeout, true);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    owned_.erase(key);
  }
  FrameReader reader(r.body.data(), r.body.size());
  return reader.u8() != 0;
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  auto r = request(FrameWriter().u8(static_cast<uint8_t>(Op::kCheck)).keys(keys),
                   options_.op_timeout, true);
  FrameReader reader(r.body.data(), r.body.size());
  return reader.u8() != 0;
}

int64_t TcpStoreClient::num_keys() {
  auto r = request(FrameWriter().u8(static_cast<uint8_t>(Op::kNumKeys)), options_.op_timeout, true);
  FrameReader reader(r.body.data(), r.body.size());
  return reader.i64();
}

void TcpStoreClient::ping() {
  request(FrameWriter().u8(static_cast<uint8_t>(Op::kPing)), options_.op_timeout, true);
}

}  // namespace dnallm::coordinator
