#include "launcher/stop_signals.hpp"

#include <poll.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>

#include "core/error.hpp"

namespace dnallm::launcher {

SignalFdStopSignals::SignalFdStopSignals() {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGUSR1);  // preemption notice (Note [Preemption], worker/train/preemption.hpp)
  int rc = ::pthread_sigmask(SIG_BLOCK, &mask, &old_mask_);
  if (rc != 0) fail(ExitCode::kFailure, "pthread_sigmask failed: {}", errno_string(rc));
  fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  DNALLM_SYSCHECK(fd_, "signalfd(SIGINT, SIGTERM, SIGUSR1)");
  ::signal(SIGPIPE, SIG_IGN);
}

SignalFdStopSignals::~SignalFdStopSignals() {
  ::close(fd_);
  ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
}

int SignalFdStopSignals::wait(std::chrono::milliseconds timeout) {
  pollfd p{fd_, POLLIN, 0};
  int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
  if (r <= 0) return 0;
  signalfd_siginfo info{};
  ssize_t n = ::read(fd_, &info, sizeof(info));
  if (n != static_cast<ssize_t>(sizeof(info))) return 0;
  return static_cast<int>(info.ssi_signo);
}

}  // namespace dnallm::launcher
