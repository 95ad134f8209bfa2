// StopWatchdog (Note [Stop while blocked]): real threads, a fake "exit".
#include "worker/train/stop_watchdog.hpp"

#include <gtest/gtest.h>

namespace dnallm::train {
namespace {

using namespace std::chrono_literals;

TEST(StopWatchdog, ABlockedStepLoopIsEndedAfterTheGrace) {
  std::atomic<int> flag{0};
  std::atomic<int> ended_with{0};
  StopWatchdog w(flag, 200ms, "ckpt", [&](int sig) { ended_with = sig; });
  w.start();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(ended_with.load(), 0) << "fired without a signal";
  const auto t0 = std::chrono::steady_clock::now();
  flag = SIGTERM;  // and no step boundary ever comes
  while (ended_with.load() == 0 && std::chrono::steady_clock::now() - t0 < 5s)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(ended_with.load(), SIGTERM);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 200ms);
}

TEST(StopWatchdog, AStepBoundaryAfterTheSignalStandsItDown) {
  std::atomic<int> flag{0};
  std::atomic<int> ended_with{0};
  StopWatchdog w(flag, 300ms, "ckpt", [&](int sig) { ended_with = sig; });
  w.start();
  flag = SIGUSR1;
  std::this_thread::sleep_for(100ms);
  w.step_boundary();  // the step loop saw the flag: the preemption save runs
  std::this_thread::sleep_for(600ms);
  EXPECT_EQ(ended_with.load(), 0);
  w.stop();
}

TEST(StopWatchdog, SlowStepsGetTwiceTheLongestStepNotJustTheGrace) {
  std::atomic<int> flag{0};
  std::atomic<int> ended_with{0};
  StopWatchdog w(flag, 100ms, "ckpt", [&](int sig) { ended_with = sig; });
  w.start();
  w.step_boundary();
  std::this_thread::sleep_for(400ms);  // a 400 ms step (or step + save)
  w.step_boundary();
  flag = SIGUSR1;
  std::this_thread::sleep_for(300ms);  // longer than the grace, shorter than 2 x 400 ms
  EXPECT_EQ(ended_with.load(), 0) << "a slow step was cut short";
  w.step_boundary();  // the step ended: the preemption save runs
  std::this_thread::sleep_for(1000ms);
  EXPECT_EQ(ended_with.load(), 0);
}

TEST(StopWatchdog, StopsPromptlyWithoutASignal) {
  std::atomic<int> flag{0};
  StopWatchdog w(flag, 10s, "ckpt", [](int) { FAIL() << "fired"; });
  w.start();
  const auto t0 = std::chrono::steady_clock::now();
  w.stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
}

}  // namespace
}  // namespace dnallm::train
