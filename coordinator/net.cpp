#include "coordinator/net.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dnallm::coordinator {

std::vector<std::string> resolve_ipv4(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::vector<std::string> out;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return out;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET_ADDRSTRLEN] = {0};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) out.emplace_back(text);
  }
  ::freeaddrinfo(found);
  return out;
}

std::string generate_job_token() {
  unsigned char bytes[16];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  DNALLM_SYSCHECK(fd, "/dev/urandom");
  std::size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      fail(ExitCode::kFailure, "cannot read /dev/urandom: {}", errno_string(e));
    }
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

}  // namespace dnallm::coordinator
