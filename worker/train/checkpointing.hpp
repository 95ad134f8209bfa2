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
// Save protocol (Checkpointer; the commit is checkpoint/commit.hpp's, the one path of every
// run):
//   1. training thread, step S: waits for the previous save (at most one in flight), copies
//      its slices to host and hands them to the writer (AsyncWriter::save) -> stall_s.
//   2. writer thread: writes the shard durably, then commits it with commit_shard through
//      the run's CommitChannel (options.commit: the coordinator's or rank 0's store server's
//      registry; a single process: an in-process one). Every rank reports its shard; rank 0
//      repeats its report until the registry says S is complete (up to `commit_timeout`, or
//      until the destructor aborts), writes the manifest and LATEST, and deletes exactly
//      the steps the registry's retention answer names (never the resumed step).
//   With checkpoint.async off the training thread does step 2 itself.
//   3. training thread, at the next step or finish(): rethrows a failed save's error; rank 0
//      writes {"event":"checkpoint","step","bytes","stall_s","write_s"}.
//
// Note [Snapshot on a side stream]: on an accelerator step 1 reads nothing back. The side
// stream (from the device's pool, via the device-generic c10 stream/event API) waits for the
// compute stream, copies the three slices into pinned host buffers the Checkpointer owns
// (non-blocking), and records an event. The compute stream waits for that event only right
// before the next optimizer update (Trainer::before_next_update), so the copy overlaps the
// next step's forward and backward; the writer thread polls the event before it reads the
// host copy (AsyncWriter's zero-copy hand-over). The pinned buffers are reused by the next
// save (the writer has finished the previous one by then) and freed only after the event completed.
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
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "core/config.hpp"

namespace dnallm::train {

class Trainer;
struct TrainerOptions;

inline constexpr const char* kFlatParamsTensor = checkpoint::kFlatParameters;
inline constexpr const char* kExpAvgTensor = "optim.exp_avg";
inline constexpr const char* kExpAvgSqTensor = "optim.exp_avg_sq";

struct CheckpointerOptions {
  // Where shards are reported and retention is decided (checkpoint/commit.hpp); for a
  // process group coordinator::commit_channel_for(its store, generation). Null: an in-process
  // registry, which only a single process (world size 1) can use: with more ranks the first
  // save fails with Error(kFailure).
  std::shared_ptr<checkpoint::CommitChannel> commit;
  // The train loader's SamplerState::to_json() at a step boundary (training thread).
  std::function<nlohmann::json()> sampler_state;
  nlohmann::json tokenizer;  // Tokenizer::to_json()
  // Rank 0 waits this long for every rank's shard before failing the commit (kPeerFailed).
  std::chrono::milliseconds commit_timeout{std::chrono::seconds(300)};
  // The step resumed from (never deleted by retention); nullopt on a fresh start.
  std::optional<int64_t> resumed_step;
};

// Owned by the training thread; hooked into the trainer with install().
class Checkpointer {
 public:
  Checkpointer(Config config, CheckpointerOptions options);
  ~Checkpointer();  // stops the writer (a waiting commit gives up); never throws
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
  // Note [In-process recovery]: a rank died, maybe with the save in flight: rank 0's commit
  // stops waiting for its shard and the save is dropped (its step stays uncommitted; the next
  // save commits), its error is not rethrown. Training thread; blocks until the writer is idle.
  void abandon_in_flight();

 private:
  using Clock = std::chrono::steady_clock;
  struct Committed {  // rank 0: a committed step, from the thread that committed it
    int64_t step = 0;
    uint64_t bytes = 0;
    Clock::time_point at;
  };
  struct InFlight {  // the last save (training thread only)
    double stall_s = 0;
    Clock::time_point handed_over;
  };
  checkpoint::ShardCommit shard_commit(int64_t step, int zero_stage, nlohmann::json state) const;
  double save_pieces(Trainer& trainer, Clock::time_point t0);  // a sharded flat buffer (ZeRO-3)
  checkpoint::CommitChannel& channel(int64_t step);
  double hand_over(Clock::time_point t0, int64_t step, std::vector<checkpoint::TensorSlice> slices,
                   bool side_stream, checkpoint::ShardCommit commit);
  void commit_saved(checkpoint::CommitChannel& committer, const checkpoint::ShardDescriptor& own,
                    const checkpoint::ShardCommit& commit);
  void wait_writer();
  void report(Trainer& trainer);

  // Waits (host) until the last side-stream snapshot has landed. Never throws.
  void wait_snapshot() noexcept;

  struct Snapshot;  // pinned host buffers and the copy's event (checkpointing.cpp)
  Config config_;
  CheckpointerOptions options_;
  // Declared before writer_: destroyed after it, so never freed under a running write.
  std::shared_ptr<Snapshot> snapshot_;
  checkpoint::AsyncWriter writer_;  // writes and commits (Save protocol, step 2)
  InFlight in_flight_;
  int64_t last_saved_ = -1;
  int rank_ = 0, world_ = 1;
  std::atomic<bool> abort_{false};  // set by the destructor: stop waiting for peers
  std::mutex mu_;
  std::vector<Committed> committed_;  // guarded by mu_
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
