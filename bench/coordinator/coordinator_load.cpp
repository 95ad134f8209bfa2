// dnallm-coordinator-load: hostile load against a live coordinator (Note [Hostile clients] in
// coordinator/store_server.hpp), while a legitimate client is timed.
//
// Keeps open, reconnecting whenever the server cuts one:
//   --idle N    connections that never send a byte;
//   --large N   clients that announce a 64 MiB frame without HELLO and stream garbage;
//   --drip N    clients that send a HELLO one byte per second.
// Every --probe-ms a legitimate client connects, authenticates with --token and pings; the
// slowest probe and the failures are reported. With --watch-pid the peak VmRSS of that
// process is sampled, and the run ends when it exits (or after --duration seconds).
// Prints one JSON object. Loopback or any IPv4 address.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <signal.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/proc_status.hpp"
#include "coordinator/protocol.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
namespace co = dnallm::coordinator;

struct Options {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;
  int idle = 1000, large = 50, drip = 20;
  double duration_s = 60;
  int probe_ms = 100;
  int watch_pid = 0;
};

enum class Kind { kIdle, kLarge, kDrip };

struct Hostile {
  Kind kind;
  int fd = -1;
  size_t sent = 0;
  Clock::time_point next_byte{};
};

int connect_nonblocking(const Options& o) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(o.port));
  ::inet_pton(AF_INET, o.host.c_str(), &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True when the server closed (or reset) the connection.
bool cut_by_server(int fd) {
  char buf[256];
  ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n == 0) return true;
  if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOTCONN;
  return false;
}

// What the run measured; the probe thread and the main loop share it under `mu`.
struct Stats {
  std::mutex mu;
  double peak_rss = 0, max_probe_ms = 0;
  int probes = 0, failed_probes = 0;
  std::string first_failure;
  uint64_t reconnects = 0, large_bytes = 0;  // the main loop's alone
};

