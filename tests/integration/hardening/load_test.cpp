// Hostile load against the coordinator of a live 2-rank job (dnallm-launch --standalone
// hosts it; the workers use it as their store): idle connections, clients announcing
// 64 MiB frames without HELLO, and slow-drip HELLOs, from dnallm-coordinator-load, while a
// legitimate client connects and pings every 100 ms. The job must finish with rc 0 and the
// losses of the same job without load, the launcher (coordinator) must stay under 100 MB
// RSS with a log under 1 MB, and every legitimate probe must be served within 1 s.
//
// CI size: 200 idle, 10 large, 5 drip. The full size (1,000 / 50 / 20) is the same
// test with DNALLM_LOAD_FULL=1 (bench/coordinator/README.md); its numbers are reported there.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hardening_util.hpp"
#include "test_util.hpp"

namespace dnallm::testing {
namespace {

using namespace std::chrono_literals;

std::string standalone_job(const std::string& dir, const std::string& name, int steps) {
  return standalone_command(dir + "/ckpt_" + name, dir + "/" + name + ".jsonl", steps, 200,
                            "--grace-period 30");
}

TEST(CoordinatorLoad, ALiveJobFinishesUnchangedUnderHostileClients) {
  const bool full = std::getenv("DNALLM_LOAD_FULL") != nullptr;
  const int idle = full ? 1000 : 200, large = full ? 50 : 10, drip = full ? 20 : 5;
  const int steps = full ? 60 : 25;
  const std::string dir = make_temp_dir("coord_load");

  std::string ref_log;
  ASSERT_EQ(run_command(standalone_job(dir, "ref", steps), &ref_log), 0) << ref_log;

  Background job(standalone_job(dir, "loaded", steps), dir + "/loaded.log");
  ASSERT_TRUE(wait_for_text(dir + "/loaded.log", "hosting the coordinator on 127.0.0.1:", 60s))
      << job.log();
  std::smatch m;
  const std::string head = job.log();
  ASSERT_TRUE(
      std::regex_search(head, m, std::regex("hosting the coordinator on 127\\.0\\.0\\.1:(\\d+)")));
  const int port = std::stoi(m[1]);
  std::string load_out;
  const int load_rc =
      run_command(fmt::format("{}dnallm-coordinator-load --port {} --token {} --idle {} "
                              "--large {} --drip {} --duration 600 --watch-pid {} 2>/dev/null",
                              kBin, port, kJobToken, idle, large, drip, job.pid()),
                  &load_out);
  ASSERT_EQ(load_rc, 0) << load_out;
  ASSERT_EQ(job.wait(120s), 0) << job.log().substr(0, 20000);
  const auto report = nlohmann::json::parse(load_out.substr(load_out.rfind('{')));
  std::cout << "[load] " << report.dump() << std::endl;
  const auto log_bytes = std::filesystem::file_size(dir + "/loaded.log");
  std::cout << "[load] launcher log " << log_bytes << " bytes" << std::endl;

  EXPECT_GT(report["probes"].get<int>(), 5);
  EXPECT_EQ(report["failed_probes"].get<int>(), 0) << report.dump();
  EXPECT_LT(report["max_probe_ms"].get<double>(), 1000.0) << report.dump();
  EXPECT_GT(report["peak_rss_mb"].get<double>(), 0.0);
  EXPECT_LT(report["peak_rss_mb"].get<double>(), 100.0) << report.dump();
  EXPECT_LT(log_bytes, 1u << 20);

  const auto ref = read_step_losses(dir + "/ref.jsonl");
  const auto loaded = read_step_losses(dir + "/loaded.jsonl");
  ASSERT_EQ(ref.size(), static_cast<size_t>(steps));
  ASSERT_EQ(loaded.size(), ref.size());
  for (const auto& [step, loss] : ref) EXPECT_EQ(loaded.at(step), loss) << "step " << step;
}

}  // namespace
}  // namespace dnallm::testing
