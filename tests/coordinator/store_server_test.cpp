// The TCP store against hostile or broken clients, with raw sockets: every bad client is
// cut off and the server keeps serving the good ones.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include <gtest/gtest.h>

#include "coordinator/protocol.hpp"
#include "coordinator/store_server.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {
namespace {

using namespace std::chrono_literals;

// A blocking raw socket to the server, with a receive timeout so a test cannot hang.
class RawSocket {
 public:
  explicit RawSocket(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ~RawSocket() { ::close(fd_); }
  void send(const std::vector<uint8_t>& bytes) {
    ASSERT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  // The next response body, or nullopt if the server closed the connection.
  std::optional<std::vector<uint8_t>> recv_frame() {
    uint8_t header[4];
    if (!read_all(header, 4)) return std::nullopt;
    std::vector<uint8_t> body(decode_u32_le(header));
    if (!read_all(body.data(), body.size())) return std::nullopt;
    return body;
  }
  // True if the server closed the connection (EOF), false on data or timeout.
  bool closed_by_server() {
    uint8_t b;
    return ::recv(fd_, &b, 1, 0) == 0;
  }
  void hello(const std::string& token) {
    send(FrameWriter()
             .u8(static_cast<uint8_t>(Op::kHello))
             .u32(kProtocolVersion)
             .str(token)
             .frame());
  }

 private:
  bool read_all(uint8_t* p, size_t n) {
    while (n > 0) {
      ssize_t k = ::recv(fd_, p, n, 0);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<size_t>(k);
    }
    return true;
  }
  int fd_;
};

class StoreServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreServerOptions o;
    o.host = "127.0.0.1";
    o.token = "secret";
    o.max_frame_bytes = 1024;
    server_ = std::make_unique<StoreServer>(o);
    server_->start();
    ASSERT_NE(server_->port(), 0);
    good_ = client("secret");
    good_->set("before", to_bytes("1"));
  }
  std::unique_ptr<TcpStoreClient> client(const std::string& token) {
    TcpStoreClientOptions o;
    o.port = server_->port();
    o.token = token;
    o.connect_timeout = 5s;
    o.op_timeout = 5s;
    return std::make_unique<TcpStoreClient>(o);
  }
  void expect_server_healthy() {
    EXPECT_EQ(to_string(good_->get("before", 1s)), "1");
    good_->set("after", to_bytes("2"));
    EXPECT_EQ(to_string(client("secret")->get("after", 1s)), "2");
  }
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<TcpStoreClient> good_;
};

TEST_F(StoreServerTest, WrongTokenIsRefused) {
  try {
    client("wrong");
    FAIL() << "a wrong token was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find("token"), std::string::npos);
  }
  RawSocket raw(server_->port());
  raw.hello("wrong");
  auto reply = raw.recv_frame();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ((*reply)[0], static_cast<uint8_t>(Status::kUnauthorized));
  EXPECT_TRUE(raw.closed_by_server());
  expect_server_healthy();
}

TEST_F(StoreServerTest, RequestBeforeHelloClosesConnection) {
  RawSocket raw(server_->port());
  raw.send(FrameWriter().u8(static_cast<uint8_t>(Op::kSet)).str("k").str("v").frame());
  EXPECT_TRUE(raw.closed_by_server());
  EXPECT_FALSE(good_->try_get("k").has_value());
  expect_server_healthy();
}

TEST_F(StoreServerTest, OversizedFrameClosesConnection) {
  RawSocket raw(server_->port());
  raw.hello("secret");
  ASSERT_TRUE(raw.recv_frame().has_value());
  std::vector<uint8_t> header = {0x00, 0x00, 0x10, 0x00};  // 1 MiB > 1024 limit
  raw.send(header);
  EXPECT_TRUE(raw.closed_by_server());
  expect_server_healthy();
}

TEST_F(StoreServerTest, MalformedFramesCloseConnection) {
  std::vector<std::vector<uint8_t>> bad = {
      {0, 0, 0, 0},                                                                // empty body
      FrameWriter().u8(200).frame(),                                               // unknown op
      FrameWriter().u8(static_cast<uint8_t>(Op::kSet)).u32(1000).frame(),          // truncated key
      FrameWriter().u8(static_cast<uint8_t>(Op::kGet)).str("k").u8(7).frame(),     // trailing
      FrameWriter().u8(static_cast<uint8_t>(Op::kCheck)).u32(0xffffffff).frame(),  // count
  };
  for (const auto& frame : bad) {
    RawSocket raw(server_->port());
    raw.hello("secret");
    ASSERT_TRUE(raw.recv_frame().has_value());
    raw.send(frame);
    EXPECT_TRUE(raw.closed_by_server());
  }
  expect_server_healthy();
}

TEST_F(StoreServerTest, OwnedKeysDisappearWithTheirConnection) {
  {
    auto owner = client("secret");
    owner->set_owned("alive/3", to_bytes("1"));
    EXPECT_TRUE(good_->check({"alive/3"}));
  }
  // The server notices the close asynchronously.
  for (int i = 0; i < 100 && good_->check({"alive/3"}); ++i) std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(good_->check({"alive/3"}));
}

TEST_F(StoreServerTest, ClientReconnectsAndRestoresOwnedKeys) {
  auto c = client("secret");
  c->set_owned("alive/1", to_bytes("1"));
  c->disconnect();
  for (int i = 0; i < 100 && good_->check({"alive/1"}); ++i) std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(good_->check({"alive/1"}));
  c->set("k", to_bytes("v"));  // reconnects
  EXPECT_TRUE(good_->check({"alive/1"}));
  EXPECT_EQ(to_string(good_->get("k", 1s)), "v");
}

TEST_F(StoreServerTest, ServerGoneRaisesPeerFailedWithinTimeout) {
  auto c = client("secret");
  server_->stop();
  server_->join();
  auto t0 = std::chrono::steady_clock::now();
  try {
    c->get("never", 1s);
    FAIL() << "no error with the server gone";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kPeerFailed);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 8s);
}

