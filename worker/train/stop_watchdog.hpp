// Note [Stop while blocked]: dnallm-train reads its stop flag (set by the SIGUSR1/SIGTERM
// handler, Note [Preemption] in worker/train/preemption.hpp) at step boundaries only. A worker
// blocked outside a step (training data from a FIFO or a stalled file system, a peer that
// never arrives) would ignore the signal until the launcher's SIGKILL. StopWatchdog gives
// the step loop a grace to reach a step boundary after the flag is set: `grace`, or twice the
// longest interval between two boundaries seen so far (a step plus a save) if that is longer,
// so that a slow step is never cut short by it. If no boundary comes, it
// logs why and calls `on_timeout` (dnallm-train: exit 75 without a new checkpoint, so the
// newest committed one stays the resume point and running again loses nothing committed).
// Once a boundary acknowledged the signal (the preemption save runs), it stands down.
//
// Threads: start() spawns the watching thread; step_boundary() is called by the training
// thread (lock-free); stop() (also the destructor) joins. Torch-free, header-only.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

namespace dnallm::train {

class StopWatchdog {
 public:
  // `flag`: the signal number once a stop signal arrived, else 0 (written by a handler).
  // `on_timeout(signal)`: what ends the process (must not return to training).
  StopWatchdog(const std::atomic<int>& flag, std::chrono::milliseconds grace,
               std::string checkpoint_dir, std::function<void(int)> on_timeout)
      : flag_(flag),
        grace_(grace),
        dir_(std::move(checkpoint_dir)),
        on_timeout_(std::move(on_timeout)) {}
  ~StopWatchdog() { stop(); }
  StopWatchdog(const StopWatchdog&) = delete;
  StopWatchdog& operator=(const StopWatchdog&) = delete;

  void start() {
    thread_ = std::thread([this] { run(); });
  }
  // Called by the training thread at every step boundary.
  void step_boundary() {
    const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    const int64_t last = last_boundary_ms_.exchange(now);
    if (last > 0 && now - last > longest_interval_ms_.load())
      longest_interval_ms_.store(now - last);
    boundary_.fetch_add(1);
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    // Polled: a signal handler cannot notify a condition variable.
    while (!stopping_ && flag_.load() == 0) cv_.wait_for(lock, std::chrono::milliseconds(50));
    if (stopping_) return;
    const int sig = flag_.load();
    const auto seen = boundary_.load();
    const auto grace = std::max(grace_, std::chrono::milliseconds(2 * longest_interval_ms_.load()));
    if (cv_.wait_for(lock, grace, [&] { return stopping_ || boundary_.load() != seen; })) return;
    spdlog::warn(
        "received {} but no training step ended within {} ms (blocked reading the training "
        "data or waiting for a peer?): exiting with code 75 without a new checkpoint; the "
        "newest committed checkpoint under {} stays the resume point",
        sig == SIGUSR1   ? "SIGUSR1"
        : sig == SIGTERM ? "SIGTERM"
                         : "a stop signal",
        grace.count(), dir_);
    spdlog::default_logger()->flush();
    on_timeout_(sig);
  }

  const std::atomic<int>& flag_;
  std::chrono::milliseconds grace_;
  std::string dir_;
  std::function<void(int)> on_timeout_;
  std::atomic<uint64_t> boundary_{0};
  std::atomic<int64_t> last_boundary_ms_{0};     // steady clock, ms
  std::atomic<int64_t> longest_interval_ms_{0};  // between two boundaries
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace dnallm::train
