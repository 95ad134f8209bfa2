#include "coordinator/elastic_service.hpp"

#include <spdlog/spdlog.h>

#include "core/enum_names.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {
namespace {

// The level and prefix each event kind is logged with. See Note [Enum tables]
// (core/enum_names.hpp).
struct LogStyle {
  spdlog::level::level_enum level;
  const char* prefix;
};
using EventKind = ElasticEvent::Kind;
constexpr EnumName<EventKind, LogStyle> kLogStyles[] = {
    {EventKind::kRoundClosed, {spdlog::level::info, ""}},
    {EventKind::kNodeDead, {spdlog::level::err, "node dead: "}},
    {EventKind::kHang, {spdlog::level::err, "hang: "}},
    {EventKind::kFailure, {spdlog::level::err, "failure: "}},
    {EventKind::kRoundOpened, {spdlog::level::warn, ""}},
    {EventKind::kJobFailed, {spdlog::level::err, "job failed: "}},
    {EventKind::kJobSucceeded, {spdlog::level::info, ""}}};
static_assert(lists_each_in_order<EventKind::kJobSucceeded>(kLogStyles));

void log_event(const ElasticEvent& e) {
  const LogStyle style = name_of(kLogStyles, e.kind, {spdlog::level::err, ""});
  spdlog::log(style.level, "elastic: {}{}", style.prefix, e.message);
}

}  // namespace

// Each elastic request is decoded, applied under the lock, and answered with the JobView of
// the node that sent it.
template <class Request>
void ElasticService::serve(Op op, Request (*decode)(FrameReader&),
                           std::string (ElasticService::*apply)(const Request&,
                                                                SteadyClock::time_point)) {
  server_.register_handler(static_cast<uint8_t>(op),
                           [this, decode, apply](FrameReader& args, Responder reply) {
                             const Request request = decode(args);
                             const auto now = SteadyClock::now();
                             JobView view;
                             {
                               std::lock_guard<std::mutex> lock(mutex_);
                               const std::string node_id = (this->*apply)(request, now);
                               view = reply_locked(node_id, now);
                             }
                             changed_.notify_all();
                             reply.send(Status::kOk, encode_job_view(view));
                           });
}

// The elastic ops (coordinator/elastic_wire.hpp), one named handler each.
ElasticService::ElasticService(StoreServer& server, ElasticServiceOptions options)
    : server_(server), options_(options), state_(options.state) {
  serve(Op::kElasticJoin, decode_join, &ElasticService::on_join);
  serve(Op::kElasticHeartbeat, decode_heartbeat, &ElasticService::on_heartbeat);
  serve(Op::kElasticReportFailure, decode_report_failure, &ElasticService::on_report_failure);
  serve(Op::kElasticReportSuccess, decode_report_success, &ElasticService::on_report_success);
  serve(Op::kElasticState, decode_state, &ElasticService::on_state);

  // Checkpoint commit (coordinator/commit_registry.hpp, ops 37-38).
  register_commit_ops(server);
}

// Steps a and c of elastic_state.hpp.
std::string ElasticService::on_join(const JoinRequest& request, SteadyClock::time_point now) {
  const NodeInfo& node = request.node;
  auto a = state_.assignment(node.node_id);
  if (a && a->generation > request.known_generation) {
    // Its round closed while it polled: a member learning its assignment, not a rejoin.
    state_.heartbeat(node.node_id, {}, now);
  } else {
    spdlog::debug("elastic: join from {} ({}, {} local ranks)", node.node_id, node.host,
                  node.nproc);
    apply_locked(state_.join(node, now));
  }
  return node.node_id;
}

// Step d.
std::string ElasticService::on_heartbeat(const HeartbeatRequest& request,
                                         SteadyClock::time_point now) {
  std::vector<int64_t> steps = request.steps;
  if (request.generation != state_.generation()) steps.clear();
  state_.heartbeat(request.node_id, steps, now, request.stopped);
  return request.node_id;
}

// Step e.
std::string ElasticService::on_report_failure(const FailureReport& report,
                                              SteadyClock::time_point now) {
  spdlog::error("elastic: {} reports: {}", report.node_id, format_root_cause(report));
  apply_locked(state_.report_failure(report, now));
  return report.node_id;
}

// Step f.
std::string ElasticService::on_report_success(const ReportSuccessRequest& request,
                                              SteadyClock::time_point now) {
  if (request.generation == state_.generation()) {
    spdlog::info("elastic: {} finished generation {}", request.node_id, request.generation);
    apply_locked(state_.report_success(request.node_id, now));
  }
  return request.node_id;
}

// Read only: the reply alone (reply_locked ticks the state).
std::string ElasticService::on_state(const StateRequest& request, SteadyClock::time_point) {
  return request.node_id;
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
