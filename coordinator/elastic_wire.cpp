#include "coordinator/elastic_wire.hpp"

#include <fmt/format.h>

namespace dnallm::coordinator {

void encode_job_view(FrameWriter& w, const JobView& view) {
  w.u8(static_cast<uint8_t>(view.phase))
      .i64(view.generation)
      .i64(view.generation_open)
      .i64(view.restarts_used)
      .i64(view.membership_changes_used)
      .u8(view.assignment ? 1 : 0);
  if (view.assignment) {
    const NodeAssignment& a = *view.assignment;
    w.i64(a.generation)
        .i64(a.node_rank)
        .i64(a.nnodes)
        .i64(a.world_size)
        .i64(a.rank_offset)
        .i64(a.local_world_size);
  }
  w.str(view.round_reason).str(view.root_cause).i64(view.exit_code);
}

JobView decode_job_view(FrameReader& r) {
  JobView v;
  uint8_t phase = r.u8();
  if (phase > static_cast<uint8_t>(JobPhase::kFailed)) {
    throw ProtocolError(fmt::format("job phase {} out of range", phase));
  }
  v.phase = static_cast<JobPhase>(phase);
  v.generation = r.i64();
  v.generation_open = r.i64();
  v.restarts_used = r.i64();
  v.membership_changes_used = r.i64();
  if (r.u8() != 0) {
    NodeAssignment a;
    a.generation = r.i64();
    a.node_rank = r.i64();
    a.nnodes = r.i64();
    a.world_size = r.i64();
    a.rank_offset = r.i64();
    a.local_world_size = r.i64();
    v.assignment = a;
  }
  v.round_reason = r.str();
  v.root_cause = r.str();
  v.exit_code = r.i64();
  r.expect_done();
  return v;
}

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
