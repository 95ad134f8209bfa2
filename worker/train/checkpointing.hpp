// Training checkpoints: saving the trainer's sharded flat state every checkpoint.save_steps
// and resuming from it, at any world size and ZeRO stage (docs/checkpoint-format.md,
// "Resume").
//
// What a checkpoint holds (Note [Checkpoint layout]): three stored "tensors", each the
// GLOBAL flat fp32 buffer of N = trainable elements, shape [N]:
//   flat.params  optim.exp_avg  optim.exp_avg_sq
// Rank r stores one range of each: its optimizer range under ZeRO-1/2, else (DDP or one
// process) comm::shard_range(N, world, r), so every rank writes in parallel. The manifest's
// state is a checkpoint::TrainState (checkpoint/train_state.hpp): step, sampler, RNG, loss
// scaler, adam steps, config hash and config, tokenizer, version, world size, batch shape,
// zero stage and `layout`: the flat entries (name, offset, shape) in the saving run's order. The
// flat order may differ between runs (DDP orders by buckets), so a resume maps every range by
// parameter name.
//
// Save protocol (Checkpointer, see the commit protocol in checkpoint/manifest.hpp):
//   1. training thread, step S: waits for the previous checkpoint's finisher (at most one
//      in flight), copies its slices to host (AsyncWriter::save) -> stall_s.
//   2. finisher thread: waits for the shard to be durable; world > 1: publishes its
//      descriptor in the store under "<prefix>/<S>/<rank>".
//   3. rank 0's finisher: polls the store until every rank's descriptor arrived (up to
//      `commit_timeout`), commit_step(), apply_retention() (protecting the resumed step),
//      removes the keys.
//   With an elastic coordinator (options.commit), steps 2-3 go through its commit registry
//   instead: every rank reports its durable shard, rank 0 repeats its report until the
//   registry says the step is complete (and hands over every descriptor), commits, and
//   deletes exactly the steps the registry's retention answer names.
//   4. training thread, at the next step or finish(): rethrows a finisher error; rank 0
//      writes {"event":"checkpoint","step","bytes","stall_s","write_s"}.
//
// Note [Snapshot on a side stream]: on an accelerator step 1 reads nothing back. The side
// stream (from the device's pool, via the device-generic c10 stream/event API) waits for the
// compute stream, copies the three slices into pinned host buffers the Checkpointer owns
// (non-blocking), and records an event. The compute stream waits for that event only right
// before the next optimizer update (Trainer::before_next_update), so the copy overlaps the
// next step's forward and backward; the writer thread polls the event before it reads the
// host copy (AsyncWriter's zero-copy hand-over). The pinned buffers are reused by the next
// save (the finisher has joined by then) and freed only after the event completed.
//
// Note [Resume on the device]: restore() copies every tensor into the trainer's own buffers,
// which live on its device (parameters are views of the flat buffer, moments are the
// optimizer's), and check_on_device() then verifies that every parameter, gradient, flat
// buffer and moment is on the trainer's device: state left on the host fails loudly at
// resume instead of slowing every step.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "coordinator/commit_registry.hpp"
#include "coordinator/store.hpp"
#include "core/config.hpp"

namespace dnallm::train {

class Trainer;
struct TrainerOptions;

inline constexpr const char* kFlatParamsTensor = checkpoint::kFlatParameters;
inline constexpr const char* kExpAvgTensor = "optim.exp_avg";
inline constexpr const char* kExpAvgSqTensor = "optim.exp_avg_sq";

struct CheckpointerOptions {
  // The process group's store (descriptors reach rank 0 through it); null for one process.
  std::shared_ptr<coordinator::Store> store;
  std::string store_prefix = "ckpt";  // make it unique per restart generation
  // With an elastic coordinator: shards are reported to its commit registry, and its answer
  // alone decides which checkpoints retention deletes (coordinator/commit_registry.hpp).
  // Null: descriptors travel through `store` and rank 0 applies retention itself.
  std::shared_ptr<coordinator::CommitClient> commit;
  // The train loader's SamplerState::to_json() at a step boundary (training thread).
  std::function<nlohmann::json()> sampler_state;
  nlohmann::json tokenizer;  // Tokenizer::to_json()
  // Rank 0 waits this long for every rank's descriptor before failing the commit.
  std::chrono::milliseconds commit_timeout{std::chrono::seconds(300)};
  // The step resumed from (never deleted by retention); nullopt on a fresh start.
  std::optional<int64_t> resumed_step;
};

// Owned by the training thread; hooked into the trainer with install().
class Checkpointer {
 public:
  Checkpointer(Config config, CheckpointerOptions options);
  ~Checkpointer();  // joins the finisher and the writer; never throws
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Appends after_step() and finish() to the trainer options' after_step / at_end lists
  // (Note [Step hooks] in worker/train/trainer.hpp).
  void install(TrainerOptions& options);

