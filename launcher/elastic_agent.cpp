#include "launcher/elastic_agent.hpp"

#include <unistd.h>

#include <csignal>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <thread>

#include <spdlog/spdlog.h>

#include "coordinator/recovery.hpp"
#include "core/error.hpp"

namespace dnallm::launcher {
namespace {

using coordinator::JobPhase;
using coordinator::JobView;
using Clock = std::chrono::steady_clock;

int parse_positive(const std::string& s, const std::string& what) {
  size_t used = 0;
  int v = 0;
  try {
    v = std::stoi(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DNALLM_CHECK(used == s.size() && !s.empty() && v >= 1, ExitCode::kUsage,
               "{}: '{}' is not a positive integer", what, s);
  return v;
}

// The job ended: 0, 4 (or the failed worker's own 2/3/5), printing the root cause on stderr (one
// block a script can grep).
int finish(const JobView& view) {
  if (view.phase == JobPhase::kSucceeded) {
    spdlog::info("job succeeded (generation {})", view.generation);
    return 0;
  }
  std::cerr << "dnallm-launch: the job failed; root cause: " << view.root_cause << std::endl;
  return view.exit_code > 0 && view.exit_code < 128 ? static_cast<int>(view.exit_code)
                                                    : static_cast<int>(ExitCode::kPeerFailed);
}

}  // namespace

std::string progress_file(const std::string& dir, int local_rank) {
  return dir + "/local_rank_" + std::to_string(local_rank) + ".step";
}

WorkerProgress read_progress(const std::string& path) {
  WorkerProgress progress;
  std::ifstream f(path);
  std::string step_line, pid_line;
  if (!f || !std::getline(f, step_line)) return progress;
  try {
    size_t used = 0;
    long long v = std::stoll(step_line, &used);
    while (used < step_line.size() && (step_line[used] == ' ' || step_line[used] == '\r')) ++used;
    if (used == step_line.size() && v >= 0) progress.step = static_cast<int64_t>(v);
  } catch (const std::exception&) {
    // an unparsable step reads as -1
  }
  // The second line is the worker's pid (dnallm-train writes it).
  if (std::getline(f, pid_line)) progress.pid = std::atoi(pid_line.c_str());
  return progress;
}

std::vector<WorkerSpec> make_elastic_worker_specs(const LaunchPlan& plan,
                                                  const cluster::EnvMap& base_env,
                                                  const coordinator::NodeAssignment& a,
                                                  const std::string& restart_reason,
                                                  const std::string& progress_dir,
                                                  int spare_workers, bool shrink) {
  LaunchPlan placed = plan;
  const int nproc = static_cast<int>(a.local_world_size);
  placed.nproc_per_node = nproc + spare_workers;
  placed.nnodes = static_cast<int>(a.nnodes);
  placed.node_rank = static_cast<int>(a.node_rank);
  // Job-wide ranks and generation; the coordinator is the launcher's (Note [Worker
  // environment] in core/worker_env.hpp).
  return make_worker_specs(placed, base_env, static_cast<int>(a.generation - 1), restart_reason,
                           [&](WorkerEnv& w) {
                             const int local = w.local_rank.value_or(0);
                             w.rank = static_cast<int>(a.rank_offset) + local;
                             w.world_size = static_cast<int>(a.world_size);
                             w.local_world_size = nproc;
                             w.generation = a.generation;
                             w.external_coordinator = true;
                             w.in_process_recovery = spare_workers > 0 || shrink;
                             if (local < nproc) {
                               w.progress_file = progress_file(progress_dir, local);
                             } else {
                               w.spare_id = local - nproc;  // its rank comes with a record
                             }
                           });
}

bool replaceable_by_spare(const WorkerExit& exit) {
  if (exit.signaled) return true;
  return exit.code != 0 && exit.code != static_cast<int>(ExitCode::kPeerFailed) &&
         exit.code != static_cast<int>(ExitCode::kRequeue) && !is_worker_diagnosis(exit.code);
}

std::pair<std::string, int> parse_endpoint(const std::string& endpoint, const std::string& flag) {
  const auto colon = endpoint.rfind(':');
  DNALLM_CHECK(colon != std::string::npos && colon > 0, ExitCode::kUsage,
               "{} '{}' must be HOST:PORT", flag, endpoint);
  std::string host = endpoint.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  int port = parse_positive(endpoint.substr(colon + 1), flag + " port");
  DNALLM_CHECK(port <= 65535, ExitCode::kUsage, "{} port {} is above 65535", flag, port);
  return {host, port};
}

std::pair<int, int> parse_nnodes(const std::string& spec) {
  const auto colon = spec.find(':');
  if (colon == std::string::npos) {
    int n = parse_positive(spec, "--nnodes");
    return {n, n};
  }
  int lo = parse_positive(spec.substr(0, colon), "--nnodes MIN");
  int hi = parse_positive(spec.substr(colon + 1), "--nnodes MAX");
  DNALLM_CHECK(lo <= hi, ExitCode::kUsage, "--nnodes {}: MIN must not exceed MAX", spec);
  return {lo, hi};
}

ElasticAgent::ElasticAgent(coordinator::ElasticClient& client, Spawner& spawner,
                           StopSignals& signals, ElasticAgentOptions options,
                           ElasticSpecFactory make_specs)
    : client_(client),
      spawner_(spawner),
      signals_(signals),
      options_(std::move(options)),
      make_specs_(std::move(make_specs)) {}

ElasticAgent::LocalProgress ElasticAgent::read_local_progress() const {
  LocalProgress out;
  for (int i = 0; i < options_.node.nproc; ++i) {
    const WorkerProgress p = read_progress(progress_file(options_.progress_dir, i));
    out.steps.push_back(p.step);
    out.stopped.push_back(process_stopped(p.pid));
    out.pids.push_back(p.pid);
  }
  return out;
}

bool process_stopped(int pid) {
  if (pid <= 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = s.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= s.size()) return false;
  const char state = s[close + 2];
  return state == 'T' || state == 't';
}

JobView ElasticAgent::wait_for_assignment(int& stop_signal) {
  while (true) {
    JobView v = client_.join(options_.node, generation_);
    if (v.terminal()) return v;
    if (v.assignment && v.assignment->generation > generation_) return v;
    stop_signal = signals_.wait(options_.poll_interval);
    if (stop_signal != 0) return v;
  }
}

bool ElasticAgent::settled(const JobView& v) const {
  return v.terminal() || v.generation_open > generation_;
}

JobView ElasticAgent::wait_for_next(bool heartbeat, int& stop_signal) {
  auto last = Clock::now() - options_.monitor_interval;
  JobView v;
  while (true) {
    if (heartbeat && Clock::now() - last >= options_.monitor_interval) {
      last = Clock::now();
      v = client_.heartbeat(options_.node.node_id, generation_, {});
    } else {
      v = client_.state(options_.node.node_id);
    }
    if (settled(v)) return v;
    stop_signal = signals_.wait(options_.poll_interval);
    if (stop_signal != 0) return v;
  }
}

void ElasticAgent::begin_generation(const coordinator::NodeAssignment& a) {
  generation_ = a.generation;
  ++generations_run_;
  stopped_beats_.assign(static_cast<size_t>(options_.node.nproc), 0);
  spdlog::info("generation {}: node rank {} of {}, ranks {}..{} of world size {}", a.generation,
               a.node_rank, a.nnodes, a.rank_offset, a.rank_offset + a.local_world_size - 1,
               a.world_size);
  for (int i = 0; i < options_.node.nproc; ++i) {
    std::remove(progress_file(options_.progress_dir, i).c_str());
  }
}

coordinator::RecoveryRecord ElasticAgent::local_record(coordinator::RecoveryKind kind, int place,
                                                       int local_rank, std::string reason,
                                                       int spare_id) const {
  coordinator::RecoveryRecord record;
  record.kind = kind;
  record.rank = place;
  record.local_rank = local_rank;
  record.host = options_.node.host;
  record.reason = std::move(reason);
  record.spare_id = spare_id;
  record.progress_file = progress_file(options_.progress_dir, local_rank);
  record.detected_unix_ms = coordinator::unix_ms_now();
  return record;
}

bool ElasticAgent::announce(const coordinator::RecoveryRecord& record, const std::string& what) {
  try {
    const int64_t n = coordinator::announce_recovery(*options_.store, generation_, record);
    spdlog::warn("{}: {} (in-process recovery {} of generation {})", record.reason, what, n,
                 generation_);
    return true;
  } catch (const std::exception& e) {
    spdlog::error("{}: cannot announce that {} ({})", record.reason, what, e.what());
    return false;
  }
}

bool ElasticAgent::hand_to_spare(const WorkerFailure& f, int spare_id) {
  return announce(local_record(coordinator::RecoveryKind::kSpare, f.rank, f.local_rank,
                               fmt::format("rank {} {}", f.rank, f.exit.describe()), spare_id),
                  fmt::format("spare {} takes its place", spare_id));
}

bool ElasticAgent::shrink(const WorkerFailure& f) {
  const auto record =
      local_record(coordinator::RecoveryKind::kShrink, f.rank, f.local_rank,
                   fmt::format("rank {} {}", f.rank, f.exit.describe()), /*spare_id=*/-1);
  if (!announce(record, "no spare is left: the others go on without it (elastic.shrink)")) {
    return false;
  }
  // Its last step would read as a hang of that local rank until a worker returns to it.
  std::error_code ignored;
  std::filesystem::remove(record.progress_file, ignored);
  return true;
}

bool ElasticAgent::grow(int place, int local_rank, int spare_id) {
  try {
    if (!options_.store->check({coordinator::spare_ready_key(generation_, spare_id)})) {
      return false;
    }
  } catch (const std::exception&) {
    return false;  // asked again at the next tick
  }
  return announce(
      local_record(coordinator::RecoveryKind::kGrow, place, local_rank,
                   fmt::format("rank {}'s place has a warm worker again", place), spare_id),
      fmt::format("spare {} returns to it at the next step boundary", spare_id));
}

GenerationResult ElasticAgent::run_generation(const JobView& view, JobView& latest) {
  GroupOptions group_options = options_.group;
  if (options_.spare_workers > 0 && options_.store) {
    group_options.hand_to_spare = [this](const WorkerFailure& f, int spare_id) {
      return replaceable_by_spare(f.exit) && hand_to_spare(f, spare_id);
    };
    group_options.replenish_spares = true;  // K spares stay warm
  }
  if (options_.shrink && options_.store) {
    group_options.shrink = [this](const WorkerFailure& f) {
      return replaceable_by_spare(f.exit) && shrink(f);
    };
    group_options.grow = [this](int place, int local_rank, int spare_id) {
      return grow(place, local_rank, spare_id);
    };
  }
  auto last_heartbeat = Clock::now();
  std::exception_ptr error;
  latest = view;
  group_options.should_stop = [&] {
    if (Clock::now() - last_heartbeat < options_.monitor_interval) return false;
    last_heartbeat = Clock::now();
    try {
      const LocalProgress progress = read_local_progress();
      if (options_.spare_workers > 0 || options_.shrink) kill_stopped(progress);
      latest =
          client_.heartbeat(options_.node.node_id, generation_, progress.steps, progress.stopped);
    } catch (...) {
      error = std::current_exception();
      return true;
    }
    return latest.terminal() || latest.generation_open > generation_;
  };
  LocalWorkerGroup group(spawner_, signals_, group_options);
  GenerationResult result = group.run(make_specs_(*view.assignment, view.round_reason));
  if (error) std::rethrow_exception(error);
  return result;
}

void ElasticAgent::kill_stopped(const LocalProgress& progress) {
  stopped_beats_.resize(progress.stopped.size(), 0);
  for (size_t i = 0; i < progress.stopped.size(); ++i) {
    stopped_beats_[i] = progress.stopped[i] ? stopped_beats_[i] + 1 : 0;
    if (stopped_beats_[i] < 2 || progress.pids[i] <= 0) continue;
    spdlog::warn(
        "local rank {} (pid {}) is stopped at step {} (SIGSTOP?): killing it so that a spare "
        "takes its place",
        i, progress.pids[i], progress.steps[i]);
    ::kill(progress.pids[i], SIGKILL);
    stopped_beats_[i] = 0;
  }
}

JobView ElasticAgent::report_failure(const GenerationResult& result) {
  for (const auto& f : result.failures) spdlog::error("{}", describe_failure(f));
  const WorkerFailure& first = result.failures.front();
  coordinator::FailureReport report;
  report.node_id = options_.node.node_id;
  report.host = options_.node.host;
  report.rank = first.rank;
  report.exit_code = first.exit.signaled ? 0 : first.exit.code;
  report.signal = first.exit.signaled ? first.exit.code : 0;
  report.reason = fmt::format("local rank {}, pid {}", first.local_rank, first.pid);
  report.last_lines = first.last_lines;
  report.generation = generation_;
  return client_.report_failure(report);
}

int ElasticAgent::run() {
  spdlog::info("joining the job at coordinator {} as {} ({} local rank(s))", client_.address(),
               options_.node.node_id, options_.node.nproc);
  while (true) {
    int sig = 0;
    JobView view = wait_for_assignment(sig);
    if (sig != 0) return 128 + sig;
    if (view.terminal()) return finish(view);
    begin_generation(*view.assignment);
    JobView latest;
    const GenerationResult result = run_generation(view, latest);
    switch (result.outcome) {
      case GenerationOutcome::kInterrupted:
        return 128 + result.stop_signal;
      case GenerationOutcome::kPreempted:  // Note [Preemption] (worker/train/preemption.hpp)
        return static_cast<int>(ExitCode::kRequeue);
      case GenerationOutcome::kStopped:
        if (latest.terminal()) return finish(latest);
        spdlog::warn("generation {} replaced by generation {}: {}", generation_,
                     latest.generation_open, latest.round_reason);
        continue;
      // The reply to a report is a view of the job like any other, and the coordinator counts
      // it as telling this node the outcome when the report ended the job (the coordinator's
      // host may then stop it at once): act on it before asking again.
      case GenerationOutcome::kWorkerFailed:
        view = report_failure(result);
        if (!settled(view)) view = wait_for_next(/*heartbeat=*/false, sig);
        break;
      case GenerationOutcome::kSucceeded:
        spdlog::info("all {} local worker(s) finished generation {}", options_.node.nproc,
                     generation_);
        view = client_.report_success(options_.node.node_id, generation_);
        if (!settled(view)) view = wait_for_next(/*heartbeat=*/true, sig);
        break;
    }
    if (sig != 0) return 128 + sig;
    if (view.terminal()) return finish(view);
    spdlog::warn("rejoining for generation {}: {}", view.generation_open, view.round_reason);
  }
}

}  // namespace dnallm::launcher