TEST(StoreServerExtension, RegisteredOpIsDispatchedAndRepliesLater) {
  // How rendezvous / heartbeats plug in: a new op code with its own handler, which may
  // answer later on the io thread.
  StoreServerOptions o;
  o.host = "127.0.0.1";
  o.token = "t";
  StoreServer server(o);
  constexpr uint8_t kEcho = 40;
  server.register_handler(kEcho, [](FrameReader& args, Responder reply) {
    auto text = args.str();
    args.expect_done();
    reply.send(Status::kOk, FrameWriter().str("echo:" + text));
  });
  EXPECT_THROW(server.register_handler(static_cast<uint8_t>(Op::kSet), {}), Error);
  server.start();
  EXPECT_THROW(server.register_handler(41, {}), Error);
  RawSocket raw(server.port());
  raw.hello("t");
  ASSERT_TRUE(raw.recv_frame().has_value());
  raw.send(FrameWriter().u8(kEcho).str("hi").frame());
  auto reply = raw.recv_frame();
  ASSERT_TRUE(reply.has_value());
  FrameReader r(reply->data(), reply->size());
  EXPECT_EQ(r.u8(), static_cast<uint8_t>(Status::kOk));
  EXPECT_EQ(r.str(), "echo:hi");
}

TEST(CoordinatorMain, HelpAndBadUsage) {
  std::string bin = std::string(DNALLM_BINARY_DIR) + "/bin/dnallm-coordinator";
  EXPECT_EQ(std::system((bin + " --help > /dev/null").c_str()), 0);
  int rc = std::system((bin + " --port notaport > /dev/null 2>&1").c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 2);
}

TEST(CoordinatorMain, ServesUntilSigterm) {
  std::string bin = std::string(DNALLM_BINARY_DIR) + "/bin/dnallm-coordinator";
  std::string out = ::testing::TempDir() + "/coord_port.txt";
  std::string cmd = "DNALLM_JOB_TOKEN=t " + bin + " --host 127.0.0.1 --port 0 > " + out +
                    " 2>/dev/null & echo $!";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  int pid = 0;
  ASSERT_EQ(std::fscanf(p, "%d", &pid), 1);
  ::pclose(p);
  int port = 0;
  for (int i = 0; i < 200 && port == 0; ++i) {
    std::this_thread::sleep_for(25ms);
    FILE* f = std::fopen(out.c_str(), "r");
    if (f) {
      if (std::fscanf(f, "port %d", &port) != 1) port = 0;
      std::fclose(f);
    }
  }
  ASSERT_GT(port, 0);
  TcpStoreClientOptions o;
  o.port = static_cast<uint16_t>(port);
  o.token = "t";
  TcpStoreClient c(o);
  c.set("k", to_bytes("v"));
  EXPECT_EQ(to_string(c.get("k", 1s)), "v");
  ::kill(pid, SIGTERM);
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    std::this_thread::sleep_for(25ms);
    gone = ::kill(pid, 0) != 0;
  }
  EXPECT_TRUE(gone);
}

}  // namespace
}  // namespace dnallm::coordinator
