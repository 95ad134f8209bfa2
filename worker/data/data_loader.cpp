#include "worker/data/data_loader.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "core/clock.hpp"
#include "core/error.hpp"

namespace dnallm::data {
namespace {
SamplerOptions sampler_options(const LoaderOptions& o, uint64_t dataset_size) {
  SamplerOptions s;
  s.dataset_size = dataset_size;
  s.seed = o.seed;
  s.shuffle = o.shuffle;
  s.micro_batch_size = o.micro_batch_size;
  s.grad_accum_steps = o.grad_accum_steps;
  s.rank = o.rank;
  s.world_size = o.world_size;
  return s;
}
}  // namespace

StageShape stage_shape(const std::vector<SeqLenStage>& stages, int64_t max_seq_length,
                       uint64_t step) {
  uint64_t end = 0;
  for (const auto& s : stages) {
    end += static_cast<uint64_t>(s.steps);
    if (step < end) return {s.seq_len, max_seq_length / s.seq_len};
  }
  return {max_seq_length, 1};
}

std::vector<Sample> cut_into_pieces(const Sample& sample, int64_t pieces, int64_t bases) {
  if (pieces <= 1) return {sample};
  const auto n = static_cast<int64_t>(sample.bases.size());
  const int64_t w = std::min(bases, n);
  std::vector<Sample> out(static_cast<size_t>(pieces), sample);
  for (int64_t j = 0; j < pieces; ++j) {
    out[static_cast<size_t>(j)].bases = sample.bases.substr(
        static_cast<size_t>(j * (n - w) / (pieces - 1)), static_cast<size_t>(w));
  }
  return out;
}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset,
                       std::shared_ptr<const Tokenizer> tokenizer, LoaderOptions options,
                       const SamplerState* resume)
    : dataset_(std::move(dataset)),
      tokenizer_(std::move(tokenizer)),
      options_(options),
      sampler_(sampler_options(options_, dataset_->size())) {
  if (options_.num_workers < 0)
    fail(ExitCode::kUsage, "data.dataloader_num_workers = {} must be >= 0", options_.num_workers);
  if (options_.prefetch_factor < 1)
    fail(ExitCode::kUsage, "data.prefetch_factor = {} must be >= 1", options_.prefetch_factor);
  if (resume != nullptr) {
    if (resume->seed != options_.seed || resume->dataset_size != dataset_->size() ||
        resume->shuffle != options_.shuffle) {
      fail(ExitCode::kUsage,
           "the saved sampler state (seed {}, dataset size {}, shuffle {}) does not match this run "
           "(seed {}, dataset size {}, shuffle {}): the data or training.seed changed since the "
           "checkpoint",
           resume->seed, resume->dataset_size, resume->shuffle, options_.seed, dataset_->size(),
           options_.shuffle);
    }
    start_cursor_ = resume->consumed_samples;
  }
  start();
}

DataLoader::~DataLoader() { stop(); }

void DataLoader::start() {
  if (!workers_.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = false;
    next_job_ = next_consume_;
    ready_.clear();
  }
  for (int w = 0; w < options_.num_workers; ++w) workers_.emplace_back([this] { worker_loop(); });
}

void DataLoader::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void DataLoader::reset(const SamplerState& state, std::optional<uint64_t> first_step) {
  stop();
  if (state.seed != options_.seed || state.dataset_size != dataset_->size()) {
    fail(ExitCode::kUsage,
         "sampler state (seed {}, dataset size {}) does not match the loader (seed {}, size {})",
         state.seed, state.dataset_size, options_.seed, dataset_->size());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    start_cursor_ = state.consumed_samples;
    next_consume_ = 0;
    if (first_step) options_.first_step = *first_step;
  }
  start();
}

void DataLoader::reshard(int rank, int world_size, int64_t grad_accum_steps,
                         const SamplerState& state, std::optional<uint64_t> first_step) {
  stop();
  LoaderOptions o = options_;
  o.rank = rank;
  o.world_size = world_size;
  o.grad_accum_steps = grad_accum_steps;
  if (o.max_samples > 0 && world_size != options_.world_size) {
    // Note [Evaluation covers each sample once]: an evaluation scores the same rows a rank
    // (eval_batches x micro_batch_size), within the data set, at any world size.
    const auto old_world = static_cast<uint64_t>(options_.world_size);
    const uint64_t per_rank = (o.max_samples + old_world - 1) / old_world;
    o.max_samples = std::min<uint64_t>(dataset_->size(), per_rank * world_size);
  }
  sampler_ = DistributedSampler(sampler_options(o, dataset_->size()));
  options_ = o;
  reset(state, first_step);
}

void DataLoader::rewind() {
  reset(SamplerState{options_.seed, dataset_->size(), 0, options_.shuffle});
}

void DataLoader::worker_loop() {
  const uint64_t capacity = static_cast<uint64_t>(options_.prefetch_factor) * options_.num_workers;
  for (;;) {
    uint64_t job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || next_job_ < next_consume_ + capacity; });
      if (stopping_) return;
      job = next_job_++;
    }
    Slot slot;
    try {
      slot.batch = build(job);
    } catch (...) {
      slot.error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ready_.emplace(job, std::move(slot));
    }
    cv_.notify_all();
  }
}

