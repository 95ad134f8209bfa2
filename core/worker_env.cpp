#include "core/worker_env.hpp"

#include <cstdlib>
#include <limits>
#include <type_traits>

#include "core/error.hpp"
#include "core/parse_int.hpp"

namespace dnallm {
namespace {

// Every name of Note [Worker environment], here and nowhere else.
constexpr const char* kRank = "RANK";
constexpr const char* kLocalRank = "LOCAL_RANK";
constexpr const char* kWorldSize = "WORLD_SIZE";
constexpr const char* kLocalWorldSize = "LOCAL_WORLD_SIZE";
constexpr const char* kGroupRank = "GROUP_RANK";
constexpr const char* kGroupWorldSize = "GROUP_WORLD_SIZE";
constexpr const char* kMasterAddr = "MASTER_ADDR";
constexpr const char* kMasterPort = "MASTER_PORT";
constexpr const char* kRestartCount = "TORCHELASTIC_RESTART_COUNT";
constexpr const char* kMaxRestarts = "TORCHELASTIC_MAX_RESTARTS";
constexpr const char* kRunId = "TORCHELASTIC_RUN_ID";
constexpr const char* kOmpNumThreads = "OMP_NUM_THREADS";
constexpr const char* kGeneration = "DNALLM_GENERATION";
constexpr const char* kJobToken = "DNALLM_JOB_TOKEN";
constexpr const char* kExternalCoordinator = "DNALLM_EXTERNAL_COORDINATOR";
constexpr const char* kProgressFile = "DNALLM_PROGRESS_FILE";
constexpr const char* kRestartReason = "DNALLM_RESTART_REASON";
constexpr const char* kStopGraceMs = "DNALLM_STOP_GRACE_MS";
constexpr const char* kInProcessRecovery = "DNALLM_IN_PROCESS_RECOVERY";
constexpr const char* kSpareId = "DNALLM_SPARE_ID";
constexpr const char* kTestStepDelayMs = "DNALLM_TEST_STEP_DELAY_MS";
constexpr const char* kTestKillAfterSaveStep = "DNALLM_TEST_KILL_AFTER_SAVE_STEP";
constexpr const char* kTestStageHostBuffers = "DNALLM_TEST_STAGE_HOST_BUFFERS";

const std::string* find(const EnvVars& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

int64_t parse_int(const char* name, const std::string& text, int64_t lo, int64_t hi) {
  const auto v = parse_whole_int(text);
  DNALLM_CHECK(v && *v >= lo && *v <= hi, ExitCode::kUsage,
               "environment variable {}='{}' is not an integer in [{}, {}]: fix or unset it", name,
               text, lo, hi);
  return *v;
}

// An absent or empty variable leaves `out` as it is.
template <typename Int>
void read_int(const EnvVars& env, const char* name, Int& out, int64_t lo = 0) {
  const std::string* v = find(env, name);
  if (v == nullptr || v->empty()) return;
  out = static_cast<Int>(parse_int(name, *v, lo, std::numeric_limits<int32_t>::max()));
}
template <typename Int>
void read_int(const EnvVars& env, const char* name, std::optional<Int>& out, int64_t lo = 0) {
  const std::string* v = find(env, name);
  if (v == nullptr || v->empty()) return;
  out = static_cast<Int>(parse_int(name, *v, lo, std::numeric_limits<int32_t>::max()));
}
void read_text(const EnvVars& env, const char* name, std::optional<std::string>& out) {
  if (const std::string* v = find(env, name)) out = *v;
}
void read_text(const EnvVars& env, const char* name, std::string& out) {
  if (const std::string* v = find(env, name)) out = *v;
}

template <typename T>
void write(EnvVars& env, const char* name, const std::optional<T>& value) {
  if (!value) return;
  if constexpr (std::is_same_v<T, std::string>) {
    env[name] = *value;
  } else {
    env[name] = std::to_string(*value);
  }
}

}  // namespace

WorkerEnv WorkerEnv::from_environment(const EnvVars& env) {
  WorkerEnv w;
  read_int(env, kRank, w.rank);
  read_int(env, kLocalRank, w.local_rank);
  read_int(env, kWorldSize, w.world_size);
  read_int(env, kLocalWorldSize, w.local_world_size);
  read_int(env, kGroupRank, w.group_rank);
  read_int(env, kGroupWorldSize, w.group_world_size);
  read_text(env, kMasterAddr, w.master_addr);
  read_int(env, kMasterPort, w.master_port);
  read_int(env, kRestartCount, w.restart_count);
  read_int(env, kMaxRestarts, w.max_restarts, -1);  // torchrun may export -1
  read_text(env, kRunId, w.run_id);
  read_text(env, kOmpNumThreads, w.omp_num_threads);
  read_int(env, kGeneration, w.generation);
  read_text(env, kJobToken, w.job_token);
  w.external_coordinator = find(env, kExternalCoordinator) != nullptr;
  read_text(env, kProgressFile, w.progress_file);
  read_text(env, kRestartReason, w.restart_reason);
  const std::string* recovery = find(env, kInProcessRecovery);
  w.in_process_recovery = recovery != nullptr && *recovery == "1";
  read_int(env, kSpareId, w.spare_id);
  int64_t grace_ms = w.stop_grace.count();
  read_int(env, kStopGraceMs, grace_ms);
  w.stop_grace = std::chrono::milliseconds(grace_ms);
  int64_t delay_ms = 0;
  read_int(env, kTestStepDelayMs, delay_ms);
  w.test.step_delay = std::chrono::milliseconds(delay_ms);
  read_int(env, kTestKillAfterSaveStep, w.test.kill_after_save_step);
  const std::string* stage = find(env, kTestStageHostBuffers);
  w.test.stage_host_buffers = stage != nullptr && *stage == "1";
  return w;
}

void WorkerEnv::to_environment(EnvVars& env) const {
  write(env, kRank, rank);
  write(env, kLocalRank, local_rank);
  write(env, kWorldSize, world_size);
  write(env, kLocalWorldSize, local_world_size);
  write(env, kGroupRank, group_rank);
  write(env, kGroupWorldSize, group_world_size);
  write(env, kMasterAddr, master_addr);
  write(env, kMasterPort, master_port);
  write(env, kRestartCount, restart_count);
  write(env, kMaxRestarts, max_restarts);
  write(env, kRunId, run_id);
  // Note [OMP_NUM_THREADS] (launcher/launch_plan.hpp): a user's own value always wins.
  if (env.count(kOmpNumThreads) == 0) write(env, kOmpNumThreads, omp_num_threads);
  write(env, kGeneration, generation);
  if (!job_token.empty()) env[kJobToken] = job_token;
  if (external_coordinator) env[kExternalCoordinator] = "1";
  if (!progress_file.empty()) env[kProgressFile] = progress_file;
  if (!restart_reason.empty()) {
    env[kRestartReason] = restart_reason;
  } else {
    env.erase(kRestartReason);
  }
  if (in_process_recovery) env[kInProcessRecovery] = "1";
  write(env, kSpareId, spare_id);
  const WorkerEnv defaults;
  if (stop_grace != defaults.stop_grace) env[kStopGraceMs] = std::to_string(stop_grace.count());
  if (test.step_delay.count() > 0) env[kTestStepDelayMs] = std::to_string(test.step_delay.count());
  if (test.kill_after_save_step > 0) {
    env[kTestKillAfterSaveStep] = std::to_string(test.kill_after_save_step);
  }
  if (test.stage_host_buffers) env[kTestStageHostBuffers] = "1";
}

bool WorkerEnv::operator==(const WorkerEnv& o) const {
  return rank == o.rank && local_rank == o.local_rank && world_size == o.world_size &&
         local_world_size == o.local_world_size && group_rank == o.group_rank &&
         group_world_size == o.group_world_size && master_addr == o.master_addr &&
         master_port == o.master_port && restart_count == o.restart_count &&
         max_restarts == o.max_restarts && run_id == o.run_id &&
         omp_num_threads == o.omp_num_threads && generation == o.generation &&
         job_token == o.job_token && external_coordinator == o.external_coordinator &&
         progress_file == o.progress_file && restart_reason == o.restart_reason &&
         in_process_recovery == o.in_process_recovery && spare_id == o.spare_id &&
         stop_grace == o.stop_grace && test == o.test;
}

std::string job_token_of(const EnvVars& env) {
  const std::string* v = find(env, kJobToken);
  return v == nullptr ? std::string() : *v;
}

std::string job_token_of() {
  const char* v = std::getenv(kJobToken);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace dnallm
