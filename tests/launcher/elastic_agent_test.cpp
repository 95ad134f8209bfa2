// The elastic agent's pure parts: flag parsing, the progress-file contract and the worker
// environment of a generation.
#include <unistd.h>

#include <fstream>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "launcher/elastic_agent.hpp"

namespace dnallm::launcher {
namespace {

std::string env_of(const WorkerSpec& spec, const std::string& key) {
  for (const auto& kv : spec.env) {
    if (kv.compare(0, key.size() + 1, key + "=") == 0) return kv.substr(key.size() + 1);
  }
  return "<unset>";
}

ExitCode code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return ExitCode::kOk;
}

TEST(ElasticAgentFlags, NnodesIsACountOrARange) {
  EXPECT_EQ(parse_nnodes("3"), std::make_pair(3, 3));
  EXPECT_EQ(parse_nnodes("1:4"), std::make_pair(1, 4));
  for (const char* bad : {"", "0", "4:2", "a", "1:", ":2", "2:x", "-1"}) {
    EXPECT_EQ(code_of([&] { parse_nnodes(bad); }), ExitCode::kUsage) << bad;
  }
}

TEST(ElasticAgentFlags, EndpointIsHostColonPort) {
  EXPECT_EQ(parse_endpoint("10.77.0.1:29400", "--rdzv-endpoint"),
            std::make_pair(std::string("10.77.0.1"), 29400));
  EXPECT_EQ(parse_endpoint("[::1]:5", "--rdzv-endpoint"), std::make_pair(std::string("::1"), 5));
  for (const char* bad : {"host", ":1", "h:0", "h:70000", "h:p"}) {
    EXPECT_EQ(code_of([&] { parse_endpoint(bad, "--rdzv-endpoint"); }), ExitCode::kUsage) << bad;
  }
}

TEST(ElasticAgentProgress, ReadsTheLastCompletedStepElseMinusOne) {
  char tmpl[] = "/tmp/dnallm-progress-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string path = progress_file(dir, 1);
  EXPECT_EQ(path, dir + "/local_rank_1.step");
  EXPECT_EQ(read_progress(path).step, -1);  // missing
  EXPECT_EQ(read_progress(path).pid, 0);
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };
  write("42\n");
  EXPECT_EQ(read_progress(path).step, 42);
  EXPECT_EQ(read_progress(path).pid, 0);
  write("7");
  EXPECT_EQ(read_progress(path).step, 7);
  for (const char* bad : {"", "x", "12abc", "-3"}) {
    write(bad);
    EXPECT_EQ(read_progress(path).step, -1) << bad;
  }
  // The second line is the worker's pid, read in the same pass (also after a bad step line).
  write("42\n4242\n");
  EXPECT_EQ(read_progress(path).step, 42);
  EXPECT_EQ(read_progress(path).pid, 4242);
  write("x\n17\n");
  EXPECT_EQ(read_progress(path).step, -1);
  EXPECT_EQ(read_progress(path).pid, 17);
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

// A plan of two workers a node running /bin/true, its coordinator at `master_addr`:29400.
LaunchPlan two_workers_a_node(const std::string& master_addr) {
  LaunchPlan plan;
  plan.nproc_per_node = 2;
  plan.master_addr = master_addr;
  plan.master_port = 29400;
  plan.command = {"/bin/true"};
  return plan;
}

TEST(ElasticAgentSpecs, WorkersGetTheCoordinatorsPlacement) {
  LaunchPlan plan = two_workers_a_node("10.77.0.1");
  plan.run_id = "job7";
  plan.job_token = "tok";
  plan.max_restarts = 3;
  coordinator::NodeAssignment a;
  a.generation = 3;
  a.node_rank = 1;
  a.nnodes = 3;
  a.world_size = 5;
  a.rank_offset = 2;
  a.local_world_size = 2;
  auto specs = make_elastic_worker_specs(plan, {{"PATH", "/bin"}, {"RANK", "99"}}, a,
                                         "rank 4 on n2: killed by SIGKILL", "/tmp/p");
  ASSERT_EQ(specs.size(), 2u);
  for (int local = 0; local < 2; ++local) {
    const WorkerSpec& s = specs[static_cast<size_t>(local)];
    EXPECT_EQ(s.rank, 2 + local);
    EXPECT_EQ(s.local_rank, local);
    EXPECT_EQ(env_of(s, "RANK"), std::to_string(2 + local));
    EXPECT_EQ(env_of(s, "LOCAL_RANK"), std::to_string(local));
    EXPECT_EQ(env_of(s, "WORLD_SIZE"), "5");
    EXPECT_EQ(env_of(s, "LOCAL_WORLD_SIZE"), "2");
    EXPECT_EQ(env_of(s, "GROUP_RANK"), "1");
    EXPECT_EQ(env_of(s, "GROUP_WORLD_SIZE"), "3");
    EXPECT_EQ(env_of(s, "DNALLM_GENERATION"), "3");
    EXPECT_EQ(env_of(s, "TORCHELASTIC_RESTART_COUNT"), "2");
    EXPECT_EQ(env_of(s, "TORCHELASTIC_RUN_ID"), "job7");
    EXPECT_EQ(env_of(s, "MASTER_ADDR"), "10.77.0.1");
    EXPECT_EQ(env_of(s, "MASTER_PORT"), "29400");
    EXPECT_EQ(env_of(s, "DNALLM_EXTERNAL_COORDINATOR"), "1");
    EXPECT_EQ(env_of(s, "DNALLM_JOB_TOKEN"), "tok");
    EXPECT_EQ(env_of(s, "DNALLM_RESTART_REASON"), "rank 4 on n2: killed by SIGKILL");
    EXPECT_EQ(env_of(s, "DNALLM_PROGRESS_FILE"),
              "/tmp/p/local_rank_" + std::to_string(local) + ".step");
    int rank_entries = 0;
    for (const auto& kv : s.env) rank_entries += kv.rfind("RANK=", 0) == 0 ? 1 : 0;
    EXPECT_EQ(rank_entries, 1);
  }
}

// Note [In-process recovery]: spares follow the ranks, know their number, write no progress
// file, and every worker of the job knows that survivors wait for a spare.
TEST(ElasticAgentSpecs, SparesFollowTheRanks) {
  const LaunchPlan plan = two_workers_a_node("127.0.0.1");
  coordinator::NodeAssignment a;
  a.generation = 1;
  a.nnodes = 1;
  a.world_size = 2;
  a.local_world_size = 2;
  auto specs = make_elastic_worker_specs(plan, {{"PATH", "/bin"}}, a, "", "/tmp/p", 2);
  ASSERT_EQ(specs.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    const WorkerSpec& s = specs[static_cast<size_t>(i)];
    EXPECT_EQ(env_of(s, "DNALLM_IN_PROCESS_RECOVERY"), "1");
    EXPECT_EQ(env_of(s, "LOCAL_WORLD_SIZE"), "2");
    EXPECT_EQ(env_of(s, "WORLD_SIZE"), "2");
    if (i < 2) {
      EXPECT_EQ(s.spare_id, -1);
      EXPECT_EQ(env_of(s, "DNALLM_SPARE_ID"), "<unset>");
      EXPECT_EQ(env_of(s, "DNALLM_PROGRESS_FILE"),
                "/tmp/p/local_rank_" + std::to_string(i) + ".step");
    } else {
      EXPECT_EQ(s.spare_id, i - 2);
      EXPECT_EQ(env_of(s, "DNALLM_SPARE_ID"), std::to_string(i - 2));
      EXPECT_EQ(env_of(s, "DNALLM_PROGRESS_FILE"), "<unset>");
    }
  }
  // Without spares nothing changes.
  for (const auto& s : make_elastic_worker_specs(plan, {{"PATH", "/bin"}}, a, "", "/tmp/p")) {
    EXPECT_EQ(env_of(s, "DNALLM_IN_PROCESS_RECOVERY"), "<unset>");
    EXPECT_EQ(s.spare_id, -1);
  }
}

TEST(ElasticAgentSpecs, WhichFailuresASpareReplaces) {
  EXPECT_TRUE(replaceable_by_spare(WorkerExit{true, 9}));   // SIGKILL
  EXPECT_TRUE(replaceable_by_spare(WorkerExit{true, 11}));  // SIGSEGV
  EXPECT_TRUE(replaceable_by_spare(WorkerExit{false, 1}));  // an error of its own
  EXPECT_FALSE(replaceable_by_spare(WorkerExit{false, 0}));
  EXPECT_FALSE(replaceable_by_spare(WorkerExit{false, 2}));   // usage: would repeat
  EXPECT_FALSE(replaceable_by_spare(WorkerExit{false, 3}));   // bad data: would repeat
  EXPECT_FALSE(replaceable_by_spare(WorkerExit{false, 5}));   // corrupt checkpoint
  EXPECT_FALSE(replaceable_by_spare(WorkerExit{false, 4}));   // saw a peer fail
  EXPECT_FALSE(replaceable_by_spare(WorkerExit{false, 75}));  // preempted
}

}  // namespace
}  // namespace dnallm::launcher