Batch DataLoader::next() {
  if (options_.num_workers == 0) {
    uint64_t job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job = next_consume_;
    }
    auto t0 = std::chrono::steady_clock::now();
    Batch b = build(job);  // on error the cursor stays, so a retry rebuilds the same batch
    data_wait_s_ += seconds_since(t0);
    std::lock_guard<std::mutex> lock(mutex_);
    ++next_consume_;
    return b;
  }
  Slot slot;
  auto t0 = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    DNALLM_CHECK(!workers_.empty(), ExitCode::kFailure, "DataLoader::next() after stop()");
    cv_.wait(lock, [&] { return ready_.count(next_consume_) > 0; });
    auto it = ready_.find(next_consume_);
    slot = std::move(it->second);
    ready_.erase(it);
    ++next_consume_;
  }
  cv_.notify_all();
  data_wait_s_ += seconds_since(t0);
  if (slot.error) std::rethrow_exception(slot.error);
  return std::move(slot.batch);
}

SamplerState DataLoader::state() const {
  SamplerState s;
  s.seed = options_.seed;
  s.dataset_size = dataset_->size();
  s.shuffle = options_.shuffle;
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t steps_done = next_consume_ / static_cast<uint64_t>(options_.grad_accum_steps);
  s.consumed_samples = start_cursor_ + steps_done * sampler_.global_batch_size();
  return s;
}

Batch DataLoader::batch_at(uint64_t step, int64_t micro_step) const {
  return build(step * static_cast<uint64_t>(options_.grad_accum_steps) +
               static_cast<uint64_t>(micro_step));
}

Batch DataLoader::build(uint64_t job) const {
  const auto accum = static_cast<uint64_t>(options_.grad_accum_steps);
  const uint64_t step = job / accum;
  const auto micro = static_cast<int64_t>(job % accum);
  uint64_t cursor;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cursor = start_cursor_ + step * sampler_.global_batch_size();
  }
  std::vector<uint64_t> positions;
  std::vector<Sample> samples;
  const uint64_t limit = options_.max_samples;  // 0: unlimited
  if (options_.group_by_length) {
    // Read the whole global batch (up to the limit), sort by length (stable), take this
    // rank's slice.
    uint64_t g = sampler_.global_batch_size();
    if (limit > 0) g = cursor >= limit ? 0 : std::min(g, limit - cursor);
    std::vector<Sample> all(g);
    for (uint64_t k = 0; k < g; ++k) {
      SamplePosition sp = sampler_.resolve(cursor + k);
      SampleRng rng(options_.seed, sp.epoch, sp.position, 0);
      all[k] = dataset_->get(sp.index, rng);
    }
    std::vector<uint64_t> order(g);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) {
      return all[a].bases.size() < all[b].bases.size();
    });
    const uint64_t off = sampler_.slice_offset(micro);
    for (uint64_t k = 0; k < static_cast<uint64_t>(options_.micro_batch_size) && off + k < g; ++k) {
      uint64_t i = order[off + k];
      positions.push_back(cursor + i);
      samples.push_back(std::move(all[i]));
    }
  } else {
    positions = sampler_.micro_batch_positions(cursor, micro);
    if (limit > 0) {
      positions.erase(std::remove_if(positions.begin(), positions.end(),
                                     [limit](uint64_t p) { return p >= limit; }),
                      positions.end());
    }
    for (uint64_t p : positions) {
      SamplePosition sp = sampler_.resolve(p);
      SampleRng rng(options_.seed, sp.epoch, sp.position, 0);
      samples.push_back(dataset_->get(sp.index, rng));
    }
  }
  if (positions.empty()) return Batch{};  // past max_samples: nothing left to evaluate
  // Note [Sequence-length warm-up]: the stage of this global step.
  ObjectiveOptions objective = options_.objective;
  const StageShape shape =
      stage_shape(options_.seq_len_warmup, objective.max_seq_length, options_.first_step + step);
  objective.max_seq_length = shape.seq_len;
  const int64_t piece_bases = tokenizer_->bases_for_tokens(token_budget(objective));
  std::vector<EncodedSample> encoded;
  encoded.reserve(samples.size() * static_cast<size_t>(shape.pieces));
  for (size_t k = 0; k < samples.size(); ++k) {
    SamplePosition sp = sampler_.resolve(positions[k]);
    SampleRng rng(options_.seed, sp.epoch, sp.position, 1);
    if (shape.pieces == 1) {
      encoded.push_back(encode_sample(samples[k], positions[k], *tokenizer_, objective, rng));
      continue;
    }
    for (const auto& piece : cut_into_pieces(samples[k], shape.pieces, piece_bases))
      encoded.push_back(encode_sample(piece, positions[k], *tokenizer_, objective, rng));
  }
  return collate(std::move(encoded), objective);
}

}  // namespace dnallm::data
