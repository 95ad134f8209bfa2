// Shared by the hardening integration tests: a tiny 2-worker training command (the settings
// of tests/integration/resume/preemption_test.cpp: CPU fp32, Gloo, deterministic), and a
// background process whose exit is awaited with a deadline.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "tests/support/process.hpp"  // kBin, kSrc, run_command

namespace dnallm::testing {

// The --set options of a tiny BERT (global batch 12 on 2 ranks, constant LR).
std::string tiny_settings(const std::string& ckpt, const std::string& metrics, int steps,
                          int save_steps);

// The job token of the standalone jobs below.
inline const std::string kJobToken = "hardening-test-token";

// `cd` to the source tree and exec dnallm-launch --standalone (the agent hosts the
// coordinator, which the 2 workers use as their store) on the tiny model, with
// DNALLM_TEST_STEP_DELAY_MS = `step_delay_ms` and `launcher_flags`.
std::string standalone_command(const std::string& ckpt, const std::string& metrics, int steps,
                               int step_delay_ms, const std::string& launcher_flags);

// A process started through /bin/sh -c `cmd` (in its own process group), stdout+stderr to
// `log_path`. The destructor SIGKILLs the group if it still runs.
class Background {
 public:
  Background(const std::string& cmd, const std::string& log_path);
  ~Background();
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;
  pid_t pid() const { return pid_; }
  // The exit code (128 + signal when killed), or -1 if it still runs after `limit`.
  int wait(std::chrono::milliseconds limit);
  std::string log() const;

 private:
  pid_t pid_ = -1;
  int code_ = -1;
  std::string log_path_;
};

// Waits until `path` holds `needle`; false after `limit`.
bool wait_for_text(const std::string& path, const std::string& needle,
                   std::chrono::milliseconds limit);

// Pids of live processes whose command line contains `needle` (not this process).
std::vector<pid_t> processes_matching(const std::string& needle);

// Worker pids of a launcher (its children running dnallm-train).
std::vector<pid_t> workers_of(pid_t launcher);

}  // namespace dnallm::testing
