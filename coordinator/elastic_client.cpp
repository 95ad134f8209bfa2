#include "coordinator/elastic_client.hpp"

#include "core/error.hpp"

namespace dnallm::coordinator {
namespace {

FrameWriter op(Op o) { return std::move(FrameWriter().u8(static_cast<uint8_t>(o))); }

}  // namespace

ElasticClient::ElasticClient(TcpStoreClientOptions options) : store_(std::move(options)) {}

JobView ElasticClient::call(const FrameWriter& request) {
  auto r = store_.request(request, store_.options().op_timeout, /*idempotent=*/true);
  const uint8_t code = request.body()[0];
  DNALLM_CHECK(r.status == Status::kOk, ExitCode::kPeerFailed,
               "coordinator {} answered '{}' with status {}", store_.address(), op_name(code),
               static_cast<int>(r.status));
  try {
    FrameReader reader(r.body.data(), r.body.size());
    return decode_job_view(reader);
  } catch (const ProtocolError& e) {
    fail(ExitCode::kPeerFailed, "coordinator {} sent a malformed '{}' reply: {}", store_.address(),
         op_name(code), e.what());
  }
}

JobView ElasticClient::join(const NodeInfo& node, int64_t known_generation) {
  return call(
      op(Op::kElasticJoin).str(node.node_id).str(node.host).i64(node.nproc).i64(known_generation));
}

JobView ElasticClient::heartbeat(const std::string& node_id, int64_t generation,
                                 const std::vector<int64_t>& steps,
                                 const std::vector<bool>& stopped) {
  FrameWriter w = op(Op::kElasticHeartbeat);
  w.str(node_id).i64(generation).u32(static_cast<uint32_t>(steps.size()));
  for (int64_t s : steps) w.i64(s);
  if (!stopped.empty() && stopped.size() == steps.size()) {
    w.u32(static_cast<uint32_t>(stopped.size()));
    for (bool b : stopped) w.u8(b ? 1 : 0);
  }
  return call(w);
}

JobView ElasticClient::report_failure(const FailureReport& f) {
  return call(op(Op::kElasticReportFailure)
                  .str(f.node_id)
                  .str(f.host)
                  .i64(f.rank)
                  .i64(f.exit_code)
                  .i64(f.signal)
                  .str(f.reason)
                  .keys(clip_last_lines(f.last_lines))
                  .i64(f.generation));
}

JobView ElasticClient::report_success(const std::string& node_id, int64_t generation) {
  return call(op(Op::kElasticReportSuccess).str(node_id).i64(generation));
}

JobView ElasticClient::state(const std::string& node_id) {
  return call(op(Op::kElasticState).str(node_id));
}

}  // namespace dnallm::coordinator
