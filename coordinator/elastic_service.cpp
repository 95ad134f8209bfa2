#include "coordinator/elastic_service.hpp"

#include <spdlog/spdlog.h>

#include "core/error.hpp"

namespace dnallm::coordinator {
namespace {

std::string read_node_id(FrameReader& r) {
  std::string id = r.str();
  DNALLM_CHECK(!id.empty() && id.size() <= kMaxNodeIdBytes, ExitCode::kUsage,
               "node id must have 1..{} bytes (got {})", kMaxNodeIdBytes, id.size());
  return id;
}

void log_event(const ElasticEvent& e) {
  switch (e.kind) {
    case ElasticEvent::Kind::kRoundClosed:
    case ElasticEvent::Kind::kJobSucceeded:
      spdlog::info("elastic: {}", e.message);
      break;
    case ElasticEvent::Kind::kRoundOpened:
      spdlog::warn("elastic: {}", e.message);
      break;
    case ElasticEvent::Kind::kNodeDead:
      spdlog::error("elastic: node dead: {}", e.message);
      break;
    case ElasticEvent::Kind::kHang:
      spdlog::error("elastic: hang: {}", e.message);
      break;
    case ElasticEvent::Kind::kFailure:
      spdlog::error("elastic: failure: {}", e.message);
      break;
    case ElasticEvent::Kind::kJobFailed:
      spdlog::error("elastic: job failed: {}", e.message);
      break;
  }
}

}  // namespace

ElasticService::ElasticService(StoreServer& server, ElasticServiceOptions options)
    : server_(server), options_(options), state_(options.state) {
  // Each handler parses its request under the lock, applies it, and answers the JobView.
  auto handle = [this](auto body) -> StoreServer::Handler {
    return [this, body](FrameReader& args, Responder reply) {
      const auto now = SteadyClock::now();
      JobView view;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        std::string node_id = body(args, now);
        view = reply_locked(node_id, now);
      }
      changed_.notify_all();
      FrameWriter w;
      encode_job_view(w, view);
      reply.send(Status::kOk, w);
    };
  };

  // a. join
  server.register_handler(static_cast<uint8_t>(Op::kElasticJoin),
                          handle([this](FrameReader& r, SteadyClock::time_point now) {
                            NodeInfo node;
                            node.node_id = read_node_id(r);
                            node.host = r.str();
                            node.nproc = r.i64();
                            const int64_t known_generation = r.i64();
                            r.expect_done();
                            DNALLM_CHECK(node.nproc >= 1 && node.nproc <= kMaxLocalRanks,
                                         ExitCode::kUsage, "nproc {} of node {} out of range 1..{}",
                                         node.nproc, node.node_id, kMaxLocalRanks);
                            DNALLM_CHECK(node.host.size() <= kMaxNodeIdBytes, ExitCode::kUsage,
                                         "host name too long");
                            auto a = state_.assignment(node.node_id);
                            if (a && a->generation > known_generation) {
                              // Its round closed while it polled: a member learning its assignment,
                              // not a rejoin.
                              state_.heartbeat(node.node_id, {}, now);
                            } else {
                              spdlog::debug("elastic: join from {} ({}, {} local ranks)",
                                            node.node_id, node.host, node.nproc);
                              apply_locked(state_.join(node, now));
                            }
                            return node.node_id;
                          }));

  // b. heartbeat
  server.register_handler(static_cast<uint8_t>(Op::kElasticHeartbeat),
                          handle([this](FrameReader& r, SteadyClock::time_point now) {
                            std::string node_id = read_node_id(r);
                            const int64_t generation = r.i64();
                            const uint32_t n = r.u32();
                            DNALLM_CHECK(n <= kMaxLocalRanks, ExitCode::kUsage,
                                         "heartbeat with {} steps (at most {})", n, kMaxLocalRanks);
                            std::vector<int64_t> steps(n);
                            for (auto& s : steps) s = r.i64();
                            // Optional (newer agents): u32 n, n x u8 "process stopped".
                            std::vector<bool> stopped;
                            if (!r.done()) {
                              const uint32_t k = r.u32();
                              DNALLM_CHECK(k == n, ExitCode::kUsage,
                                           "heartbeat with {} steps but {} stopped flags", n, k);
                              for (uint32_t i = 0; i < k; ++i) stopped.push_back(r.u8() != 0);
                            }
                            r.expect_done();
                            if (generation != state_.generation()) steps.clear();
                            state_.heartbeat(node_id, steps, now, stopped);
                            return node_id;
                          }));

