// How the launcher learns that it was asked to stop (SIGINT, SIGTERM) or that the job is
// being preempted (SIGUSR1: forwarded to the workers, which checkpoint and exit 75).
#pragma once

#include <chrono>

#include <signal.h>

namespace dnallm::launcher {

// Polled by the group's monitor loop; the seam lets unit tests inject signals.
class StopSignals {
 public:
  virtual ~StopSignals() = default;
  // Blocks up to `timeout` (this is also the monitor loop's tick). Returns the number of a
  // signal (SIGINT, SIGTERM, SIGUSR1) received since the last call, or 0 if none arrived.
  virtual int wait(std::chrono::milliseconds timeout) = 0;
};

// SIGINT, SIGTERM and SIGUSR1 through a signalfd: the constructor blocks them in the calling thread
// (construct it in main() before any thread starts, so every thread inherits the mask and
// none runs a handler), the destructor restores the old mask. No global state, no
// handler: the monitor loop reads them synchronously. Also ignores SIGPIPE so a closed
// stdout does not kill the launcher while workers run.
class SignalFdStopSignals : public StopSignals {
 public:
  SignalFdStopSignals();
  ~SignalFdStopSignals() override;
  SignalFdStopSignals(const SignalFdStopSignals&) = delete;
  SignalFdStopSignals& operator=(const SignalFdStopSignals&) = delete;

  int wait(std::chrono::milliseconds timeout) override;

 private:
  int fd_ = -1;
  sigset_t old_mask_;
};

}  // namespace dnallm::launcher
