#include "coordinator/tcp_store_client.hpp"

#include <thread>

#include <spdlog/spdlog.h>
#include <boost/asio.hpp>

#include "coordinator/store_wire.hpp"
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

  void send(const std::vector<uint8_t>& frame, Clock::time_point deadline, const char* what) {
    run([&](auto h) { asio::async_write(socket, asio::buffer(frame), h); }, deadline, what);
  }

  // One reply frame's body (status byte first), of 1..max_bytes bytes.
  std::vector<uint8_t> receive(Clock::time_point deadline, const char* what, uint32_t max_bytes) {
    uint8_t header[4];
    run([&](auto h) { asio::async_read(socket, asio::buffer(header), h); }, deadline, what);
    const uint32_t n = decode_u32_le(header);
    if (n == 0 || n > max_bytes) {
      throw IoFailure{std::string(what) + ": a frame of " + std::to_string(n) + " bytes"};
    }
    std::vector<uint8_t> body(n);
    run([&](auto h) { asio::async_read(socket, asio::buffer(body), h); }, deadline, what);
    return body;
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
    conn_.reset();
    try {
      conn_ = try_connect_locked(deadline);
      return;
    } catch (const IoFailure& e) {
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

std::unique_ptr<TcpStoreClient::Connection> TcpStoreClient::try_connect_locked(
    Clock::time_point deadline) {
  auto conn = std::make_unique<Connection>();
  tcp::resolver resolver(conn->io);
  boost::system::error_code ec;
  auto endpoints = resolver.resolve(options_.host, std::to_string(options_.port), ec);
  if (ec) throw IoFailure{"resolve: " + ec.message()};
  conn->run([&](auto handler) { asio::async_connect(conn->socket, endpoints, handler); }, deadline,
            "connect");
  conn->socket.set_option(tcp::no_delay(true), ec);
  conn->send(encode_request(Op::kHello, HelloRequest{kProtocolVersion, options_.token}).frame(),
             deadline, "hello");
  const std::vector<uint8_t> reply = conn->receive(deadline, "hello reply", 1024);
  if (static_cast<Status>(reply[0]) == Status::kUnauthorized) {
    // Servers name themselves in the refusal (protocol step 1): say what was reached.
    const std::string who = decode_reason(reply.data() + 1, reply.size() - 1);
    fail(ExitCode::kUsage,
         "coordinator {} refused this client's job token{}; if that is another job's "
         "coordinator, give this job another port (MASTER_PORT or --rdzv-endpoint), else "
         "set the same DNALLM_JOB_TOKEN on every node",
         address(), who.empty() ? std::string() : " (the server there is " + who + ")");
  }
  if (static_cast<Status>(reply[0]) != Status::kOk) throw IoFailure{"hello refused"};
  restore_owned_locked(*conn, deadline);
  return conn;
}

// Owned keys died with the previous session: put them back.
void TcpStoreClient::restore_owned_locked(Connection& conn, Clock::time_point deadline) {
  for (const auto& [key, value] : owned_) {
    conn.send(encode_request(Op::kSetOwned, KeyValueRequest{key, value}).frame(), deadline,
              "set_owned");
    conn.receive(deadline, "set_owned reply", 1024);
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
      conn_->send(frame, deadline, "send");
      sent = true;
      std::vector<uint8_t> body = conn_->receive(deadline, "reply", options_.max_frame_bytes);
      auto status = static_cast<Status>(body[0]);
      body.erase(body.begin());
      if (status == Status::kBadRequest) {
        std::string why = decode_reason(body.data(), body.size());
        fail(ExitCode::kFailure, "coordinator {} rejected '{}': {}", address(), op_name(op),
             why.empty() ? std::string("bad request") : why);
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

template <class Message>
TcpStoreClient::Response TcpStoreClient::send(Op op, const Message& message,
                                              std::chrono::milliseconds timeout, bool idempotent) {
  return request(encode_request(op, message), timeout, idempotent);
}

void TcpStoreClient::set(const std::string& key, const Bytes& value) {
  send(Op::kSet, KeyValueRequest{key, value}, options_.op_timeout, true);
}

void TcpStoreClient::set_owned(const std::string& key, const Bytes& value) {
  send(Op::kSetOwned, KeyValueRequest{key, value}, options_.op_timeout, true);
  std::lock_guard<std::mutex> lock(mutex_);
  owned_[key] = value;
}

std::optional<Bytes> TcpStoreClient::try_get(const std::string& key) {
  auto r = send(Op::kGet, KeyRequest{key}, options_.op_timeout, true);
  if (r.status == Status::kNotFound) return std::nullopt;
  return decode_reply<ValueReply>(r, static_cast<uint8_t>(Op::kGet)).value;
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto r = send(Op::kWait, WaitRequest{keys, timeout.count()}, timeout + kReplySlack, true);
  if (r.status == Status::kTimeout) {
    std::vector<std::string> missing;
    for (const auto& k : keys)
      if (!check({k})) missing.push_back(k);
    fail(ExitCode::kPeerFailed, "timed out after {} ms waiting for store keys: {} (coordinator {})",
         timeout.count(), detail::join_keys(missing), address());
  }
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta) {
  auto r = send(Op::kAdd, AddRequest{key, delta}, options_.op_timeout, false);
  return decode_reply<CountReply>(r, static_cast<uint8_t>(Op::kAdd)).value;
}

Bytes TcpStoreClient::compare_and_set(const std::string& key, const Bytes& expected,
                                      const Bytes& desired) {
  auto r =
      send(Op::kCompareSet, CompareSetRequest{key, expected, desired}, options_.op_timeout, false);
  return decode_reply<ValueReply>(r, static_cast<uint8_t>(Op::kCompareSet)).value;
}

bool TcpStoreClient::remove(const std::string& key) {
  auto r = send(Op::kDelete, KeyRequest{key}, options_.op_timeout, true);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    owned_.erase(key);
  }
  return decode_reply<FlagReply>(r, static_cast<uint8_t>(Op::kDelete)).value;
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  auto r = send(Op::kCheck, KeysRequest{keys}, options_.op_timeout, true);
  return decode_reply<FlagReply>(r, static_cast<uint8_t>(Op::kCheck)).value;
}

int64_t TcpStoreClient::num_keys() {
  auto r = send(Op::kNumKeys, NoFields{}, options_.op_timeout, true);
  return decode_reply<CountReply>(r, static_cast<uint8_t>(Op::kNumKeys)).value;
}

void TcpStoreClient::ping() { send(Op::kPing, NoFields{}, options_.op_timeout, true); }

}  // namespace dnallm::coordinator