  // c. report_failure
  server.register_handler(static_cast<uint8_t>(Op::kElasticReportFailure),
                          handle([this](FrameReader& r, SteadyClock::time_point now) {
                            FailureReport f;
                            f.node_id = read_node_id(r);
                            f.host = r.str();
                            f.rank = r.i64();
                            f.exit_code = static_cast<int>(r.i64());
                            f.signal = static_cast<int>(r.i64());
                            f.reason = r.str();
                            f.last_lines = r.keys();
                            f.generation = r.i64();
                            r.expect_done();
                            DNALLM_CHECK(f.last_lines.size() <= kMaxLastLines, ExitCode::kUsage,
                                         "failure report with {} lines (at most {})",
                                         f.last_lines.size(), kMaxLastLines);
                            f.last_lines = clip_last_lines(f.last_lines);
                            spdlog::error("elastic: {} reports: {}", f.node_id,
                                          format_root_cause(f));
                            apply_locked(state_.report_failure(f, now));
                            return f.node_id;
                          }));

  // d. report_success
  server.register_handler(static_cast<uint8_t>(Op::kElasticReportSuccess),
                          handle([this](FrameReader& r, SteadyClock::time_point now) {
                            std::string node_id = read_node_id(r);
                            const int64_t generation = r.i64();
                            r.expect_done();
                            if (generation == state_.generation()) {
                              spdlog::info("elastic: {} finished generation {}", node_id,
                                           generation);
                              apply_locked(state_.report_success(node_id, now));
                            }
                            return node_id;
                          }));

  // Checkpoint commit (coordinator/commit_registry.hpp, ops 37-38).
  register_commit_ops(server);

  // e. state
  server.register_handler(static_cast<uint8_t>(Op::kElasticState),
                          handle([](FrameReader& r, SteadyClock::time_point) {
                            std::string node_id = read_node_id(r);
                            r.expect_done();
                            return node_id;
                          }));
}

ElasticService::~ElasticService() {
  stop();
  join();
}

void ElasticService::start() {
  DNALLM_CHECK(!ticker_.joinable(), ExitCode::kFailure, "ElasticService started twice");
  ticker_ = std::thread([this] { run_ticker(); });
}

void ElasticService::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
}

void ElasticService::join() {
  if (ticker_.joinable()) ticker_.join();
}

void ElasticService::run_ticker() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    changed_.wait_for(lock, options_.tick, [&] { return stop_; });
    if (stop_) break;
    apply_locked(state_.tick(SteadyClock::now()));
  }
}

JobView ElasticService::view(const std::string& node_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  return view_locked(node_id);
}

JobView ElasticService::view_locked(const std::string& node_id) {
  JobView v;
  v.phase = state_.phase();
  v.generation = state_.generation();
  v.generation_open = state_.generation_open();
  v.restarts_used = state_.restarts_used();
  v.membership_changes_used = state_.membership_changes_used();
  v.assignment = state_.assignment(node_id);
  v.round_reason = round_reason_;
  if (state_.root_cause()) {
    v.root_cause = format_root_cause(*state_.root_cause());
    v.exit_code = is_worker_diagnosis(*state_.root_cause())
                      ? state_.root_cause()->exit_code
                      : static_cast<int64_t>(ExitCode::kPeerFailed);
  }
  return v;
}

JobView ElasticService::reply_locked(const std::string& node_id, SteadyClock::time_point now) {
  apply_locked(state_.tick(now));
  contact_[node_id] = now;
  JobView v = view_locked(node_id);
  if (v.terminal()) told_outcome_.insert(node_id);
  return v;
}

void ElasticService::apply_locked(const std::vector<ElasticEvent>& events) {
  for (const auto& e : events) {
    log_event(e);
    if (e.kind == ElasticEvent::Kind::kRoundOpened) round_reason_ = e.message;
    if (e.kind == ElasticEvent::Kind::kRoundClosed) erase_old_generations_locked(e.generation);
  }
  if (!events.empty()) changed_.notify_all();
}

// See Note [Keys of old generations] in the header.
void ElasticService::erase_old_generations_locked(int64_t current) {
  if (current <= erased_below_) return;
  std::vector<std::string> prefixes;
  for (int64_t g = erased_below_; g < current; ++g) prefixes.push_back(fmt::format("comm/g{}/", g));
  spdlog::info("elastic: generation {} started; deleting the store keys of generations {}..{}",
               current, erased_below_, current - 1);
  erased_below_ = current;
  server_.erase_prefixes(std::move(prefixes));
}

bool ElasticService::wait_outcome_delivered(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto deadline = SteadyClock::now() + timeout;
  auto delivered = [&] {
    if (state_.phase() != JobPhase::kSucceeded && state_.phase() != JobPhase::kFailed) return false;
    const auto now = SteadyClock::now();
    for (const auto& [id, seen] : contact_) {
      if (now - seen <= options_.state.heartbeat_timeout && told_outcome_.count(id) == 0) {
        return false;
      }
    }
    return true;
  };
  while (!delivered()) {
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) return delivered();
  }
  return true;
}

}  // namespace dnallm::coordinator
