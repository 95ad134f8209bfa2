#include "comm/bootstrap.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include <spdlog/spdlog.h>

#include "comm/make_communicator.hpp"
#include "coordinator/commit_registry.hpp"
#include "coordinator/net.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"

namespace dnallm::comm {
namespace {

bool is_loopback_name(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0;
}

// MASTER_ADDR resolved to its first IPv4 address on this host; "" when it does not resolve.
std::string first_ipv4(const std::string& host) {
  const auto all = coordinator::resolve_ipv4(host);
  return all.empty() ? std::string() : all.front();
}

// The local IPv4 address this host uses to reach host:port (a connected UDP socket sends
// nothing; the kernel only picks the route and the source address). "" when unknown.
std::string local_address_towards(const std::string& host, int port) {
  const std::string ip = first_ipv4(host);
  if (ip.empty()) return "";
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) return "";
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_port = htons(static_cast<uint16_t>(port));
  std::string out;
  if (::inet_pton(AF_INET, ip.c_str(), &peer.sin_addr) == 1 &&
      ::connect(fd, reinterpret_cast<sockaddr*>(&peer), sizeof(peer)) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char text[INET_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) != nullptr) {
      out = text;
    }
  }
  ::close(fd);
  return out;
}

}  // namespace

std::string store_bind_address(const std::string& master_addr, const std::string& resolved,
                               const std::string& override_addr, std::string* warning) {
  if (!override_addr.empty()) return override_addr;
  if (master_addr == "localhost") return "127.0.0.1";
  if (is_loopback_name(master_addr)) return master_addr;  // 127.0.0.2 binds 127.0.0.2
  if (resolved.empty()) return master_addr;               // let bind() name the problem
  if (resolved.rfind("127.", 0) == 0) {
    if (warning) {
      *warning = "MASTER_ADDR " + master_addr + " resolves to the loopback address " + resolved +
                 " on rank 0's host, which peers on other hosts cannot reach: the store listens "
                 "on every interface (0.0.0.0); set DNALLM_STORE_BIND to this host's address "
                 "to restrict it";
    }
    return "0.0.0.0";
  }
  return resolved;
}

ProcessGroup::~ProcessGroup() {
  comm.reset();  // collectives reference the store: tear down first
  store.reset();
  if (server) {
    server->stop();
    server->join();
  }
}

namespace {

// Rank 0's store server at MASTER_PORT, started. It also serves the checkpoint commit ops
// (coordinator/commit_registry.hpp): static multi-rank runs commit through it.
std::unique_ptr<coordinator::StoreServer> host_store(const ProcessGroupOptions& options) {
  coordinator::StoreServerOptions so;
  so.port = static_cast<uint16_t>(options.master_port);
  so.token = options.token;
  // Note [Store bind address]
  std::string warning;
  const char* env_bind = std::getenv("DNALLM_STORE_BIND");
  so.host = !options.store_bind.empty() ? options.store_bind
                                        : store_bind_address(options.master_addr,
                                                             is_loopback_name(options.master_addr)
                                                                 ? std::string()
                                                                 : first_ipv4(options.master_addr),
                                                             env_bind ? env_bind : "", &warning);
  if (!warning.empty()) spdlog::warn("{}", warning);
  auto server = std::make_unique<coordinator::StoreServer>(so);
  coordinator::register_commit_ops(*server);
  try {
    server->start();
  } catch (const Error& e) {
    fail(ExitCode::kUsage,
         "rank 0 cannot host the store on {}:{} for MASTER_ADDR {}: {} (MASTER_ADDR must "
         "name rank 0's host; DNALLM_STORE_BIND chooses another of its addresses)",
         so.host, so.port, options.master_addr, e.what());
  }
  spdlog::debug("store listening on {}:{}", so.host, so.port);
  return server;
}

// The communicator's options of connect_process_group, but for the store.
CommOptions comm_options(const ProcessGroupOptions& options) {
  CommOptions co;
  co.backend = options.backend;
  co.rank = options.rank;
  co.world_size = options.world_size;
  co.timeout = options.timeout;
  co.name = options.name;
  co.device = options.device;
  co.device_shared = options.device_shared;
  co.check_collectives = options.check_collectives;
  if (options.master_addr.empty()) return co;
  co.loopback = is_loopback_name(options.master_addr);
  // Note [Gloo address]: peers reach this rank at the address it uses to reach the store
  // (the route towards MASTER_ADDR), not at whatever its host name resolves to, which is
  // loopback on many machines (/etc/hosts) and wrong across network namespaces or
  // multi-homed nodes. DNALLM_GLOO_HOST overrides.
  if (const char* host = std::getenv("DNALLM_GLOO_HOST"); host != nullptr && *host != '\0') {
    co.gloo_host = host;
  } else if (!co.loopback) {
    co.gloo_host = local_address_towards(options.master_addr, options.master_port);
  }
  return co;
}

}  // namespace

ProcessGroup connect_process_group(const ProcessGroupOptions& options) {
  ProcessGroup group;
  if (!options.master_addr.empty()) {
    DNALLM_CHECK(options.master_port > 0 && options.master_port < 65536, ExitCode::kUsage,
                 "MASTER_PORT {} is not a valid port", options.master_port);
    if (options.rank == 0 && options.rank0_hosts_store) group.server = host_store(options);
    coordinator::TcpStoreClientOptions to;
    to.host = options.master_addr;
    to.port = static_cast<uint16_t>(options.master_port);
    to.token = options.token;
    to.connect_timeout = options.connect_timeout;
    group.store = std::make_shared<coordinator::TcpStoreClient>(to);
  }
  CommOptions co = comm_options(options);
  co.store = group.store;
  group.comm = make_communicator(co);
  return group;
}

std::unique_ptr<Communicator> reconnect(const ProcessGroupOptions& options,
                                        std::shared_ptr<coordinator::Store> store,
                                        const std::string& name) {
  CommOptions co = comm_options(options);
  co.store = std::move(store);
  co.name = name;
  return make_communicator(co);
}

}  // namespace dnallm::comm
