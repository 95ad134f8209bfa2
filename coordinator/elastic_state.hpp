// The coordinator's membership and elastic state machine: rendezvous rounds, node ranks,
// liveness, hang detection and the job-wide restart budgets. Pure logic: no sockets, no
// threads, time passed in by the caller, so every transition is unit-tested. The server
// holds one ElasticState behind a mutex and feeds it the agents' messages.
//
// Protocol, as seen by a node agent (dnallm-launch):
//  a. join(node): the node enters the open round (or waits for the next one if the job is
//     running and full).
//  b. The round closes when max_nodes have joined, or when at least min_nodes have joined and
//     no one joined for `settle`. Closing bumps the generation and assigns node ranks:
//     members of the previous generation keep their order, newcomers follow in join order;
//     rank offsets are the prefix sums of nproc.
//  c. Each agent polls assignment(node) until it has one for the new generation, then starts
//     its workers with that world (DNALLM_GENERATION = generation).
//  d. While running, agents send heartbeat(node, steps) every heartbeat interval. A node not
//     heard from for heartbeat_timeout is declared dead (membership change); a rank whose
//     step does not advance for step_timeout is a hang (a failure, naming rank and host).
//     Ranks still at step -1 (no progress known) are not judged.
//  e. A worker failure (report_failure) or a dead or hung node opens a new round: every agent
//     sees generation_open() > its generation, stops its workers and rejoins (step a).
//     Failures consume max_restarts; joins and deaths consume max_membership_changes. When a
//     budget is exhausted the job fails and root_cause() says which rank on which host, why.
//     A worker's own diagnosis (exit 2, 3 or 5: is_worker_diagnosis) fails the job at once.
//  f. Each agent reports success when its workers finished; when all members have, the job
//     has succeeded.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dnallm::coordinator {

using SteadyClock = std::chrono::steady_clock;

// The binaries fill these from the configuration's [elastic] section, where the defaults users
// get are (coordinator::elastic_options, coordinator/elastic_config.hpp); the initialisers
// below only serve code that builds an ElasticState directly (tests).
struct ElasticOptions {
  int64_t min_nodes = 1;
  int64_t max_nodes = 1;
  std::chrono::milliseconds settle{2000};              // quiet time before closing at >= min
  std::chrono::milliseconds heartbeat_timeout{10000};  // silent this long: dead
  std::chrono::milliseconds step_timeout{300000};      // no step progress this long: hang
  std::chrono::milliseconds join_timeout{600000};      // an open round below min fails the job
  int64_t max_restarts = 3;                            // worker failures and hangs
  int64_t max_membership_changes = 10;                 // deaths and late joins
};

struct NodeInfo {
  std::string node_id;  // unique per agent (host:pid or --node-id)
  std::string host;
  int64_t nproc = 1;
};

struct NodeAssignment {
  int64_t generation = 0;
  int64_t node_rank = 0;
  int64_t nnodes = 0;
  int64_t world_size = 0;
  int64_t rank_offset = 0;  // global rank of this node's local rank 0
  int64_t local_world_size = 0;
};

struct FailureReport {
  std::string node_id;
  std::string host;
  int64_t rank = -1;                    // global rank, -1 when the whole node is concerned
  int exit_code = 0;                    // process exit code, when it exited
  int signal = 0;                       // terminating signal, when it was killed
  std::string reason;                   // one line: what happened
  std::vector<std::string> last_lines;  // the rank's last log lines
  int64_t generation = -1;       // the generation the failed workers ran; older ones are ignored
  std::string describe() const;  // "rank 3 on node2: killed by SIGKILL (...)"
};

// A worker that exited with 2 (usage), 3 (bad data) or 5 (checkpoint corrupt) diagnosed
// itself (DESIGN.md exit codes): report_failure() fails the job at once instead of
// restarting, and the agents exit with that code.
bool is_worker_diagnosis(const FailureReport& report);

enum class JobPhase { kRendezvous, kRunning, kSucceeded, kFailed };
const char* job_phase_name(JobPhase phase);

