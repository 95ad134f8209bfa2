// Fakes for unit tests of the group and restart policy (no processes are started).
#pragma once

#include <csignal>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "launcher/spawner.hpp"
#include "launcher/stop_signals.hpp"

namespace dnallm::launcher::testing {

// How a fake worker behaves: ends on its own after `ticks` polls with `exit` (never when
// `ticks` < 0); SIGTERM/SIGINT end it unless `ignores_term`; SIGKILL always does. With
// `on_stop_signal` set, SIGTERM/SIGINT/SIGUSR1 end it with that exit (a worker that saves a
// checkpoint and exits 75); otherwise SIGUSR1 is recorded and ignored.
struct FakeBehaviour {
  int ticks = -1;
  WorkerExit exit{};
  bool ignores_term = false;
  std::optional<WorkerExit> on_stop_signal;
  std::vector<std::string> lines;
};

struct FakeRecord {
  WorkerSpec spec;
  std::vector<int> signals;  // in the order received
  std::optional<WorkerExit> exit;
};

class FakeWorker : public WorkerProcess {
 public:
  FakeWorker(FakeBehaviour b, FakeRecord* record, int pid)
      : b_(std::move(b)), record_(record), pid_(pid) {}
  int pid() const override { return pid_; }
  std::optional<WorkerExit> try_wait() override {
    if (!record_->exit && b_.ticks >= 0 && polls_++ >= b_.ticks) record_->exit = b_.exit;
    return record_->exit;
  }
  void send_signal(int sig) override {
    if (record_->exit) return;
    record_->signals.push_back(sig);
    if (sig != SIGKILL && b_.on_stop_signal) {
      record_->exit = *b_.on_stop_signal;
    } else if (sig == SIGKILL || (!b_.ignores_term && sig != SIGUSR1)) {
      record_->exit = WorkerExit{true, sig};
    }
  }
  std::vector<std::string> last_lines() override { return b_.lines; }

 private:
  FakeBehaviour b_;
  FakeRecord* record_;
  int pid_;
  int polls_ = 0;
};

// Calls `script(spec, spawn_index)` for each worker's behaviour; records every spawn.
class FakeSpawner : public Spawner {
 public:
  using Script = std::function<FakeBehaviour(const WorkerSpec&, int spawn_index)>;
  explicit FakeSpawner(Script script) : script_(std::move(script)) {}

  std::unique_ptr<WorkerProcess> spawn(const WorkerSpec& spec) override {
    int index = static_cast<int>(records_.size());
    if (fail_at_ && *fail_at_ == index) throw Error(ExitCode::kUsage, "fake spawn failure");
    records_.push_back(std::make_unique<FakeRecord>(FakeRecord{spec, {}, std::nullopt}));
    return std::make_unique<FakeWorker>(script_(spec, index), records_.back().get(), 1000 + index);
  }

  const FakeRecord& record(std::size_t i) const { return *records_.at(i); }
  std::size_t spawned() const { return records_.size(); }
  void fail_at(int index) { fail_at_ = index; }

 private:
  Script script_;
  std::vector<std::unique_ptr<FakeRecord>> records_;
  std::optional<int> fail_at_;
};

// Delivers `signal` on the `at_call`-th wait() (0-based); never sleeps.
class FakeStopSignals : public StopSignals {
 public:
  FakeStopSignals() = default;
  FakeStopSignals(int signal, int at_call) : signal_(signal), at_call_(at_call) {}
  int wait(std::chrono::milliseconds) override {
    int call = calls_++;
    return (signal_ != 0 && call == at_call_) ? signal_ : 0;
  }
  int calls() const { return calls_; }

 private:
  int signal_ = 0;
  int at_call_ = -1;
  int calls_ = 0;
};

}  // namespace dnallm::launcher::testing