// One legitimate client: connect, authenticate, ping. Empty on success, else why not.
std::string probe_once(const Options& o) {
  try {
    co::TcpStoreClientOptions c;
    c.host = o.host;
    c.port = static_cast<uint16_t>(o.port);
    c.token = o.token;
    c.connect_timeout = 5s;
    c.op_timeout = 5s;
    co::TcpStoreClient client(c);
    client.ping();
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

// The probe thread: a legitimate client every --probe-ms until `done`.
void probe_loop(const Options& o, const std::atomic<bool>& done, Stats& stats) {
  while (!done) {
    const auto t0 = Clock::now();
    const std::string why = probe_once(o);
    const bool ok = why.empty();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(stats.mu);
      if (done && !ok) break;  // the job (and its coordinator) ended meanwhile
      ++stats.probes;
      if (ok) {
        stats.max_probe_ms = std::max(stats.max_probe_ms, ms);
      } else {
        ++stats.failed_probes;
        if (stats.first_failure.empty()) stats.first_failure = why;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(o.probe_ms));
  }
}

// The bytes the hostile clients send.
struct Payloads {
  std::vector<uint8_t> hello;       // --drip: one byte of it a second
  std::vector<uint8_t> large_head;  // --large: a 64 MiB frame announced without HELLO ...
  std::vector<uint8_t> garbage;     // ... and garbage streamed after it
};

Payloads make_payloads(const Options& o) {
  Payloads p;
  p.hello = co::FrameWriter()
                .u8(static_cast<uint8_t>(co::Op::kHello))
                .u32(co::kProtocolVersion)
                .str(o.token)
                .frame();
  p.large_head = {0, 0, 0, 4, static_cast<uint8_t>(co::Op::kHello)};  // 64 MiB
  p.garbage.assign(64 << 10, 0x5a);
  return p;
}

// One round for one hostile client: reconnect when the server cut it, then send its bytes.
void drive(Hostile& c, const Options& o, const Payloads& p, Clock::time_point now, Stats& stats) {
  if (c.fd >= 0 && cut_by_server(c.fd)) {
    ::close(c.fd);
    c.fd = -1;
    ++stats.reconnects;
  }
  if (c.fd < 0) {
    c.fd = connect_nonblocking(o);
    c.sent = 0;
    c.next_byte = now + 1s;
    if (c.fd < 0) return;
  }
  if (c.kind == Kind::kLarge) {
    if (c.sent == 0) {
      ssize_t n = ::send(c.fd, p.large_head.data(), p.large_head.size(), MSG_NOSIGNAL);
      if (n > 0) c.sent = static_cast<size_t>(n);
    } else {
      ssize_t n = ::send(c.fd, p.garbage.data(), p.garbage.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) stats.large_bytes += static_cast<uint64_t>(n);
    }
  } else if (c.kind == Kind::kDrip && now >= c.next_byte && c.sent < p.hello.size()) {
    if (::send(c.fd, &p.hello[c.sent], 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1) ++c.sent;
    c.next_byte = now + 1s;
  }
}

// Keeps the hostile clients going for --duration seconds or until --watch-pid exits.
void run_hostile(const Options& o, Stats& stats) {
  std::vector<Hostile> clients;
  for (int i = 0; i < o.idle; ++i) clients.push_back({Kind::kIdle});
  for (int i = 0; i < o.large; ++i) clients.push_back({Kind::kLarge});
  for (int i = 0; i < o.drip; ++i) clients.push_back({Kind::kDrip});
  const Payloads payloads = make_payloads(o);
  const auto end =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.duration_s * 1000));
  while (Clock::now() < end) {
    if (o.watch_pid > 0) {
      // A process that exited (a zombie until its parent reaps it) has no VmRSS line.
      const double r = dnallm::bench::proc_status_mb("VmRSS", std::to_string(o.watch_pid));
      if (r < 0) break;
      std::lock_guard<std::mutex> lock(stats.mu);
      stats.peak_rss = std::max(stats.peak_rss, r);
    }
    const auto now = Clock::now();
    for (auto& c : clients) drive(c, o, payloads, now, stats);
    std::this_thread::sleep_for(50ms);
  }
  for (auto& c : clients)
    if (c.fd >= 0) ::close(c.fd);
}

void print_report(const Options& o, const Stats& s) {
  nlohmann::ordered_json out;
  out["idle"] = o.idle;
  out["large"] = o.large;
  out["drip"] = o.drip;
  out["probes"] = s.probes;
  out["failed_probes"] = s.failed_probes;
  out["max_probe_ms"] = s.max_probe_ms;
  out["peak_rss_mb"] = s.peak_rss;
  out["reconnects"] = s.reconnects;
  out["large_bytes_sent"] = s.large_bytes;
  if (!s.first_failure.empty()) out["first_failure"] = s.first_failure;
  std::cout << out.dump() << std::endl;
}

// As many file descriptors as the hard limit allows (--idle connections).
void raise_fd_limit() {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;  // within the hard limit
  ::setrlimit(RLIMIT_NOFILE, &lim);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dnallm-coordinator-load: hostile clients against a live coordinator"};
  Options o;
  app.add_option("--host", o.host);
  app.add_option("--port", o.port)->required();
  app.add_option("--token", o.token, "the job token of the legitimate probe client");
  app.add_option("--idle", o.idle)->capture_default_str();
  app.add_option("--large", o.large)->capture_default_str();
  app.add_option("--drip", o.drip)->capture_default_str();
  app.add_option("--duration", o.duration_s, "seconds (at most)")->capture_default_str();
  app.add_option("--probe-ms", o.probe_ms)->capture_default_str();
  app.add_option("--watch-pid", o.watch_pid, "sample this process's RSS; stop when it exits");
  CLI11_PARSE(app, argc, argv);
  ::signal(SIGPIPE, SIG_IGN);
  raise_fd_limit();
  Stats stats;
  std::atomic<bool> done{false};
  std::thread probe([&] { probe_loop(o, done, stats); });
  run_hostile(o, stats);
  done = true;
  probe.join();
  print_report(o, stats);
  return 0;
}
