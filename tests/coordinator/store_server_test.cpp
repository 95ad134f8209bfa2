// The TCP store against hostile or broken clients, with raw sockets: every bad client is
// cut off and the server keeps serving the good ones.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "coordinator/protocol.hpp"
#include "coordinator/store_server.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"
#include "raw_socket.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/process.hpp"

namespace dnallm::coordinator {
namespace {

using dnallm::testing::expect_error;

using namespace std::chrono_literals;

using testing::RawSocket;

// A legitimate client's options: `token`, generous deadlines (the server is under load).
TcpStoreClientOptions patient_client(uint16_t port, const std::string& token) {
  TcpStoreClientOptions o;
  o.port = port;
  o.token = token;
  o.connect_timeout = 10s;
  o.op_timeout = 10s;
  return o;
}

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
  expect_error([&] { client("wrong"); }, ExitCode::kUsage, {"token"});
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
  expect_error([&] { c->get("never", 1s); }, ExitCode::kPeerFailed);
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

// ---------------------------------------------------------------- Note [Hostile clients]

class HostileClientTest : public ::testing::Test {
 protected:
  void start(StoreServerOptions o) {
    o.host = "127.0.0.1";
    o.token = "secret";
    server_ = std::make_unique<StoreServer>(o);
    server_->start();
  }
  // A legitimate client connects, authenticates and round-trips a key; returns how long.
  std::chrono::milliseconds serve_legitimate_client() {
    const auto t0 = std::chrono::steady_clock::now();
    TcpStoreClient c(patient_client(server_->port(), "secret"));
    c.set("legit", to_bytes("yes"));
    EXPECT_EQ(to_string(c.get("legit", 1s)), "yes");
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 t0);
  }
  std::unique_ptr<StoreServer> server_;
};

TEST_F(HostileClientTest, IdleAndSlowDripClientsAreCutAtTheHandshakeDeadline) {
  StoreServerOptions o;
  o.handshake_timeout = 300ms;
  start(o);
  RawSocket idle(server_->port());
  RawSocket drip(server_->port());
  auto hello = FrameWriter()
                   .u8(static_cast<uint8_t>(Op::kHello))
                   .u32(kProtocolVersion)
                   .str("secret")
                   .frame();
  const auto t0 = std::chrono::steady_clock::now();
  // One byte every 100 ms: the HELLO would take 1.5 s, far beyond the deadline.
  bool drip_cut = false;
  for (size_t i = 0; i < hello.size() && !drip_cut; ++i) {
    drip_cut = ::send(drip.fd(), &hello[i], 1, MSG_NOSIGNAL) != 1;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(drip_cut || drip.closed_by_server());
  EXPECT_TRUE(idle.closed_by_server());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
  EXPECT_LT(serve_legitimate_client(), 1000ms);
}

TEST_F(HostileClientTest, LargeFrameBeforeHelloIsRefusedWithoutBuffering) {
  start(StoreServerOptions{});  // default limits: 64 MiB after HELLO, 4 KiB before
  RawSocket raw(server_->port());
  const uint32_t n = 64u << 20;
  raw.send({static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8), static_cast<uint8_t>(n >> 16),
            static_cast<uint8_t>(n >> 24), static_cast<uint8_t>(Op::kHello)});
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(raw.closed_by_server());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "the server waited for the body";
  // A HELLO of exactly the limit is still a HELLO (a long token is refused, not cut).
  RawSocket big(server_->port());
  big.hello(std::string(kMaxHelloBytes - 9, 'x'));
  auto reply = big.recv_frame();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ((*reply)[0], static_cast<uint8_t>(Status::kUnauthorized));
  EXPECT_LT(serve_legitimate_client(), 1000ms);
}

TEST_F(HostileClientTest, AFrameStalledAfterItsFirstByteIsCutAtTheFrameDeadline) {
  StoreServerOptions o;
  o.frame_timeout = 300ms;
  start(o);
  RawSocket raw(server_->port());
  raw.hello("secret");
  ASSERT_TRUE(raw.recv_frame().has_value());
  std::this_thread::sleep_for(500ms);  // idle between frames is allowed after HELLO
  raw.send({10, 0});                   // half a header, then nothing
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(raw.closed_by_server());
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, 200ms);
  EXPECT_LT(waited, 3s);
}

