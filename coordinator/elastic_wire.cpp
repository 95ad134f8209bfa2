#include "coordinator/elastic_wire.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dnallm::coordinator {
namespace {

void check_node_id(const std::string& id) {
  DNALLM_CHECK(!id.empty() && id.size() <= kMaxNodeIdBytes, ExitCode::kUsage,
               "node id must have 1..{} bytes (got {})", kMaxNodeIdBytes, id.size());
}

// A request that names its sender: decoded, and the node id checked.
template <class Request>
Request decode_from_node(FrameReader& r) {
  auto request = decode_message<Request>(r);
  check_node_id(request.node_id);
  return request;
}

}  // namespace

void write_field(FrameWriter& w, JobPhase phase) { w.u8(static_cast<uint8_t>(phase)); }

void read_field(FrameReader& r, JobPhase& phase) {
  const uint8_t v = r.u8();
  if (v > static_cast<uint8_t>(JobPhase::kFailed)) {
    throw ProtocolError(fmt::format("job phase {} out of range", v));
  }
  phase = static_cast<JobPhase>(v);
}

FrameWriter encode_join(const JoinRequest& request) {
  return encode_request(Op::kElasticJoin, request);
}

JoinRequest decode_join(FrameReader& r) {
  JoinRequest request = decode_message<JoinRequest>(r);
  const NodeInfo& node = request.node;
  check_node_id(node.node_id);
  DNALLM_CHECK(node.nproc >= 1 && node.nproc <= kMaxLocalRanks, ExitCode::kUsage,
               "nproc {} of node {} out of range 1..{}", node.nproc, node.node_id, kMaxLocalRanks);
  DNALLM_CHECK(node.host.size() <= kMaxNodeIdBytes, ExitCode::kUsage, "host name too long");
  return request;
}

// Written by hand for its optional tail (the stopped flags, sent by newer agents only).
FrameWriter encode_heartbeat(const HeartbeatRequest& request) {
  FrameWriter w;
  w.u8(static_cast<uint8_t>(Op::kElasticHeartbeat)).str(request.node_id).i64(request.generation);
  write_field(w, request.steps);
  if (!request.stopped.empty() && request.stopped.size() == request.steps.size()) {
    w.u32(static_cast<uint32_t>(request.stopped.size()));
    for (bool b : request.stopped) w.u8(b ? 1 : 0);
  }
  return w;
}

HeartbeatRequest decode_heartbeat(FrameReader& r) {
  HeartbeatRequest request;
  request.node_id = r.str();
  check_node_id(request.node_id);
  request.generation = r.i64();
  const uint32_t n = r.u32();
  DNALLM_CHECK(n <= kMaxLocalRanks, ExitCode::kUsage, "heartbeat with {} steps (at most {})", n,
               kMaxLocalRanks);
  request.steps.resize(n);
  for (auto& s : request.steps) s = r.i64();
  if (!r.done()) {
    const uint32_t k = r.u32();
    DNALLM_CHECK(k == n, ExitCode::kUsage, "heartbeat with {} steps but {} stopped flags", n, k);
    for (uint32_t i = 0; i < k; ++i) request.stopped.push_back(r.u8() != 0);
  }
  r.expect_done();
  return request;
}

FrameWriter encode_report_failure(const FailureReport& report) {
  FailureReport clipped = report;
  clipped.last_lines = clip_last_lines(report.last_lines);
  return encode_request(Op::kElasticReportFailure, clipped);
}

FailureReport decode_report_failure(FrameReader& r) {
  FailureReport report = decode_from_node<FailureReport>(r);
  DNALLM_CHECK(report.last_lines.size() <= kMaxLastLines, ExitCode::kUsage,
               "failure report with {} lines (at most {})", report.last_lines.size(),
               kMaxLastLines);
  report.last_lines = clip_last_lines(report.last_lines);
  return report;
}

FrameWriter encode_report_success(const ReportSuccessRequest& request) {
  return encode_request(Op::kElasticReportSuccess, request);
}

ReportSuccessRequest decode_report_success(FrameReader& r) {
  return decode_from_node<ReportSuccessRequest>(r);
}

FrameWriter encode_state(const StateRequest& request) {
  return encode_request(Op::kElasticState, request);
}

StateRequest decode_state(FrameReader& r) { return decode_from_node<StateRequest>(r); }

FrameWriter encode_job_view(const JobView& view) { return encode_reply(view); }

JobView decode_job_view(FrameReader& r) { return decode_message<JobView>(r); }

std::string format_root_cause(const FailureReport& report) {
  std::string out = report.describe();
  if (report.generation >= 0) out += fmt::format(" [generation {}]", report.generation);
  if (!report.last_lines.empty()) {
    out += fmt::format("\n  its last {} line(s):", report.last_lines.size());
    for (const auto& l : report.last_lines) out += "\n    " + l;
  }
  return out;
}

std::vector<std::string> clip_last_lines(const std::vector<std::string>& lines) {
  size_t first = lines.size() > kMaxLastLines ? lines.size() - kMaxLastLines : 0;
  std::vector<std::string> out;
  for (size_t i = first; i < lines.size(); ++i) {
    out.push_back(lines[i].size() > kMaxLastLineBytes ? lines[i].substr(0, kMaxLastLineBytes)
                                                      : lines[i]);
  }
  return out;
}

}  // namespace dnallm::coordinator
