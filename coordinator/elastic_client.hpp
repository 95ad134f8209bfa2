// ElasticClient: a node agent's side of the elastic protocol (coordinator/elastic_wire.hpp)
// over one TcpStoreClient connection.
//
// Contracts: blocking, thread-safe (requests are serialised by the TcpStoreClient). Each
// call has the TcpStoreClient's op_timeout and reconnects on a lost connection (all elastic
// requests are idempotent or harmless to repeat: join and state are, a repeated heartbeat
// is, a repeated failure report for the same generation is ignored once the round opened).
// A coordinator unreachable beyond connect_timeout throws Error(kPeerFailed); a wrong token
// throws Error(kUsage); a request the coordinator rejects throws Error(kFailure).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "coordinator/elastic_wire.hpp"
#include "coordinator/tcp_store_client.hpp"

namespace dnallm::coordinator {

class ElasticClient {
 public:
  // Connects now (up to options.connect_timeout).
  explicit ElasticClient(TcpStoreClientOptions options);

  JobView join(const NodeInfo& node, int64_t known_generation);
  // `stopped` (optional, one flag per step): local ranks whose process is stopped.
  JobView heartbeat(const std::string& node_id, int64_t generation,
                    const std::vector<int64_t>& steps, const std::vector<bool>& stopped = {});
  JobView report_failure(const FailureReport& report);
  JobView report_success(const std::string& node_id, int64_t generation);
  JobView state(const std::string& node_id);

  std::string address() const { return store_.address(); }

 private:
  JobView call(const FrameWriter& request);

  TcpStoreClient store_;
};

}  // namespace dnallm::coordinator