TEST_F(HostileClientTest, AFloodOfPendingConnectionsEvictsTheOldestAndServesNewClients) {
  StoreServerOptions o;
  o.max_pending_connections = 16;
  start(o);
  std::vector<std::unique_ptr<RawSocket>> flood;
  for (int i = 0; i < 64; ++i) flood.push_back(std::make_unique<RawSocket>(server_->port()));
  EXPECT_LT(serve_legitimate_client(), 1000ms);
  // At most 16 may still be waiting: the 48 oldest were evicted (EOF), well before the
  // 10 s handshake deadline.
  int cut = 0;
  for (int i = 0; i < 48; ++i) cut += flood[i]->closed_by_server() ? 1 : 0;
  EXPECT_EQ(cut, 48);
}

TEST_F(HostileClientTest, RefusalNamesTheServer) {
  StoreServerOptions o;
  o.identity = "dnallm coordinator (pid 4242 on host test-node)";
  start(o);
  TcpStoreClientOptions co;
  co.port = server_->port();
  co.token = "another job's token";
  expect_error([&] { TcpStoreClient c(co); }, ExitCode::kUsage,
               {"pid 4242 on host test-node", "another port"});
}

TEST_F(HostileClientTest, APortTakenByAnotherCoordinatorIsNamedAtBind) {
  StoreServerOptions o;
  o.identity = "dnallm coordinator (pid 4242 on host test-node)";
  start(o);
  StoreServerOptions second;
  second.host = "127.0.0.1";
  second.port = server_->port();
  second.token = "mine";
  StoreServer clash(second);
  expect_error([&] { clash.start(); }, ExitCode::kUsage, {"taken by dnallm coordinator (pid 4242"});
}

TEST_F(HostileClientTest, SocketsAreCloseOnExec) {
  start(StoreServerOptions{});
  RawSocket raw(server_->port());
  raw.hello("secret");
  ASSERT_TRUE(raw.recv_frame().has_value());
  // Every socket this process holds (the listener, the accepted connection) must be
  // FD_CLOEXEC, else a spawned worker would inherit it.
  int sockets = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(entry.path().filename().c_str());
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (ec || target.rfind("socket:", 0) != 0 || fd == raw.fd()) continue;
    ++sockets;
    EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0) << "fd " << fd << " (" << target << ")";
  }
  EXPECT_GE(sockets, 2);
}

TEST(CoordinatorMain, HelpAndBadUsage) {
  const std::string bin = dnallm::testing::kBin + "dnallm-coordinator";
  EXPECT_EQ(dnallm::testing::run_command(bin + " --help"), 0);
  EXPECT_EQ(dnallm::testing::run_command(bin + " --port notaport"), 2);
}

