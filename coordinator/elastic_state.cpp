#include "coordinator/elastic_state.hpp"

#include <algorithm>
#include <csignal>
#include <cstring>

#include <fmt/format.h>

#include "core/enum_names.hpp"
#include "core/error.hpp"
#include "core/signals.hpp"

namespace dnallm::coordinator {
namespace {

double seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr EnumName<JobPhase> kJobPhaseNames[] = {{JobPhase::kRendezvous, "rendezvous"},
                                                 {JobPhase::kRunning, "running"},
                                                 {JobPhase::kSucceeded, "succeeded"},
                                                 {JobPhase::kFailed, "failed"}};
static_assert(lists_each_in_order<JobPhase::kFailed>(kJobPhaseNames));

}  // namespace

std::string FailureReport::describe() const {
  std::string who = rank >= 0 ? fmt::format("rank {} on {}", rank, host.empty() ? node_id : host)
                              : fmt::format("node {}", host.empty() ? node_id : host);
  std::string how;
  if (signal != 0) {
    how = fmt::format("killed by {}", signal_name(signal));
  } else if (exit_code != 0) {
    how = fmt::format("exited with code {}", exit_code);
  }
  if (!reason.empty()) how = how.empty() ? reason : how + ": " + reason;
  return how.empty() ? who : who + ": " + how;
}

bool is_worker_diagnosis(const FailureReport& report) {
  return report.signal == 0 && report.rank >= 0 && dnallm::is_worker_diagnosis(report.exit_code);
}

const char* job_phase_name(JobPhase phase) { return name_of(kJobPhaseNames, phase, "?"); }

ElasticState::ElasticState(ElasticOptions options) : options_(options) {
  DNALLM_CHECK(options_.min_nodes >= 1 && options_.min_nodes <= options_.max_nodes,
               ExitCode::kUsage, "elastic: need 1 <= min_nodes ({}) <= max_nodes ({})",
               options_.min_nodes, options_.max_nodes);
}

int64_t ElasticState::generation_open() const {
  return phase_ == JobPhase::kRendezvous ? generation_ + 1 : generation_;
}

std::vector<ElasticEvent> ElasticState::join(const NodeInfo& node, SteadyClock::time_point now) {
  std::vector<ElasticEvent> events;
  if (phase_ == JobPhase::kFailed || phase_ == JobPhase::kSucceeded) return events;
  DNALLM_CHECK(!node.node_id.empty() && node.nproc >= 1, ExitCode::kUsage,
               "elastic: a node must have an id and nproc >= 1");
  for (auto& j : joined_) {
    if (j.info.node_id == node.node_id) {
      j.joined_at = now;  // a repeated join refreshes liveness only
      return events;
    }
  }
  const bool is_member = std::any_of(members_.begin(), members_.end(), [&](const Member& m) {
    return m.info.node_id == node.node_id;
  });
  if (phase_ == JobPhase::kRendezvous && generation_ == 0 && joined_.empty()) {
    round_opened_at_ = now;  // the first round opens with its first join
  }
  joined_.push_back({node, now});
  last_join_at_ = now;
  if (phase_ == JobPhase::kRunning) {
    if (is_member) {
      // An agent that rejoins while its generation runs lost its workers (or restarted):
      // everyone must regroup.
      FailureReport cause{
          node.node_id, node.host, -1, 0, 0, "its agent rejoined while running", {}};
      if (!spend(membership_changes_used_, options_.max_membership_changes, cause, events,
                 "max_membership_changes")) {
        return events;
      }
      open_round(now, events, cause.describe());
    } else if (static_cast<int64_t>(members_.size()) < options_.max_nodes) {
      FailureReport cause{node.node_id, node.host, -1, 0, 0, "joined late; admitting it", {}};
      if (!spend(membership_changes_used_, options_.max_membership_changes, cause, events,
                 "max_membership_changes")) {
        return events;
      }
      open_round(now, events, cause.describe());
    }
    // Otherwise the job is full: the node waits for the next round.
    return events;
  }
  // Rendezvous: a node already expected (a previous member) counts as back.
  auto tick_events = tick(now);
  events.insert(events.end(), tick_events.begin(), tick_events.end());
  return events;
}

void ElasticState::heartbeat(const std::string& node_id, const std::vector<int64_t>& steps,
                             SteadyClock::time_point now, const std::vector<bool>& stopped) {
  for (auto& m : members_) {
    if (m.info.node_id != node_id) continue;
    m.last_seen = now;
    if (!steps.empty()) {
      m.stopped = stopped;
      m.stopped.resize(m.steps.size(), false);
    }
    for (size_t i = 0; i < steps.size() && i < m.steps.size(); ++i) {
      if (steps[i] != m.steps[i]) {
        m.steps[i] = steps[i];
        m.step_changed_at[i] = now;
      }
    }
  }
  for (auto& j : joined_) {
    if (j.info.node_id == node_id) j.joined_at = now;
  }
}

std::vector<ElasticEvent> ElasticState::tick(SteadyClock::time_point now) {
  std::vector<ElasticEvent> events;
  if (phase_ == JobPhase::kRendezvous) {
    tick_rendezvous(now, events);
  } else if (phase_ == JobPhase::kRunning) {
    tick_running(now, events);
  }
  return events;
}

// Step b: closes the open round when due, or fails the job when too few joined in time.
void ElasticState::tick_rendezvous(SteadyClock::time_point now, std::vector<ElasticEvent>& events) {
  // The first round opens with its first join (round_opened_at_ is unset before): a
  // coordinator ticking before any agent arrived must not time the join out.
  if (generation_ == 0 && joined_.empty()) return;
  // Joined nodes that went silent leave the round.
  joined_.erase(std::remove_if(joined_.begin(), joined_.end(),
                               [&](const Joined& j) {
                                 return now - j.joined_at > options_.heartbeat_timeout;
                               }),
                joined_.end());
  const auto count = static_cast<int64_t>(joined_.size());
  // Previous members not back yet: wait for them (they may be stopping their workers)
  // unless they are overdue by a heartbeat timeout.
  bool missing_previous = false;
  for (const auto& id : previous_order_) {
    bool back = std::any_of(joined_.begin(), joined_.end(),
                            [&](const Joined& j) { return j.info.node_id == id; });
    if (!back) missing_previous = true;
  }
  const bool overdue = now - round_opened_at_ > options_.heartbeat_timeout + options_.settle;
  if (count >= options_.max_nodes) {
    close_round(now, events);
  } else if (count >= options_.min_nodes && now - last_join_at_ >= options_.settle &&
             (!missing_previous || overdue)) {
    close_round(now, events);
  } else if (count < options_.min_nodes && now - round_opened_at_ > options_.join_timeout) {
    FailureReport cause{"",
                        "",
                        -1,
                        0,
                        0,
                        fmt::format("only {} of at least {} nodes joined within {:.0f} s", count,
                                    options_.min_nodes, seconds(options_.join_timeout)),
                        {}};
    fail_job(cause, events);
  }
}

// Step d: a node not heard from is dead, a rank without progress hangs; either opens the
// next round (step e) while the budget lasts.
void ElasticState::tick_running(SteadyClock::time_point now, std::vector<ElasticEvent>& events) {
  for (const auto& m : members_) {
    if (now - m.last_seen > options_.heartbeat_timeout) {
      FailureReport cause{
          m.info.node_id,
          m.info.host,
          -1,
          0,
          0,
          fmt::format("no heartbeat for {:.1f} s (node declared dead)", seconds(now - m.last_seen)),
          {}};
      events.push_back({ElasticEvent::Kind::kNodeDead, generation_, cause.describe()});
      // The dead node is not expected back in the next round.
      previous_order_.clear();
      std::string dead_id = m.info.node_id;
      for (const auto& other : members_) {
        if (other.info.node_id != dead_id) previous_order_.push_back(other.info.node_id);
      }
      if (!spend(membership_changes_used_, options_.max_membership_changes, cause, events,
                 "max_membership_changes")) {
        return;
      }
      auto survivors = previous_order_;
      open_round(now, events, cause.describe());
      previous_order_ = survivors;
      return;
    }
    if (m.succeeded) continue;
    for (size_t i = 0; i < m.steps.size(); ++i) {
      // A rank that never reported a step (-1: its worker writes no progress file) cannot be
      // judged; without this every such job would be a "hang" after step_timeout.
      if (m.steps[i] < 0) continue;
      if (now - m.step_changed_at[i] > options_.step_timeout) {
        const FailureReport cause = hang_culprit(m, i, now);
        events.push_back({ElasticEvent::Kind::kHang, generation_, cause.describe()});
        if (!spend(restarts_used_, options_.max_restarts, cause, events, "max_restarts")) {
          return;
        }
        open_round(now, events, cause.describe());
        return;
      }
    }
  }
}

// Note [Hang culprit]: when one rank stops, every other rank soon stalls inside the next
// collective, waiting for it, so "the first rank without progress" names an innocent one
// (rank 0, in node order). The one to name: a rank whose process its agent saw stopped
// (not scheduled: SIGSTOP, a debugger), else a rank behind the others (the rest completed
// a step it did not), else, when all stalled at the same step with nothing stopped, the
// first (a deadlock inside the collective or a peer outside the job's view).
FailureReport ElasticState::hang_culprit(const Member& first, size_t first_index,
                                         SteadyClock::time_point now) const {
  const Member* who = &first;
  size_t index = first_index;
  int64_t most = first.steps[first_index];
  bool stopped = false;
  for (const auto& m : members_) {
    for (size_t i = 0; i < m.steps.size(); ++i) {
      if (m.steps[i] < 0) continue;
      most = std::max(most, m.steps[i]);
      const bool is_stopped = i < m.stopped.size() && m.stopped[i];
      if (stopped && !is_stopped) continue;
      if ((is_stopped && !stopped) || m.steps[i] < who->steps[index]) {
        who = &m;
        index = i;
        stopped = is_stopped;
      }
    }
  }
  const int64_t step = who->steps[index];
  const double idle = seconds(now - who->step_changed_at[index]);
  std::string reason;
  if (stopped) {
    reason = fmt::format(
        "no progress for {:.1f} s after step {}: its process is stopped (SIGSTOP or a "
        "debugger), the other ranks wait for it in a collective",
        idle, step);
  } else if (step < most) {
    reason = fmt::format(
        "no progress for {:.1f} s after step {} while other ranks completed step {}: it is "
        "the one the others wait for (hang or straggler)",
        idle, step, most);
  } else {
    reason = fmt::format(
        "no progress for {:.1f} s after step {} (hang or straggler; every rank stopped at this "
        "step, none is stopped: a deadlock in a collective?)",
        idle, step);
  }
  return FailureReport{who->info.node_id,
                       who->info.host,
                       who->rank_offset + static_cast<int64_t>(index),
                       0,
                       0,
                       reason,
                       {}};
}

std::vector<ElasticEvent> ElasticState::report_failure(const FailureReport& report,
                                                       SteadyClock::time_point now) {
  std::vector<ElasticEvent> events;
  if (phase_ != JobPhase::kRunning) return events;  // already regrouping, or over
  if (report.generation >= 0 && report.generation < generation_) return events;  // stale
  const bool is_member = std::any_of(members_.begin(), members_.end(), [&](const Member& m) {
    return m.info.node_id == report.node_id;
  });
  if (!is_member) return events;
  events.push_back({ElasticEvent::Kind::kFailure, generation_, report.describe()});
  if (is_worker_diagnosis(report)) {
    // DESIGN.md exit codes: bad usage (2), bad data (3) or a corrupt checkpoint (5)
    // fail the same way every time; restarting would only spend the budget.
    FailureReport cause = report;
    cause.reason += cause.reason.empty() ? "not restarted (the worker's own diagnosis)"
                                         : "; not restarted (the worker's own diagnosis)";
    fail_job(cause, events);
    return events;
  }
  if (!spend(restarts_used_, options_.max_restarts, report, events, "max_restarts")) return events;
  open_round(now, events, report.describe());
  return events;
}

std::vector<ElasticEvent> ElasticState::report_success(const std::string& node_id,
                                                       SteadyClock::time_point now) {
  std::vector<ElasticEvent> events;
  if (phase_ != JobPhase::kRunning) return events;
  bool all = true;
  for (auto& m : members_) {
    if (m.info.node_id == node_id) {
      m.succeeded = true;
      m.last_seen = now;
    }
    all = all && m.succeeded;
  }
  if (all) {
    phase_ = JobPhase::kSucceeded;
    events.push_back(
        {ElasticEvent::Kind::kJobSucceeded, generation_,
         fmt::format("all {} nodes finished (generation {})", members_.size(), generation_)});
  }
  return events;
}

std::optional<NodeAssignment> ElasticState::assignment(const std::string& node_id) const {
  if (phase_ == JobPhase::kRendezvous) return std::nullopt;
  int64_t world = 0;
  for (const auto& m : members_) world += m.info.nproc;
  for (const auto& m : members_) {
    if (m.info.node_id == node_id) {
      return NodeAssignment{generation_, m.node_rank,   static_cast<int64_t>(members_.size()),
                            world,       m.rank_offset, m.info.nproc};
    }
  }
  return std::nullopt;
}

void ElasticState::open_round(SteadyClock::time_point now, std::vector<ElasticEvent>& events,
                              const std::string& why) {
  previous_order_.clear();
  for (const auto& m : members_) previous_order_.push_back(m.info.node_id);
  // Members are not in the new round until they rejoin; late joiners already waiting stay.
  members_.clear();
  phase_ = JobPhase::kRendezvous;
  round_opened_at_ = now;
  last_join_at_ = now;
  events.push_back({ElasticEvent::Kind::kRoundOpened, generation_ + 1,
                    fmt::format("restarting as generation {}: {}", generation_ + 1, why)});
}

void ElasticState::close_round(SteadyClock::time_point now, std::vector<ElasticEvent>& events) {
  // Stable order: previous members by their old node rank, then newcomers by join order.
  std::vector<Joined> ordered;
  for (const auto& id : previous_order_) {
    auto it = std::find_if(joined_.begin(), joined_.end(),
                           [&](const Joined& j) { return j.info.node_id == id; });
    if (it != joined_.end()) ordered.push_back(*it);
  }
  for (const auto& j : joined_) {
    bool taken = std::any_of(ordered.begin(), ordered.end(),
                             [&](const Joined& o) { return o.info.node_id == j.info.node_id; });
    if (!taken) ordered.push_back(j);
  }
  const auto take = std::min<size_t>(ordered.size(), static_cast<size_t>(options_.max_nodes));
  members_.clear();
  int64_t offset = 0;
  for (size_t i = 0; i < take; ++i) {
    Member m;
    m.info = ordered[i].info;
    m.node_rank = static_cast<int64_t>(i);
    m.rank_offset = offset;
    m.last_seen = now;
    m.steps.assign(static_cast<size_t>(m.info.nproc), -1);
    m.step_changed_at.assign(static_cast<size_t>(m.info.nproc), now);
    offset += m.info.nproc;
    members_.push_back(std::move(m));
  }
  // Whoever did not fit waits for the next round.
  joined_.assign(ordered.begin() + static_cast<std::ptrdiff_t>(take), ordered.end());
  previous_order_.clear();
  ++generation_;
  phase_ = JobPhase::kRunning;
  events.push_back({ElasticEvent::Kind::kRoundClosed, generation_,
                    fmt::format("generation {}: {} node(s), world size {}", generation_,
                                members_.size(), offset)});
}

void ElasticState::fail_job(const FailureReport& cause, std::vector<ElasticEvent>& events) {
  phase_ = JobPhase::kFailed;
  root_cause_ = cause;
  events.push_back({ElasticEvent::Kind::kJobFailed, generation_, cause.describe()});
}

bool ElasticState::spend(int64_t& used, int64_t budget, const FailureReport& cause,
                         std::vector<ElasticEvent>& events, const char* budget_name) {
  ++used;
  if (used <= budget) return true;
  FailureReport final_cause = cause;
  final_cause.reason += fmt::format(" ({} = {} exhausted)", budget_name, budget);
  fail_job(final_cause, events);
  return false;
}

}  // namespace dnallm::coordinator
