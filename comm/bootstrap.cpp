#include "comm/bootstrap.hpp"

#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"

namespace dnallm::comm {

ProcessGroup::~ProcessGroup() {
  comm.reset();  // collectives reference the store: tear down first
  store.reset();
  if (server) {
    server->stop();
    server->join();
  }
}

ProcessGroup connect_process_group(const ProcessGroupOptions& options) {
  ProcessGroup group;
  CommOptions co;
  co.backend = options.backend;
  co.rank = options.rank;
  co.world_size = options.world_size;
  co.timeout = options.timeout;
  co.name = options.name;
  co.device = options.device;
  if (!options.master_addr.empty()) {
    DNALLM_CHECK(options.master_port > 0 && options.master_port < 65536, ExitCode::kUsage,
                 "MASTER_PORT {} is not a valid port", options.master_port);
    if (options.rank == 0 && options.rank0_hosts_store) {
      coordinator::StoreServerOptions so;
      so.port = static_cast<uint16_t>(options.master_port);
      so.token = options.token;
      // Loopback jobs listen on loopback only; otherwise every interface of this node, since
      // peers reach it through MASTER_ADDR, which may name any of them.
      if (options.master_addr == "127.0.0.1" || options.master_addr == "localhost") {
        so.host = "127.0.0.1";
      }
      group.server = std::make_unique<coordinator::StoreServer>(so);
      group.server->start();
    }
    coordinator::TcpStoreClientOptions to;
    to.host = options.master_addr;
    to.port = static_cast<uint16_t>(options.master_port);
    to.token = options.token;
    to.connect_timeout = options.connect_timeout;
    group.store = std::make_shared<coordinator::TcpStoreClient>(to);
    co.store = group.store;
    co.loopback = options.master_addr == "127.0.0.1" || options.master_addr == "localhost";
  }
  group.comm = make_communicator(co);
  return group;
}

}  // namespace dnallm::comm
