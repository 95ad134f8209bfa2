// Chaos: runs of a 2-worker job (dnallm-launch, Gloo, checkpoints every 2 steps), each sent
// one random signal (USR1, TERM, INT or KILL; to the launcher or to one worker) at a random
// moment from start to finish. Every run must end with 0, 75, 4 or the signal's code
// (128 + sig), leave no process behind, and a following run (resume = "auto") must finish
// the job with exactly the losses of an uninterrupted run, from the newest committed step.
//
// CI: 4 runs. The 30: DNALLM_CHAOS_RUNS=30 (bench/coordinator/README.md). The seed
// of run i is i: a failure names it, DNALLM_CHAOS_FIRST=i reruns from it.
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hardening_util.hpp"
#include "test_util.hpp"

namespace dnallm::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr int kSteps = 12;

std::string job(const std::string& ckpt, const std::string& metrics) {
  return fmt::format(
      "cd {} && exec env DNALLM_TEST_STEP_DELAY_MS=100 DNALLM_STOP_GRACE_MS=3000 "
      "{}dnallm-launch --nproc-per-node 2 --grace-period 8 {}",
      kSrc, kBin, tiny_settings(ckpt, metrics, kSteps, 2));
}

TEST(Chaos, EveryRunEndsDefinedLeavesNothingAndResumesExactly) {
  const int runs =
      std::getenv("DNALLM_CHAOS_RUNS") ? std::atoi(std::getenv("DNALLM_CHAOS_RUNS")) : 4;
  const int first =
      std::getenv("DNALLM_CHAOS_FIRST") ? std::atoi(std::getenv("DNALLM_CHAOS_FIRST")) : 0;
  const std::string dir = make_temp_dir("chaos");
  std::string ref_log;
  const auto t_ref = std::chrono::steady_clock::now();
  ASSERT_EQ(run_command(job(dir + "/ref_ckpt", dir + "/ref.jsonl"), &ref_log), 0) << ref_log;
  const auto ref_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - t_ref)
                          .count();
  const auto ref = read_step_losses(dir + "/ref.jsonl");
  ASSERT_EQ(ref.size(), static_cast<size_t>(kSteps));

  const int signals[] = {SIGUSR1, SIGTERM, SIGINT, SIGKILL};
  std::map<int, int> codes;
  for (int run = first; run < first + runs; ++run) {
    std::mt19937 rng(static_cast<uint32_t>(run));
    const int sig = signals[rng() % 4];
    const bool to_launcher = rng() % 2 == 0;
    const auto at = std::chrono::milliseconds(rng() % static_cast<uint64_t>(ref_ms));
    const std::string name = fmt::format("run{}", run);
    const std::string ckpt = dir + "/" + name + "_ckpt";
    const std::string what =
        fmt::format("run {} (seed {}): {} to the {} at {} ms", run, run, strsignal(sig),
                    to_launcher ? "launcher" : "worker", at.count());
    SCOPED_TRACE(what);
    std::cout << "[chaos] " << what << std::endl;
    int rc = -1;
    {
      Background launcher(job(ckpt, dir + "/" + name + ".jsonl"), dir + "/" + name + ".log");
      std::this_thread::sleep_for(at);
      pid_t target = launcher.pid();
      if (!to_launcher) {
        // The first worker up, if any yet (else the launcher: the signal must go somewhere).
        auto w = workers_of(launcher.pid());
        if (!w.empty()) target = w[rng() % w.size()];
      }
      ::kill(target, sig);
      rc = launcher.wait(90s);
      if (rc == -1) ::kill(-launcher.pid(), SIGKILL);  // the destructor reaps it
      const bool defined = rc == 0 || rc == 75 || rc == 4 || rc == 128 + sig;
      EXPECT_TRUE(defined) << "rc " << rc << "\n" << launcher.log().substr(0, 20000);
      std::cout << "[chaos]   rc " << rc << std::endl;
      codes[rc]++;
    }
    // Nothing left behind (the workers die with the launcher at the latest).
    std::vector<pid_t> left;
    for (int i = 0; i < 100; ++i) {
      left = processes_matching(ckpt);
      if (left.empty()) break;
      std::this_thread::sleep_for(50ms);
    }
    EXPECT_TRUE(left.empty()) << left.size() << " process(es) left, first pid " << left[0];

    // Resume to the end: the same losses as the uninterrupted run, for every step.
    std::string log;
    const int resumed_rc = run_command(job(ckpt, dir + "/" + name + ".jsonl"), &log);
    ASSERT_EQ(resumed_rc, 0) << log;
    const auto losses = read_step_losses(dir + "/" + name + ".jsonl");
    ASSERT_EQ(losses.size(), ref.size()) << log;
    for (const auto& [step, loss] : ref) EXPECT_EQ(losses.at(step), loss) << "step " << step;
    fs::remove_all(ckpt);
  }
  std::string summary;
  for (const auto& [code, n] : codes) summary += fmt::format(" rc {}: {}", code, n);
  std::cout << "[chaos] " << runs << " runs," << summary << std::endl;
}

}  // namespace
}  // namespace dnallm::testing