  // Training thread, after every step: saves at multiples of save_steps; reports finished
  // checkpoints. Throws a failed save's Error.
  void after_step(Trainer& trainer);
  // Training thread, at the end: saves the last step if not saved yet, then blocks until
  // every checkpoint is written (and, on rank 0, committed). Throws a failed save's Error.
  void finish(Trainer& trainer);
  // Saves the trainer's current step now (steps 1 of the protocol; returns stall_s).
  double save(Trainer& trainer);

 private:
  struct Finished {
    int64_t step = 0;
    uint64_t bytes = 0;
    double stall_s = 0, write_s = 0;
  };
  void finish_save(int64_t step, double stall_s, const checkpoint::ShardDescriptor& own,
                   double write_s, nlohmann::json state, int zero_stage,
                   std::chrono::steady_clock::time_point handed_over);
  void join_finisher();
  void report(Trainer& trainer);

  // Waits (host) until the last side-stream snapshot has landed. Never throws.
  void wait_snapshot() noexcept;

  struct Snapshot;  // pinned host buffers and the copy's event (checkpointing.cpp)
  Config config_;
  CheckpointerOptions options_;
  // Declared before writer_: destroyed after it, so never freed under a running write.
  std::shared_ptr<Snapshot> snapshot_;
  checkpoint::AsyncWriter writer_;
  std::thread finisher_;  // one per checkpoint, joined before the next save
  int64_t last_saved_ = -1;
  int rank_ = 0, world_ = 1;
  std::atomic<bool> abort_{false};  // set by the destructor: stop waiting for peers
  std::mutex mu_;
  // Guarded by mu_:
  std::vector<Finished> finished_;
  std::exception_ptr error_;
};

// Picks the checkpoint to resume from (checkpoint.resume: "auto" | "none" | PATH) under
// checkpoint.dir and checks it belongs to this configuration and tokenizer. nullopt: fresh
// start (logged). Throws Error(kCheckpointCorrupt) when none usable, Error(kUsage) when
// incompatible. Collective-free; every rank calls it.
std::optional<checkpoint::CheckpointReader> open_resume(const Config& config,
                                                        const nlohmann::json& tokenizer);

// training.keep_global_batch: when the checkpoint was trained with this configuration's
// micro_batch_size and grad_accum_steps at another world size, sets grad_accum_steps so that
// micro × accum × world equals the checkpoint's global batch (when it divides; else warns).
void keep_global_batch(Config& config, const checkpoint::CheckpointReader& ckpt, int world);

// The sampler state saved with the checkpoint (for make_train_loader's resume state).
// Throws Error(kCheckpointCorrupt) when the state is unreadable or has none.
nlohmann::json saved_sampler_state(const checkpoint::CheckpointReader& ckpt);

// Restores parameters (all of them), this rank's optimizer range, adam steps, loss scaler
// and step into a freshly built trainer: maps the saved layout by name, reads the
// parameters, then the optimizer moments. Throws Error(kUsage) when the parameter layout
// (names, shapes) differs, Error(kCheckpointCorrupt) when the state is unreadable (naming the
// key) or its layout lies outside the saved buffers. Logs "resumed from <dir> at step N
// (world size A -> B)".
void restore(Trainer& trainer, const checkpoint::CheckpointReader& ckpt);

// Note [Resume on the device]: throws Error(kFailure) naming the first parameter, gradient,
// flat buffer or optimizer moment that is not on trainer.device().
void check_on_device(Trainer& trainer);

}  // namespace dnallm::train
