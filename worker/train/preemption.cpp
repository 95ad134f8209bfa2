#include "worker/train/preemption.hpp"

#include <signal.h>

#include <atomic>
#include <csignal>
#include <cstdlib>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "worker/train/checkpointing.hpp"

namespace dnallm::train {
namespace {

// The first stop signal's number, else 0 (Note [Preemption], step 1). The only global: a
// signal handler needs one.
std::atomic<int> g_preempt_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_preempt_signal(int sig) {
  int expected = 0;
  g_preempt_signal.compare_exchange_strong(expected, sig);
}

}  // namespace

void install_preemption_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_preempt_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGUSR1, SIGTERM}) ::sigaction(sig, &sa, nullptr);
  // dnallm-launch starts workers with both blocked (Note [Early stop signals] in
  // launcher/spawner.hpp): one that arrived before this point is delivered now.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGUSR1);
  sigaddset(&stop, SIGTERM);
  ::pthread_sigmask(SIG_UNBLOCK, &stop, nullptr);
}

int Preemption::signal_received() { return g_preempt_signal.load(); }

Preemption::Preemption(std::chrono::milliseconds stop_grace, const std::string& checkpoint_dir)
    : watchdog_(g_preempt_signal, stop_grace, checkpoint_dir,
                [](int) { std::_Exit(static_cast<int>(ExitCode::kRequeue)); }) {
  watchdog_.start();
}

StepHook Preemption::boundary_hook() {
  return [this](Trainer&, const StepResult&) {
    watchdog_.step_boundary();
    return StepAction::kContinue;
  };
}

StepHook Preemption::stop_hook(Checkpointer& checkpointer) {
  return [this, &checkpointer](Trainer& t, const StepResult& r) {
    // Collective: every rank calls it after every step (Note [Preemption], step 2).
    const int own = g_preempt_signal.load();
    if (t.sync().sum_scalar(own != 0 ? 1.0 : 0.0) == 0.0) return StepAction::kContinue;
    const std::string why = own != 0
                                ? fmt::format("received {}", own == SIGUSR1 ? "SIGUSR1" : "SIGTERM")
                                : std::string("a peer rank was signalled");
    spdlog::warn("preemption ({}): saving step {} and stopping", why, r.step);
    if (t.config().checkpoint.save_steps <= 0) {
      spdlog::warn(
          "checkpoint.save_steps = 0: saving step {} anyway so that the requeued job can resume",
          r.step);
      checkpointer.save(t);
    }
    // Saves this step unless the save_steps hook just did, then waits for the writer and
    // rank 0's commit.
    checkpointer.finish(t);
    nlohmann::ordered_json line;
    line["event"] = "preempted";
    line["step"] = r.step;
    line["reason"] = why;
    line["exit_code"] = static_cast<int>(ExitCode::kRequeue);
    t.write_metrics(line);
    stopped_at_ = r.step;
    return StepAction::kStop;
  };
}

int Preemption::exit_code(const std::string& checkpoint_dir) const {
  if (!stopped_at_) return 0;
  spdlog::warn(
      "checkpoint of step {} committed under {}; exiting with code {} so that the job is "
      "requeued and resumes from it",
      *stopped_at_, checkpoint_dir, static_cast<int>(ExitCode::kRequeue));
  return static_cast<int>(ExitCode::kRequeue);
}

}  // namespace dnallm::train
