// Bootstrap of a process group from a rank's place in the job: the store every rank connects
// to (served by rank 0, or by an external coordinator such as dnallm-launch's), and the
// communicator built on it. Shared by dnallm-train and dnallm-bench-comm.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/communicator.hpp"
#include "coordinator/store.hpp"
#include "coordinator/store_server.hpp"

namespace dnallm::comm {

struct ProcessGroupOptions {
  std::string backend = "auto";  // see CommOptions::backend
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";  // "" = no store (mpi only: MPI bootstraps itself)
  int master_port = 29500;
  std::string token;  // DNALLM_JOB_TOKEN
  // Rank 0 serves the store at master_port unless an external coordinator already does.
  bool rank0_hosts_store = true;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // per collective
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  std::string name = "default";  // communicator name (unique per group in a job)
  // Where rank 0's store listens; "" = store_bind_address(master_addr, ...).
  std::string store_bind;
  Device device{};                 // see CommOptions::device
  bool device_shared = false;      // see CommOptions::device_shared
  bool check_collectives = false;  // see CommOptions::check_collectives
};

// Holds what keeps the group alive; destroy the communicator before the store.
struct ProcessGroup {
  // Rank 0 only, when it hosts the store; it also serves the checkpoint commit ops
  // (coordinator::register_commit_ops).
  std::unique_ptr<coordinator::StoreServer> server;
  std::shared_ptr<coordinator::Store> store;
  std::unique_ptr<Communicator> comm;
  ~ProcessGroup();
  ProcessGroup() = default;
  ProcessGroup(ProcessGroup&&) = default;
  ProcessGroup& operator=(ProcessGroup&&) = default;
};

// Connects this rank (blocking, collective over all ranks, up to connect_timeout + timeout).
// Throws Error(kPeerFailed) when peers do not come, Error(kUsage) for a bad backend.
ProcessGroup connect_process_group(const ProcessGroupOptions& options);

// Note [In-process recovery] (worker/train/in_process_recovery.hpp): a new communicator for
// the same rank and world over `store` (the group's), named `name`, built as
// connect_process_group builds its own (blocking, collective over all ranks).
std::unique_ptr<Communicator> reconnect(const ProcessGroupOptions& options,
                                        std::shared_ptr<coordinator::Store> store,
                                        const std::string& name);

// Note [Store bind address]: rank 0's store listens on the address MASTER_ADDR names on
// this host, never on every interface silently. `resolved` is MASTER_ADDR resolved here
// (IPv4 dotted quad, "" when it does not resolve). "localhost" binds 127.0.0.1, a 127.x
// address binds itself. A name
// that resolves to loopback although it is not a loopback name (Debian maps the host name
// to 127.0.1.1 in /etc/hosts, while peers resolve it to the real address) cannot be bound
// usefully: the result is "0.0.0.0" and *warning says why and what to set
// (DNALLM_STORE_BIND). `override_addr` (DNALLM_STORE_BIND) wins when set.
std::string store_bind_address(const std::string& master_addr, const std::string& resolved,
                               const std::string& override_addr, std::string* warning);

}  // namespace dnallm::comm
