#include "coordinator/elastic_client.hpp"

#include "core/error.hpp"

namespace dnallm::coordinator {

ElasticClient::ElasticClient(TcpStoreClientOptions options) : store_(std::move(options)) {}

JobView ElasticClient::call(const FrameWriter& request) {
  auto r = store_.request(request, store_.options().op_timeout, /*idempotent=*/true);
  const uint8_t code = request.body()[0];
  DNALLM_CHECK(r.status == Status::kOk, ExitCode::kPeerFailed,
               "coordinator {} answered '{}' with status {}", store_.address(), op_name(code),
               static_cast<int>(r.status));
  return store_.decode_reply<JobView>(r, code);
}

JobView ElasticClient::join(const NodeInfo& node, int64_t known_generation) {
  return call(encode_join({node, known_generation}));
}

JobView ElasticClient::heartbeat(const std::string& node_id, int64_t generation,
                                 const std::vector<int64_t>& steps,
                                 const std::vector<bool>& stopped) {
  return call(encode_heartbeat({node_id, generation, steps, stopped}));
}

JobView ElasticClient::report_failure(const FailureReport& report) {
  return call(encode_report_failure(report));
}

JobView ElasticClient::report_success(const std::string& node_id, int64_t generation) {
  return call(encode_report_success({node_id, generation}));
}

JobView ElasticClient::state(const std::string& node_id) { return call(encode_state({node_id})); }

}  // namespace dnallm::coordinator
