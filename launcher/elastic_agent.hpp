// The elastic, multi-node agent: dnallm-launch with a coordinator (docs/elastic.md).
//
// One agent per node runs this loop on the main thread (it spawns the workers, and
// PR_SET_PDEATHSIG follows the spawning thread):
//   1. join: ElasticClient::join, repeated every poll interval (it also keeps the waiting
//      node alive) until this node has an assignment for a generation newer than the last
//      one it ran. A failed job exits 4 with the coordinator's root cause; a job that
//      succeeded meanwhile exits 0.
//   2. run: start the local workers with make_elastic_worker_specs(); every monitor
//      interval read their progress files and heartbeat the steps. When the coordinator
//      has opened a newer generation (another node failed, died, hung, or a node joined)
//      stop the workers (SIGTERM, SIGKILL after the grace period) and go to 1.
//   3. a local worker failed: report_failure (rank, exit code or signal, its last lines,
//      generation), the others were stopped; wait until the coordinator opens the next
//      generation (go to 1) or fails the job (exit 4, printing the root cause).
//   4. all local workers succeeded: report_success, keep heartbeating until the job
//      succeeded (exit 0), failed (exit 4) or a newer generation opened (go to 1: the whole
//      world runs again, as torchrun does).
//   A failed job exits 4, or with the failed worker's own 2, 3 or 5 (its diagnosis; the
//   coordinator does not restart those: coordinator::is_worker_diagnosis).
//   5. SIGINT/SIGTERM: forwarded to the workers, exit 128 + signal (the coordinator will
//      declare this node dead after its heartbeat timeout).
// Restart budgets are the coordinator's (job-wide); the agent has none of its own. The
// options come from the job's [elastic] section and dnallm-launch's flags (Note [Elastic
// settings], core/config.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cluster/topology.hpp"
#include "coordinator/elastic_client.hpp"
#include "coordinator/recovery.hpp"
#include "launcher/launch_plan.hpp"
#include "launcher/worker_group.hpp"

namespace dnallm::launcher {

struct ElasticAgentOptions {
  coordinator::NodeInfo node;                        // id, host, nproc
  std::chrono::milliseconds monitor_interval{1000};  // heartbeat period while running
  std::chrono::milliseconds poll_interval{100};      // while waiting for the coordinator
  std::string progress_dir;                          // where workers' progress files live
  GroupOptions group;                                // grace, tick (should_stop is ours)
  // Note [In-process recovery] (worker/train/in_process_recovery.hpp): warm spares started
  // beside the ranks (--spare-workers), and the coordinator's store, through which a dead
  // rank's place is given to one of them. 0 / null: a failure restarts the generation.
  int spare_workers = 0;
  std::shared_ptr<coordinator::Store> store;
  // Note [Shrink and grow]: a dead rank no spare takes is given up (elastic.shrink), and a fresh
  // worker started in its stead returns to its place once warm. Needs `store`.
  bool shrink = false;
};

// Builds one generation's workers from the coordinator's assignment.
using ElasticSpecFactory = std::function<std::vector<WorkerSpec>(
    const coordinator::NodeAssignment& assignment, const std::string& restart_reason)>;

class ElasticAgent {
 public:
  ElasticAgent(coordinator::ElasticClient& client, Spawner& spawner, StopSignals& signals,
               ElasticAgentOptions options, ElasticSpecFactory make_specs);

  // Runs the loop above; returns the exit code (0, 4, or 128 + signal). Throws
  // Error(kPeerFailed) when the coordinator cannot be reached.
  int run();

  int generations_run() const { return generations_run_; }

