// The prefetching data loader: builds this rank's micro-batches on background threads.
//
// Order: next() returns micro-batches in (step, micro_step) order: step 0 micro 0 ..
// accum-1, step 1 micro 0, ... where step 0 starts at the cursor given at construction
// (SamplerState::consumed_samples). Micro-batch j is a pure function of (dataset, tokenizer,
// options, cursor, j) (Note [Global sample stream], Note [Sample seeding]), so the output is
// identical for any num_workers, including 0 (built on the caller's thread).
//
// Threads: num_workers workers owned by the loader; start() launches them (the constructor
// does), stop() asks them to finish and joins (the destructor does). Workers claim jobs in
// order and stop when prefetch_factor × num_workers built batches wait unconsumed (bounded
// memory). A worker's exception (bad data) is rethrown by next() for that micro-batch.
// next() and state() are for one consumer thread (the trainer's); next() blocks.
//
// group_by_length: the global batch of a step is sorted by sample length (stable, by stream
// position) before slicing, so each micro-batch holds similar lengths; which samples the
// global batch holds is unchanged. Each rank reads (not encodes) the whole global batch to
// sort it.
//
// Note [Sequence-length warm-up]: data.seq_len_warmup = [{steps = s1, seq_len = l1}, ...] trains
// the first s1 optimizer steps at rows of l1 tokens, the next s2 at l2, ..., and the steps after
// the last stage at objective.max_seq_length (model.max_seq_length): HyenaDNA's staged warm-up
// (hyena-dna's SeqlenWarmupReload callback, whose stages count epochs and reload the dataset at
// each length, with the batch size grown by hand so that tokens per step stay constant). Here
// the samples stay what they are: each sample of the stream (a window of the full length) is
// cut into pieces = max_seq_length / seq_len windows of seq_len tokens, so a micro-batch holds
// micro_batch_size x pieces rows and tokens per step are those of the full length. Hence which
// samples a step holds (Note [Global sample stream]), the saved cursor and the independence of
// the world size all carry over unchanged, and the stage is a function of the global optimizer
// step (LoaderOptions::first_step + steps since the start cursor): a run resumed in the middle
// of a stage, and every rank of a step, build the same shapes. The cut: piece j of a window of
// n bases is the w bases from j (n - w) / (pieces - 1), where w = the tokenizer's bases for a
// stage row's token budget: evenly spread, the first at the window's start, the last at its end
// (char tokens: side by side, fewer than `pieces` bases left out between them; overlapping
// k-mers: overlapping by k - 1 bases, so each row is full). Each piece is framed as a sample of
// its own, masked (masked LM) by its window's rng in piece order, and keeps the window's sample
// id. Evaluation is not warmed up: it always reads full-length rows.
#pragma once

#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "worker/data/batch.hpp"
#include "worker/data/dataset.hpp"
#include "worker/data/objectives.hpp"
#include "worker/data/sampler.hpp"
#include "worker/data/tokenizer.hpp"

namespace dnallm::data {

struct LoaderOptions {
  int rank = 0;
  int world_size = 1;
  int64_t micro_batch_size = 8;
  int64_t grad_accum_steps = 1;
  uint64_t seed = 42;
  bool shuffle = true;
  int num_workers = 1;      // 0: build batches synchronously in next()
  int prefetch_factor = 2;  // batches queued per worker (>= 1)
  bool group_by_length = false;
  ObjectiveOptions objective;
  // Note [Evaluation covers each sample once]: when > 0, stream positions >= max_samples are
  // dropped (a micro-batch may come out short, or empty: rows == 0). Evaluation sets it so
  // that no rank wraps around to samples already scored. 0: the infinite stream (training).
  uint64_t max_samples = 0;
  // Note [Sequence-length warm-up]: the stages (empty: none), and the global optimizer step
  // (0-based) the start cursor begins, i.e. the steps done before it (a resumed run's step).
  std::vector<SeqLenStage> seq_len_warmup;
  uint64_t first_step = 0;
};

// Note [Sequence-length warm-up]: the shape of global optimizer step `step` (0-based): rows of
// `seq_len` tokens, each window cut into `pieces` rows (1 after the warm-up).
struct StageShape {
  int64_t seq_len = 0;
  int64_t pieces = 1;
};
StageShape stage_shape(const std::vector<SeqLenStage>& stages, int64_t max_seq_length,
                       uint64_t step);

// The `pieces` windows of `bases` bases each cut from `sample` (Note [Sequence-length warm-up]);
// the label and target are kept. pieces == 1: the sample itself.
std::vector<Sample> cut_into_pieces(const Sample& sample, int64_t pieces, int64_t bases);

class DataLoader {
 public:
  // `resume` must match the dataset (size) and seed, else Error(kUsage); its cursor is where
  // step 0 begins. Starts the workers.
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Tokenizer> tokenizer,
             LoaderOptions options, const SamplerState* resume = nullptr);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next micro-batch (see Order). Blocks until it is built; the time blocked adds to
  // data_wait_s(). Rethrows a worker's Error.
  Batch next();

  // Builds micro-batch `micro_step` of step `step` (counted from the start cursor) on the
  // calling thread, without touching the queue. Thread-safe.
  Batch batch_at(uint64_t step, int64_t micro_step) const;

  // Sampler state at the start of the step whose micro-batch next() returns next: after the
  // last micro-batch of step s has been taken, it is the state to save with checkpoint s.
  SamplerState state() const;

  // Moves the cursor to `state` (e.g. to re-run evaluation from the start): stops the
  // workers, drops prefetched batches, restarts. `first_step`, when given, is the global
  // optimizer step `state`'s cursor begins (LoaderOptions::first_step: Note [Sequence-length
  // warm-up]), for a training loader moved to another step.
  void reset(const SamplerState& state, std::optional<uint64_t> first_step = std::nullopt);

  // Note [Shrink and grow]: this loader becomes rank `rank`'s of `world_size`, accumulating
  // `grad_accum_steps` micro-batches a step, from `state` (a step boundary, as reset()).
  void reshard(int rank, int world_size, int64_t grad_accum_steps, const SamplerState& state,
               std::optional<uint64_t> first_step = std::nullopt);

  // reset() to the start of the stream (cursor 0): re-runs an evaluation from its first batch.
  void rewind();

  void start();
  void stop();

  double data_wait_s() const { return data_wait_s_; }  // consumer thread only
  uint64_t global_batch_size() const { return sampler_.global_batch_size(); }
  uint64_t dataset_size() const { return dataset_->size(); }
  int64_t skipped_records() const { return dataset_->skipped_records(); }
  const Dataset& dataset() const { return *dataset_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const LoaderOptions& options() const { return options_; }

 private:
  Batch build(uint64_t job) const;
  void worker_loop();

  std::shared_ptr<const Dataset> dataset_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  LoaderOptions options_;
  DistributedSampler sampler_;
  uint64_t start_cursor_ = 0;

  struct Slot {
    Batch batch;
    std::exception_ptr error;
  };
  mutable std::mutex mutex_;
  std::condition_variable cv_;      // both directions: jobs built, jobs consumed
  bool stopping_ = false;           // guarded by mutex_
  uint64_t next_job_ = 0;           // guarded by mutex_: next job a worker claims
  uint64_t next_consume_ = 0;       // guarded by mutex_: next job next() returns
  std::map<uint64_t, Slot> ready_;  // guarded by mutex_
  std::vector<std::thread> workers_;
  double data_wait_s_ = 0.0;
};

}  // namespace dnallm::data
