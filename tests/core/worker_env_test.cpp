// Note [Worker environment]: WorkerEnv's to_environment() and from_environment() are inverse,
// and parsing errors name the variable.
#include "core/worker_env.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"

namespace dnallm {
namespace {

WorkerEnv everything_set() {
  WorkerEnv w;
  w.rank = 5;
  w.local_rank = 1;
  w.world_size = 8;
  w.local_world_size = 4;
  w.group_rank = 1;
  w.group_world_size = 2;
  w.master_addr = "node-0";
  w.master_port = 29400;
  w.restart_count = 2;
  w.max_restarts = 3;
  w.run_id = "job-17";
  w.omp_num_threads = "4,2";
  w.generation = 3;
  w.job_token = "0123abcd";
  w.external_coordinator = true;
  w.progress_file = "/tmp/p/local_rank_1.step";
  w.restart_reason = "rank 1 exited with code 7";
  w.stop_grace = std::chrono::milliseconds(3000);
  w.test.step_delay = std::chrono::milliseconds(50);
  w.test.kill_after_save_step = 6;
  w.test.stage_host_buffers = true;
  return w;
}

TEST(WorkerEnv, RoundTripsEveryField) {
  const WorkerEnv w = everything_set();
  EnvVars env;
  w.to_environment(env);
  EXPECT_EQ(env.at("RANK"), "5");
  EXPECT_EQ(env.at("DNALLM_GENERATION"), "3");
  EXPECT_EQ(env.at("DNALLM_EXTERNAL_COORDINATOR"), "1");
  EXPECT_EQ(env.at("DNALLM_TEST_STAGE_HOST_BUFFERS"), "1");
  const WorkerEnv back = WorkerEnv::from_environment(env);
  EXPECT_TRUE(back == w);
  EXPECT_EQ(back.generation, 3);
  EXPECT_EQ(back.stop_grace.count(), 3000);
  EXPECT_EQ(back.test.kill_after_save_step, 6);
}

TEST(WorkerEnv, DefaultsRoundTripThroughAnEmptyEnvironment) {
  EnvVars env;
  WorkerEnv{}.to_environment(env);
  EXPECT_TRUE(env.empty());
  const WorkerEnv back = WorkerEnv::from_environment(env);
  EXPECT_TRUE(back == WorkerEnv{});
  EXPECT_FALSE(back.generation.has_value());
  EXPECT_FALSE(back.external_coordinator);
  EXPECT_EQ(back.stop_grace.count(), 5000);
  EXPECT_EQ(back.test.step_delay.count(), 0);
}

TEST(WorkerEnv, KeepsInheritedHooksAndDropsAStaleRestartReason) {
  EnvVars env = {{"DNALLM_TEST_STEP_DELAY_MS", "50"},
                 {"DNALLM_STOP_GRACE_MS", "3000"},
                 {"DNALLM_RESTART_REASON", "old"},
                 {"PATH", "/bin"}};
  WorkerEnv w;
  w.rank = 0;
  w.to_environment(env);
  EXPECT_EQ(env.count("DNALLM_RESTART_REASON"), 0u);
  EXPECT_EQ(env.at("DNALLM_TEST_STEP_DELAY_MS"), "50");
  EXPECT_EQ(env.at("PATH"), "/bin");
  const WorkerEnv back = WorkerEnv::from_environment(env);
  EXPECT_EQ(back.test.step_delay.count(), 50);
  EXPECT_EQ(back.stop_grace.count(), 3000);
}

TEST(WorkerEnv, PresenceAndEmptyValues) {
  // DNALLM_EXTERNAL_COORDINATOR counts by presence; an empty number is unset; a test hook
  // switch is on only for "1".
  const WorkerEnv w = WorkerEnv::from_environment({{"DNALLM_EXTERNAL_COORDINATOR", ""},
                                                   {"DNALLM_GENERATION", ""},
                                                   {"DNALLM_STOP_GRACE_MS", ""},
                                                   {"DNALLM_TEST_STAGE_HOST_BUFFERS", "0"},
                                                   {"DNALLM_JOB_TOKEN", "t"}});
  EXPECT_TRUE(w.external_coordinator);
  EXPECT_FALSE(w.generation.has_value());
  EXPECT_EQ(w.stop_grace.count(), 5000);
  EXPECT_FALSE(w.test.stage_host_buffers);
  EXPECT_EQ(w.job_token, "t");
  EXPECT_EQ(job_token_of({{"DNALLM_JOB_TOKEN", "t"}}), "t");
  EXPECT_EQ(job_token_of({}), "");
}

TEST(WorkerEnv, ABadNumberIsAUsageErrorNamingTheVariable) {
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"RANK", "x"},
                                                        {"DNALLM_GENERATION", "2a"},
                                                        {"DNALLM_STOP_GRACE_MS", "-5"},
                                                        {"MASTER_PORT", "99999999999"}}) {
    try {
      WorkerEnv::from_environment({{name, value}});
      ADD_FAILURE() << name << "=" << value << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find(name + "='" + value + "'"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace dnallm