 private:
  // Step 1. Returns the view holding the new assignment, or a terminal view.
  coordinator::JobView wait_for_assignment(int& stop_signal);
  // Step 2: the generation of `assignment` becomes this node's; its old progress files go.
  void begin_generation(const coordinator::NodeAssignment& assignment);
  // Step 2: runs the workers of view.assignment, heartbeating every monitor interval, until
  // they end or the coordinator opens a newer generation; `latest` is the last view heard.
  // An error talking to the coordinator stops the workers first and is rethrown once they
  // are reaped.
  GenerationResult run_generation(const coordinator::JobView& view, coordinator::JobView& latest);
  // Note [In-process recovery]: gives the place of `failure`'s rank to spare `spare_id`
  // through the store. False when the store cannot be reached.
  bool hand_to_spare(const WorkerFailure& failure, int spare_id);
  // Note [Shrink and grow]: announces that the survivors go on without `failure`'s rank; false
  // when the store cannot be reached.
  bool shrink(const WorkerFailure& failure);
  // Note [Shrink and grow]: when spare `spare_id` waits warm, announces that it returns to
  // `place` (local rank `local_rank`); false while it is not ready or the store is unreachable.
  bool grow(int place, int local_rank, int spare_id);
  // The record of a recovery of this node's local rank `local_rank`, detected now.
  coordinator::RecoveryRecord local_record(coordinator::RecoveryKind kind, int place,
                                           int local_rank, std::string reason, int spare_id) const;
  // Announces `record`; false (logged with `what`) when the store cannot be reached.
  bool announce(const coordinator::RecoveryRecord& record, const std::string& what);
  // Step 3: logs every failed worker and reports the first to the coordinator.
  // Returns the coordinator's reply: the job as it stands once the report is in.
  coordinator::JobView report_failure(const GenerationResult& result);
  // Whether `v` ends this node's wait after a generation: the job ended, or a later generation
  // opened.
  bool settled(const coordinator::JobView& v) const;
  // Steps 3 and 4: waits while the current generation is still the open one.
  coordinator::JobView wait_for_next(bool heartbeat, int& stop_signal);
  // Per local rank, from one read of its progress file: the last step, and whether its worker
  // process is stopped (Note [Hang culprit], elastic_state.cpp).
  struct LocalProgress {
    std::vector<int64_t> steps;
    std::vector<bool> stopped;
    std::vector<int> pids;
  };
  LocalProgress read_local_progress() const;
  // Note [In-process recovery]: with spares, a local rank seen stopped (SIGSTOP) at two
  // heartbeats in a row is hung for good: SIGKILL it, so that a spare takes its place instead
  // of the coordinator restarting the generation after the hang timeout.
  void kill_stopped(const LocalProgress& progress);
  std::vector<int> stopped_beats_;  // per local rank: heartbeats in a row it was seen stopped

  coordinator::ElasticClient& client_;
  Spawner& spawner_;
  StopSignals& signals_;
  ElasticAgentOptions options_;
  ElasticSpecFactory make_specs_;
  int64_t generation_ = 0;  // the last generation this node ran
  int generations_run_ = 0;
};

// Note [Progress file]: the worker of local rank i gets DNALLM_PROGRESS_FILE =
// progress_file(dir, i) and may write its last completed step there as a decimal integer
// (best replaced atomically: write a temporary file, rename it), and its pid on a second line
// (then a stalled job names a stopped rank, Note [Hang culprit]). The agent reads it every
// monitor interval; a missing or unparsable file reads as -1 (no progress known), and ranks
// at -1 are not checked for hangs. Files are removed before each generation starts.
std::string progress_file(const std::string& dir, int local_rank);
struct WorkerProgress {
  int64_t step = -1;  // -1: missing or unparsable
  int pid = 0;        // 0: no second line
};
WorkerProgress read_progress(const std::string& path);
// True when process `pid` exists and is stopped (state T or t in /proc/<pid>/stat).
bool process_stopped(int pid);

// The workers of one generation: make_worker_specs() of `plan` placed as the assignment
// says, then RANK = rank_offset + local rank, WORLD_SIZE, GROUP_RANK = node rank,
// GROUP_WORLD_SIZE, DNALLM_GENERATION = generation, TORCHELASTIC_RESTART_COUNT =
// generation - 1 (job-wide), MASTER_ADDR/MASTER_PORT = the coordinator (whose key-value
// store the workers bootstrap from), DNALLM_EXTERNAL_COORDINATOR=1 (rank 0 must not host a
// store of its own) and DNALLM_PROGRESS_FILE (Note [Progress file]).
// With `spare_workers` K > 0 the K spares follow the ranks: local ranks nproc..nproc+K-1 with
// DNALLM_SPARE_ID 0..K-1, no progress file, and every worker gets DNALLM_IN_PROCESS_RECOVERY=1
// (also with `shrink`, Note [Shrink and grow]).
std::vector<WorkerSpec> make_elastic_worker_specs(const LaunchPlan& plan,
                                                  const cluster::EnvMap& base_env,
                                                  const coordinator::NodeAssignment& assignment,
                                                  const std::string& restart_reason,
                                                  const std::string& progress_dir,
                                                  int spare_workers = 0, bool shrink = false);

// Whether a worker that ended with `exit` is replaced by a spare: killed by a signal, or a
// failure of its own (not 2, 3, 5: its diagnosis would repeat; not 4: it saw a peer fail;
// not 75: preempted).
bool replaceable_by_spare(const WorkerExit& exit);

// "host:port" -> (host, port); throws Error(kUsage) naming `flag` on anything else.
std::pair<std::string, int> parse_endpoint(const std::string& endpoint, const std::string& flag);

// "--nnodes" value: "N" or "MIN:MAX" with 1 <= MIN <= MAX. Throws Error(kUsage).
std::pair<int, int> parse_nnodes(const std::string& spec);

}  // namespace dnallm::launcher
