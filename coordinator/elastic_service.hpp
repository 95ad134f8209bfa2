// ElasticService: the elastic membership protocol (coordinator/elastic_state.hpp, steps a-f)
// and the checkpoint commit registry (coordinator/commit_registry.hpp, ops 37-38) served over
// the coordinator's StoreServer. Registers the ops of coordinator/elastic_wire.hpp (decoded
// there) on the server and owns one ElasticState behind a mutex, plus a ticker thread that calls
// ElasticState::tick() every `tick` so rounds close and dead or hung nodes are detected
// even when no message arrives. Every ElasticEvent is logged (spdlog, "elastic:" prefix).
//
// Threads: handlers run on the server's io thread; the ticker is owned here (start/stop/
// join). Construct before StoreServer::start() (handlers must be registered first); the
// server must outlive nothing of this object's: stop() both, then destroy the service.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/commit_registry.hpp"
#include "coordinator/elastic_state.hpp"
#include "coordinator/elastic_wire.hpp"
#include "coordinator/store_server.hpp"

namespace dnallm::coordinator {

struct ElasticServiceOptions {
  ElasticOptions state;
  std::chrono::milliseconds tick{200};  // ElasticState::tick period
};

class ElasticService {
 public:
  // Registers the elastic handlers on `server` (call before server.start()).
  ElasticService(StoreServer& server, ElasticServiceOptions options);
  ~ElasticService();
  ElasticService(const ElasticService&) = delete;
  ElasticService& operator=(const ElasticService&) = delete;

  void start();  // starts the ticker thread
  void stop();   // idempotent, any thread
  void join();

  // The job as `node_id` sees it. Thread-safe.
  JobView view(const std::string& node_id);

  // Blocks until the job is over (succeeded or failed) and every node heard from in the last
  // heartbeat timeout has been told so in a reply, or until `timeout`. The hosting agent
  // calls it before it takes the coordinator down, so the others learn the outcome instead
  // of losing the connection. Returns whether all were told.
  bool wait_outcome_delivered(std::chrono::milliseconds timeout);

 private:
  // Registers the handler of one elastic op: decode, then apply under mutex_ (returns the
  // sender's node id), then answer that node's JobView.
  template <class Request>
  void serve(Op op, Request (*decode)(FrameReader&),
             std::string (ElasticService::*apply)(const Request&, SteadyClock::time_point));
  // The ops' effects on the state (coordinator/elastic_wire.hpp), under mutex_.
  std::string on_join(const JoinRequest& request, SteadyClock::time_point now);
  std::string on_heartbeat(const HeartbeatRequest& request, SteadyClock::time_point now);
  std::string on_report_failure(const FailureReport& report, SteadyClock::time_point now);
  std::string on_report_success(const ReportSuccessRequest& request, SteadyClock::time_point now);
  std::string on_state(const StateRequest& request, SteadyClock::time_point now);

  // All under mutex_.
  JobView view_locked(const std::string& node_id);
  void apply_locked(const std::vector<ElasticEvent>& events);
  JobView reply_locked(const std::string& node_id, SteadyClock::time_point now);
  void run_ticker();

  // Note [Keys of old generations]: when generation N's round closes, every member has
  // stopped the workers of older generations (and a dead node's workers died with their
  // agent), so the store keys those workers named after their generation can go:
  // "comm/g<k>/" (communicator bootstrap and liveness) for every k < N. Without this a long
  // elastic job leaks a communicator's worth of keys per restart. (Checkpoint shards go to the
  // commit registry, ops 37-38, not to store keys.)
  void erase_old_generations_locked(int64_t current);

  StoreServer& server_;
  ElasticServiceOptions options_;
  int64_t erased_below_ = 1;  // keys of generations below this are gone; guarded by mutex_
  std::mutex mutex_;
  std::condition_variable changed_;                         // state or stop_ changed
  ElasticState state_;                                      // guarded by mutex_
  std::string round_reason_;                                // guarded by mutex_
  std::map<std::string, SteadyClock::time_point> contact_;  // guarded by mutex_
  std::set<std::string> told_outcome_;                      // guarded by mutex_
  bool stop_ = false;                                       // guarded by mutex_
  std::thread ticker_;
};

}  // namespace dnallm::coordinator
