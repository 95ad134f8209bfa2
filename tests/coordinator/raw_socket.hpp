// A raw loopback connection to a coordinator's server for the hostile-client tests of
// store_server_test.cpp and elastic_service_test.cpp: bytes exactly as given, frames read back
// by hand, and a 5 s receive timeout so a test cannot hang.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/protocol.hpp"

namespace dnallm::coordinator::testing {

// The HELLO frame that authenticates with `token`.
inline std::vector<uint8_t> hello_frame(const std::string& token) {
  return FrameWriter()
      .u8(static_cast<uint8_t>(Op::kHello))
      .u32(kProtocolVersion)
      .str(token)
      .frame();
}

class RawSocket {
 public:
  explicit RawSocket(uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ~RawSocket() { ::close(fd_); }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;
  int fd() const { return fd_; }
  // Sends every byte (a test failure otherwise).
  void send(const std::vector<uint8_t>& bytes) {
    ASSERT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  void hello(const std::string& token) { send(hello_frame(token)); }
  // The next response body, or nullopt if the server closed the connection.
  std::optional<std::vector<uint8_t>> recv_frame() {
    uint8_t header[4];
    if (!read_all(header, 4)) return std::nullopt;
    std::vector<uint8_t> body(decode_u32_le(header));
    if (!read_all(body.data(), body.size())) return std::nullopt;
    return body;
  }
  // The status byte of the next reply; -1 when the server closed the connection.
  int reply_status() {
    const auto body = recv_frame();
    return body && !body->empty() ? (*body)[0] : -1;
  }
  // True if the server closed the connection (EOF), false on data or timeout.
  bool closed_by_server() {
    uint8_t b;
    return ::recv(fd_, &b, 1, 0) == 0;
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

}  // namespace dnallm::coordinator::testing