// Something the server should log and put in the metrics (the "restart" events).
struct ElasticEvent {
  enum class Kind {
    kRoundClosed,
    kNodeDead,
    kHang,
    kFailure,
    kRoundOpened,
    kJobFailed,
    kJobSucceeded
  };
  Kind kind;
  int64_t generation = 0;
  std::string message;
};

class ElasticState {
 public:
  explicit ElasticState(ElasticOptions options);

  // Step a. Idempotent for a node already in the open round. Returns the events it caused.
  std::vector<ElasticEvent> join(const NodeInfo& node, SteadyClock::time_point now);

  // Steps b and d: closes the round when due, detects dead and hung nodes. Call after every
  // message and at least every heartbeat interval.
  std::vector<ElasticEvent> tick(SteadyClock::time_point now);

  // Step d. `steps[i]` is the last completed step of local rank i (-1: not started);
  // `stopped[i]`: the agent saw local rank i's process stopped (not scheduled), which names
  // it as the culprit of a hang (Note [Hang culprit] in elastic_state.cpp).
  void heartbeat(const std::string& node_id, const std::vector<int64_t>& steps,
                 SteadyClock::time_point now, const std::vector<bool>& stopped = {});

  // Step e. A failure reported by an agent about one of its ranks.
  std::vector<ElasticEvent> report_failure(const FailureReport& report,
                                           SteadyClock::time_point now);

  // Step f.
  std::vector<ElasticEvent> report_success(const std::string& node_id, SteadyClock::time_point now);

  // Step c: the node's assignment in the current (closed) generation, if it is a member.
  std::optional<NodeAssignment> assignment(const std::string& node_id) const;

  JobPhase phase() const { return phase_; }
  // The generation of the last closed round (0 before the first).
  int64_t generation() const { return generation_; }
  // The generation agents must be at: generation() while running, generation() + 1 while a
  // round is open. An agent whose workers run an older generation must stop them and rejoin.
  int64_t generation_open() const;
  int64_t restarts_used() const { return restarts_used_; }
  int64_t membership_changes_used() const { return membership_changes_used_; }
  size_t members() const { return members_.size(); }
  size_t waiting() const { return joined_.size(); }
  // Why the job failed (set when phase() == kFailed).
  const std::optional<FailureReport>& root_cause() const { return root_cause_; }

 private:
  struct Member {
    NodeInfo info;
    int64_t node_rank = 0;
    int64_t rank_offset = 0;
    SteadyClock::time_point last_seen;
    std::vector<int64_t> steps;                            // last step per local rank
    std::vector<SteadyClock::time_point> step_changed_at;  // when each last advanced
    std::vector<bool> stopped;                             // last heartbeat's, per local rank
    bool succeeded = false;
  };
  struct Joined {
    NodeInfo info;
    SteadyClock::time_point joined_at;
  };

  FailureReport hang_culprit(const Member& first, size_t first_index,
                             SteadyClock::time_point now) const;
  void open_round(SteadyClock::time_point now, std::vector<ElasticEvent>& events,
                  const std::string& why);
  void close_round(SteadyClock::time_point now, std::vector<ElasticEvent>& events);
  void fail_job(const FailureReport& cause, std::vector<ElasticEvent>& events);
  bool spend(int64_t& used, int64_t budget, const FailureReport& cause,
             std::vector<ElasticEvent>& events, const char* budget_name);

  ElasticOptions options_;
  JobPhase phase_ = JobPhase::kRendezvous;
  int64_t generation_ = 0;
  int64_t restarts_used_ = 0;
  int64_t membership_changes_used_ = 0;
  std::vector<Member> members_;              // current generation, by node rank
  std::vector<Joined> joined_;               // the open round (or waiting for the next), join order
  std::vector<std::string> previous_order_;  // node ids of the last generation, by node rank
  SteadyClock::time_point round_opened_at_{};
  SteadyClock::time_point last_join_at_{};
  std::optional<FailureReport> root_cause_;
};

}  // namespace dnallm::coordinator
