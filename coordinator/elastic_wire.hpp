// The elastic message types on the coordinator's frame protocol (coordinator/protocol.hpp):
// how a node agent talks to the ElasticState the coordinator holds. Encoding and decoding
// are pure functions shared by ElasticService (server) and ElasticClient (agent).
//
// Requests (every field as in protocol.hpp step 3) and their kOk reply:
//  a. kElasticJoin          node_id, host, i64 nproc, i64 known_generation   -> JobView
//       known_generation: the last generation this agent ran (0 = none). A join from a node
//       that is already a member of a newer generation than it knows is only a poll: it
//       does not count as a rejoin (see ElasticService).
//  b. kElasticHeartbeat     node_id, i64 generation, u32 n, n x i64 steps     -> JobView
//       steps[i]: last completed step of local rank i, -1 when unknown. Steps sent for a
//       generation other than the current one refresh liveness only. Optionally followed
//       by u32 n, n x u8 stopped[i]: 1 when the agent saw local rank i's process stopped
//       (names the culprit of a hang, Note [Hang culprit] in elastic_state.cpp).
//  c. kElasticReportFailure node_id, host, i64 rank, i64 exit_code, i64 signal, reason,
//                           key list last_lines, i64 generation                 -> JobView
//  d. kElasticReportSuccess node_id, i64 generation                          -> JobView
//  e. kElasticState         node_id                                          -> JobView
//  JobView reply: u8 phase (JobPhase), i64 generation, i64 generation_open,
//       i64 restarts_used, i64 membership_changes_used, u8 has_assignment, then (when 1)
//       i64 generation, node_rank, nnodes, world_size, rank_offset, local_world_size;
//       string round_reason (why the last round opened), string root_cause ("" unless
//       the job failed), i64 exit_code (0 running or succeeded; 4, or the failed worker's
//       own 2/3/5, once failed).
//  Values out of range (empty or > kMaxNodeIdBytes node id, nproc or step count outside
//  [1, kMaxLocalRanks], more than kMaxLastLines lines) are answered kBadRequest.
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

void encode_job_view(FrameWriter& w, const JobView& view);
// Throws ProtocolError on a malformed body.
JobView decode_job_view(FrameReader& r);

// The report the job prints when it fails: FailureReport::describe(), the generation, and
// the rank's last log lines, indented.
std::string format_root_cause(const FailureReport& report);

// Shortens lines and their count to the wire limits (keeps the newest lines).
std::vector<std::string> clip_last_lines(const std::vector<std::string>& lines);

}  // namespace dnallm::coordinator
