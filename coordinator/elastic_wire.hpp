// The elastic message types on the coordinator's frame protocol (coordinator/protocol.hpp):
// how a node agent talks to the ElasticState the coordinator holds. Each op's request and
// its JobView reply have an encode/decode pair here, shared by ElasticService (server) and
// ElasticClient (agent); the field lists (wire_fields, at the end) define the wire layout once.
//
// Requests (every field as in protocol.hpp step 3), named by the steps a-f of the protocol
// in coordinator/elastic_state.hpp that they carry, and their kOk reply:
//  kElasticJoin (32)          steps a, c   JoinRequest: node_id, host, i64 nproc,
//                                          i64 known_generation                 -> JobView
//       known_generation: the last generation this agent ran (0 = none). A join from a node
//       that is already a member of a newer generation than it knows is only a poll for its
//       assignment (step c): it does not count as a rejoin (see ElasticService).
//  kElasticHeartbeat (33)     step d       HeartbeatRequest: node_id, i64 generation,
//                                          u32 n, n x i64 steps                 -> JobView
//       steps[i]: last completed step of local rank i, -1 when unknown. Steps sent for a
//       generation other than the current one refresh liveness only. Optionally followed
//       by u32 n, n x u8 stopped[i]: 1 when the agent saw local rank i's process stopped
//       (names the culprit of a hang, Note [Hang culprit] in elastic_state.cpp).
//  kElasticReportFailure (34) step e       FailureReport: node_id, host, i64 rank,
//                                          i64 exit_code, i64 signal, reason,
//                                          key list last_lines, i64 generation  -> JobView
//  kElasticReportSuccess (35) step f       ReportSuccessRequest: node_id,
//                                          i64 generation                       -> JobView
//  kElasticState (36)         any step     StateRequest: node_id (read only)    -> JobView
//  JobView reply: u8 phase (JobPhase), i64 generation, i64 generation_open,
//       i64 restarts_used, i64 membership_changes_used, u8 has_assignment, then (when 1)
//       i64 generation, node_rank, nnodes, world_size, rank_offset, local_world_size;
//       string round_reason (why the last round opened), string root_cause ("" unless
//       the job failed), i64 exit_code (0 running or succeeded; 4, or the failed worker's
//       own 2/3/5, once failed).
//  Values out of range (empty or > kMaxNodeIdBytes node id or host, nproc or step count
//  outside [1, kMaxLocalRanks] resp. [0, kMaxLocalRanks], more than kMaxLastLines lines)
//  make the decoder throw Error(kUsage), which the server answers kBadRequest; a body that
//  does not parse throws ProtocolError (the server closes the connection).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/elastic_state.hpp"
#include "coordinator/protocol.hpp"

namespace dnallm::coordinator {

constexpr size_t kMaxNodeIdBytes = 256;
constexpr int64_t kMaxLocalRanks = 4096;
constexpr size_t kMaxLastLines = 64;
constexpr size_t kMaxLastLineBytes = 1024;

// What an agent learns from every elastic reply.
struct JobView {
  JobPhase phase = JobPhase::kRendezvous;
  int64_t generation = 0;
  int64_t generation_open = 1;
  int64_t restarts_used = 0;
  int64_t membership_changes_used = 0;
  std::optional<NodeAssignment> assignment;  // this node's, in `generation`
  std::string round_reason;                  // why the newest round opened ("" for the first)
  std::string root_cause;                    // the root-cause report once the job failed
  int64_t exit_code = 0;  // what agents exit with: 0, 4, or the worker's own 2/3/5

  bool terminal() const { return phase == JobPhase::kSucceeded || phase == JobPhase::kFailed; }
};

struct JoinRequest {
  NodeInfo node;
  int64_t known_generation = 0;
};

struct HeartbeatRequest {
  std::string node_id;
  int64_t generation = 0;
  std::vector<int64_t> steps;
  std::vector<bool> stopped;  // empty, or one flag per step
};

struct ReportSuccessRequest {
  std::string node_id;
  int64_t generation = 0;
};

struct StateRequest {
  std::string node_id;
};

// Request bodies start with their op byte; decoders read what follows it. Every decoder
// throws ProtocolError on a malformed body and Error(kUsage) on values out of range.
FrameWriter encode_join(const JoinRequest& request);
JoinRequest decode_join(FrameReader& r);

// `stopped` is sent only when it has one flag per step.
FrameWriter encode_heartbeat(const HeartbeatRequest& request);
HeartbeatRequest decode_heartbeat(FrameReader& r);

// The last lines are clipped to the wire limits (clip_last_lines) on both sides.
FrameWriter encode_report_failure(const FailureReport& report);
FailureReport decode_report_failure(FrameReader& r);

FrameWriter encode_report_success(const ReportSuccessRequest& request);
ReportSuccessRequest decode_report_success(FrameReader& r);

FrameWriter encode_state(const StateRequest& request);
StateRequest decode_state(FrameReader& r);

// The reply to every elastic op (fields after the status byte).
FrameWriter encode_job_view(const JobView& view);
JobView decode_job_view(FrameReader& r);

// The report the job prints when it fails: FailureReport::describe(), the generation, and
// the rank's last log lines, indented.
std::string format_root_cause(const FailureReport& report);

// Shortens lines and their count to the wire limits (keeps the newest lines).
std::vector<std::string> clip_last_lines(const std::vector<std::string>& lines);

// Field lists (protocol.hpp, "Message codecs"). JobPhase travels as a range-checked u8.
void write_field(FrameWriter& w, JobPhase phase);
void read_field(FrameReader& r, JobPhase& phase);

constexpr auto wire_fields(const NodeAssignment*) {
  return std::make_tuple(&NodeAssignment::generation, &NodeAssignment::node_rank,
                         &NodeAssignment::nnodes, &NodeAssignment::world_size,
                         &NodeAssignment::rank_offset, &NodeAssignment::local_world_size);
}
constexpr auto wire_fields(const JobView*) {
  return std::make_tuple(&JobView::phase, &JobView::generation, &JobView::generation_open,
                         &JobView::restarts_used, &JobView::membership_changes_used,
                         &JobView::assignment, &JobView::round_reason, &JobView::root_cause,
                         &JobView::exit_code);
}
constexpr auto wire_fields(const NodeInfo*) {
  return std::make_tuple(&NodeInfo::node_id, &NodeInfo::host, &NodeInfo::nproc);
}
constexpr auto wire_fields(const JoinRequest*) {
  return std::make_tuple(&JoinRequest::node, &JoinRequest::known_generation);
}
constexpr auto wire_fields(const FailureReport*) {
  return std::make_tuple(&FailureReport::node_id, &FailureReport::host, &FailureReport::rank,
                         &FailureReport::exit_code, &FailureReport::signal, &FailureReport::reason,
                         &FailureReport::last_lines, &FailureReport::generation);
}
constexpr auto wire_fields(const ReportSuccessRequest*) {
  return std::make_tuple(&ReportSuccessRequest::node_id, &ReportSuccessRequest::generation);
}
constexpr auto wire_fields(const StateRequest*) { return std::make_tuple(&StateRequest::node_id); }

}  // namespace dnallm::coordinator