TEST(CoordinatorMain, ServesUntilSigterm) {
  std::string bin = dnallm::testing::kBin + "dnallm-coordinator";
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

// A standalone dnallm-coordinator started by a shell command line (`cmd`, which must end by
// backgrounding it and echoing its pid); stdout (the "port N" line) and stderr go to files.
class CoordinatorProcess {
 public:
  explicit CoordinatorProcess(const std::string& name, const std::string& prefix = "",
                              const std::string& args = "") {
    dir_ = ::testing::TempDir() + "/coord_" + name;
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    const std::string bin = dnallm::testing::kBin + "dnallm-coordinator";
    const std::string cmd = "cd " + dir_ + " && " + prefix + " " + bin +
                            " --host 127.0.0.1 --port 0 " + args +
                            " > out.txt 2> err.txt & echo $!";
    FILE* p = ::popen(cmd.c_str(), "r");
    if (p == nullptr || std::fscanf(p, "%d", &pid_) != 1) pid_ = 0;
    if (p) ::pclose(p);
    for (int i = 0; i < 400 && port_ == 0 && alive(); ++i) {
      std::this_thread::sleep_for(25ms);
      FILE* f = std::fopen((dir_ + "/out.txt").c_str(), "r");
      if (f) {
        if (std::fscanf(f, "port %d", &port_) != 1) port_ = 0;
        std::fclose(f);
      }
    }
  }
  ~CoordinatorProcess() {
    if (pid_ > 0 && alive()) {
      ::kill(pid_, SIGKILL);
      for (int i = 0; i < 200 && alive(); ++i) std::this_thread::sleep_for(10ms);
    }
  }
  bool alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0; }
  uint16_t port() const { return static_cast<uint16_t>(port_); }
  const std::string& dir() const { return dir_; }
  std::string err() const {
    std::ifstream in(dir_ + "/err.txt");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  std::string dir_;
  int pid_ = 0;
  int port_ = 0;
};

TEST(CoordinatorMain, WithoutATokenOneIsGeneratedIntoAFileOnlyItsReadersKnow) {
  CoordinatorProcess coord("token", "env -u DNALLM_JOB_TOKEN");
  ASSERT_GT(coord.port(), 0) << coord.err();
  const std::string file = coord.dir() + "/dnallm-job.token";
  ASSERT_TRUE(std::filesystem::exists(file)) << coord.err();
  EXPECT_EQ(std::filesystem::status(file).permissions() & std::filesystem::perms::others_read,
            std::filesystem::perms::none);
  std::ifstream in(file);
  std::string token;
  std::getline(in, token);
  EXPECT_EQ(token.size(), 32u);
  TcpStoreClientOptions o;
  o.port = coord.port();
  o.connect_timeout = 5s;
  o.token = "";  // what any client could send
  EXPECT_THROW(TcpStoreClient{o}, Error);
  o.token = token;
  TcpStoreClient c(o);
  c.set("k", to_bytes("v"));
  EXPECT_EQ(to_string(c.get("k", 1s)), "v");
  EXPECT_NE(coord.err().find("--token-file"), std::string::npos) << coord.err();
}

TEST(CoordinatorMain, NoTokenIsAnExplicitOptOut) {
  CoordinatorProcess coord("notoken", "env -u DNALLM_JOB_TOKEN", "--no-token");
  ASSERT_GT(coord.port(), 0) << coord.err();
  EXPECT_FALSE(std::filesystem::exists(coord.dir() + "/dnallm-job.token"));
  TcpStoreClientOptions o;
  o.port = coord.port();
  o.connect_timeout = 5s;
  TcpStoreClient c(o);
  c.ping();
  EXPECT_NE(coord.err().find("--no-token: any client"), std::string::npos) << coord.err();
}

TEST(CoordinatorMain, DescriptorExhaustionBacksOffLogsLittleAndKeepsServing) {
  // 64 descriptors: far below the pending-connection cap, so accept() itself fails (EMFILE).
  CoordinatorProcess coord("emfile", "ulimit -n 64 && DNALLM_JOB_TOKEN=t");
  ASSERT_GT(coord.port(), 0) << coord.err();
  std::vector<std::unique_ptr<RawSocket>> flood;
  for (int i = 0; i < 150; ++i) flood.push_back(std::make_unique<RawSocket>(coord.port()));
  std::this_thread::sleep_for(1500ms);
  const auto t0 = std::chrono::steady_clock::now();
  TcpStoreClient c(patient_client(coord.port(), "t"));
  c.set("k", to_bytes("v"));
  EXPECT_EQ(to_string(c.get("k", 1s)), "v");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  std::this_thread::sleep_for(1000ms);
  EXPECT_TRUE(coord.alive());
  const std::string err = coord.err();
  EXPECT_NE(err.find("accept failed: Too many open files"), std::string::npos) << err;
  // The unbounded version wrote ~1 million lines a second; the budget is ~10 a second.
  const auto lines = std::count(err.begin(), err.end(), '\n');
  EXPECT_LT(lines, 120) << err.substr(0, 4000);
}

}  // namespace
}  // namespace dnallm::coordinator
