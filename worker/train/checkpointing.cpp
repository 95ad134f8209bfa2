#include "worker/train/checkpointing.hpp"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <map>

#include <thread>

#include <fmt/format.h>
#if __has_include(<fmt/ranges.h>)
#include <fmt/ranges.h>  // fmt::join lives here from fmt 11 on
#endif
#include <spdlog/spdlog.h>

#include "comm/communicator.hpp"
#include "core/clock.hpp"
#include "core/error.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {
namespace {

// checkpoint.compression as the writer's codec (level: checkpoint.compression_level).
checkpoint::CodecOptions codec_options(cfg::Compression compression) {
  checkpoint::CodecOptions o;
  switch (compression) {
    case cfg::Compression::kZstd:
      o.codec = checkpoint::Codec::kZstd;
      break;
    case cfg::Compression::kNone:
      o.codec = checkpoint::Codec::kNone;
      break;
  }
  return o;
}

using Clock = std::chrono::steady_clock;

std::string hash_text(uint64_t h) { return fmt::format("{:016x}", h); }

checkpoint::TensorSpec flat_spec(const char* name, int64_t numel) {
  return checkpoint::TensorSpec{name, DType::kFloat32, {numel}};
}

// A host fp32 tensor holding `t` (no copy when `t` already is one and contiguous).
torch::Tensor host_f32(const torch::Tensor& t) {
  return t.to(torch::kCPU, torch::kFloat32).contiguous();
}

// The range of the flat buffers this rank stores (Note [Checkpoint layout] in the header):
// its optimizer range under ZeRO, else an even split so that every rank writes.
std::pair<int64_t, int64_t> stored_range(const optim::FlatAdamW& adam, int64_t numel, int world,
                                         int rank) {
  if (adam.begin() != 0 || adam.end() != numel) return {adam.begin(), adam.end()};
  const auto r = comm::shard_range(static_cast<size_t>(numel), world, rank);
  return {int64_t(r.offset), int64_t(r.offset + r.count)};
}

// What a checkpoint of the trainer's current step records besides the tensors (Note
// [Checkpoint layout] in the header).
checkpoint::TrainState make_train_state(Trainer& trainer, const Config& config,
                                        const CheckpointerOptions& options, int world) {
  checkpoint::TrainState s;
  s.step = trainer.step();
  s.adam_steps = trainer.optimizer().steps();
  const auto& scaler = trainer.loss_scaler();
  s.loss_scaler = {scaler.raw_scale(), scaler.clean_steps(), scaler.skipped_steps()};
  if (options.sampler_state) s.sampler = options.sampler_state();
  // Note [Dropout randomness]: the generators' state at a step boundary is a function of
  // (seed, step, rank); the scheme and the seed are the RNG state.
  s.rng = checkpoint::RngState{kRngScheme, static_cast<uint64_t>(config.training.seed)};
  s.config_hash = hash_text(model_config_hash(config));
  s.tokenizer = options.tokenizer;
  s.version = DNALLM_VERSION;
  // The data-parallel degree that shaped the global batch (Note [Data x context mesh]): what
  // keep_global_batch() compares, whatever the context-parallel degree was.
  s.world_size = world / static_cast<int>(config.parallel.context_parallel);
  s.micro_batch_size = config.training.micro_batch_size;
  // The trainer's: a group that shrank accumulates more (Note [Shrink and grow]).
  s.grad_accum_steps = trainer.config().training.grad_accum_steps;
  s.zero_stage = world > 1 ? static_cast<int>(config.parallel.zero_stage) : 0;
  for (const auto& e : trainer.flat().entries()) s.layout.push_back({e.name, e.offset, e.shape});
  // What dnallm-ckpt export writes as config.json: the same file as the trainer's export.
  s.config = trainer.model()->export_config();
  return s;
}

}  // namespace

// Note [Snapshot on a side stream] (header).
struct Checkpointer::Snapshot {
  torch::Tensor host;                  // [3, count] fp32, pinned: params, exp_avg, exp_avg_sq
  std::optional<c10::Stream> stream;   // the side stream (from the device's pool)
  std::unique_ptr<c10::Event> copied;  // recorded on `stream` after the copies

  // Host wait for the copies (any thread). c10::Event has no synchronize() in every LibTorch
  // version: poll; the copy of ~1 GB takes tens of milliseconds.
  void wait() const {
    if (!copied) return;
    while (!copied->query()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
};

Checkpointer::Checkpointer(Config config, CheckpointerOptions options)
    : config_(std::move(config)), options_(std::move(options)) {
  if (config_.checkpoint.async) writer_.start();
}

Checkpointer::~Checkpointer() {
  abort_ = true;  // a commit waiting for peers on the writer thread gives up
  writer_.stop();
  wait_snapshot();
}

void Checkpointer::wait_snapshot() noexcept {
  try {
    if (snapshot_) snapshot_->wait();
  } catch (...) {
  }
}

void Checkpointer::install(TrainerOptions& options) {
  options.after_step.push_back([this](Trainer& trainer, const StepResult&) {
    after_step(trainer);
    return StepAction::kContinue;
  });
  options.at_end.push_back([this](Trainer& trainer) { finish(trainer); });
}

void Checkpointer::after_step(Trainer& trainer) {
  report(trainer);
  const int64_t every = config_.checkpoint.save_steps;
  const int64_t step = trainer.step();
  if (every <= 0 || step % every != 0) return;
  save(trainer);
}

void Checkpointer::finish(Trainer& trainer) {
  const bool saved = last_saved_ == trainer.step() || options_.resumed_step == trainer.step();
  if (config_.checkpoint.save_steps > 0 && trainer.step() > 0 && !saved) {
    save(trainer);
  }
  wait_writer();
  report(trainer);
}

void Checkpointer::abandon_in_flight() {
  if (!config_.checkpoint.async) return;  // the training thread itself wrote and committed
  abort_ = true;
  try {
    writer_.wait();
  } catch (const std::exception& e) {
    spdlog::warn("the checkpoint save in flight was dropped: {}", e.what());
  }
  abort_ = false;
}

void Checkpointer::wait_writer() {
  if (config_.checkpoint.async) writer_.wait();  // rethrows a failed save's error
}

void Checkpointer::report(Trainer& trainer) {
  // A failed save (write or commit, on the writer thread) surfaces at the next step.
  if (config_.checkpoint.async) writer_.wait_for(std::chrono::milliseconds(0));
  std::vector<Committed> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done.swap(committed_);
  }
  for (const auto& c : done) {
    // write_s: from the hand-over to the commit (the slowest rank's write plus the commit);
    // without a writer thread the training thread did the write itself (in stall_s).
    const double write_s = std::chrono::duration<double>(c.at - in_flight_.handed_over).count() +
                           (config_.checkpoint.async ? 0.0 : in_flight_.stall_s);
    spdlog::info(
        "checkpoint step {} committed: {:.1f} MB in {} shard(s), stall {:.3f} s, write {:.3f} s",
        c.step, double(c.bytes) / 1e6, world_, in_flight_.stall_s, write_s);
    nlohmann::ordered_json line;
    line["event"] = "checkpoint";
    line["step"] = c.step;
    line["bytes"] = c.bytes;
    line["stall_s"] = in_flight_.stall_s;
    line["write_s"] = write_s;
    trainer.write_metrics(line);
  }
}

double Checkpointer::save(Trainer& trainer) {
  const auto t0 = Clock::now();
  wait_writer();  // Note [One checkpoint in flight] (checkpoint/async_writer.hpp)
  report(trainer);
  rank_ = trainer.sync().rank();
  world_ = trainer.sync().world_size();
  auto& flat = trainer.flat();
  auto& adam = trainer.optimizer();
  if (flat.sharded()) return save_pieces(trainer, t0);
  const int64_t n = flat.numel();
  const auto [begin, end] = stored_range(adam, n, world_, rank_);

  // Host copies of the slices (on CPU these are views: AsyncWriter::save copies them; on a
  // device, Note [Snapshot on a side stream]).
  torch::NoGradGuard no_grad;
  const int64_t count = end - begin;
  torch::Tensor params, exp_avg, exp_avg_sq;
  std::vector<checkpoint::TensorSlice> slices;
  const auto device = trainer.device();
  const bool side_stream = count > 0 && !device.is_cpu();
  if (side_stream) {
    if (!snapshot_) snapshot_ = std::make_shared<Snapshot>();
    auto& snap = *snapshot_;
    snap.wait();  // the previous save's copy (long done: its write has finished)
    if (!snap.host.defined() || snap.host.size(1) != count) {
      snap.host = torch::empty({3, count},
                               torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(true));
    }
    c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream compute = impl.getStream(device);
    if (!snap.stream) snap.stream = impl.getStreamFromGlobalPool(device);
    c10::Event computed(device.type());
    computed.record(compute);
    computed.block(*snap.stream);  // the copies see this step's update
    {
      c10::StreamGuard on_side(*snap.stream);
      snap.host[0].copy_(flat.params().narrow(0, begin, count), /*non_blocking=*/true);
      snap.host[1].copy_(adam.exp_avg().narrow(0, begin - adam.begin(), count), true);
      snap.host[2].copy_(adam.exp_avg_sq().narrow(0, begin - adam.begin(), count), true);
    }
    snap.copied = std::make_unique<c10::Event>(device.type());
    snap.copied->record(*snap.stream);
    // The next optimizer update must not overwrite what the copies still read.
    trainer.before_next_update([snap = snapshot_, device] {
      c10::impl::VirtualGuardImpl guard(device.type());
      snap->copied->block(guard.getStream(device));
    });
    params = snap.host[0];
    exp_avg = snap.host[1];
    exp_avg_sq = snap.host[2];
  } else if (count > 0) {
    params = host_f32(flat.params().narrow(0, begin, count));
    exp_avg = host_f32(adam.exp_avg().narrow(0, begin - adam.begin(), count));
    exp_avg_sq = host_f32(adam.exp_avg_sq().narrow(0, begin - adam.begin(), count));
  }
  if (count > 0) {
    const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
    slices.push_back({flat_spec(kFlatParamsTensor, n), u(begin), u(end), params.data_ptr()});
    slices.push_back({flat_spec(kExpAvgTensor, n), u(begin), u(end), exp_avg.data_ptr()});
    slices.push_back({flat_spec(kExpAvgSqTensor, n), u(begin), u(end), exp_avg_sq.data_ptr()});
  }

  const int64_t step = trainer.step();
  const auto train_state = make_train_state(trainer, config_, options_, world_);
  const int zero_stage = train_state.zero_stage;
  nlohmann::json state = train_state.to_json();

  const double stall_s = hand_over(t0, step, std::move(slices), side_stream,
                                   shard_commit(step, zero_stage, std::move(state)));
  if (!config_.checkpoint.async) report(trainer);  // committed on this thread
  return stall_s;
}

double Checkpointer::save_pieces(Trainer& trainer, Clock::time_point t0) {
  // Note [Pieces of a tensor]: a fully sharded rank stores its piece of every unit (host
  // copies; on CPU views the writer copies).
  torch::NoGradGuard no_grad;
  auto& flat = trainer.flat();
  auto& adam = trainer.optimizer();
  const int64_t n = flat.global_numel();
  const auto params = host_f32(flat.params());
  const auto exp_avg = host_f32(adam.exp_avg());
  const auto exp_avg_sq = host_f32(adam.exp_avg_sq());
  std::vector<checkpoint::TensorSlice> slices;
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  for (const char* name : {kFlatParamsTensor, kExpAvgTensor, kExpAvgSqTensor}) {
    const auto& source = name == kFlatParamsTensor ? params
                         : name == kExpAvgTensor   ? exp_avg
                                                   : exp_avg_sq;
    for (const auto& p : flat.pieces()) {
      slices.push_back({flat_spec(name, n), u(p.global_begin), u(p.global_end),
                        source.data_ptr<float>() + p.local_begin});
    }
  }
  const int64_t step = trainer.step();
  const auto train_state = make_train_state(trainer, config_, options_, world_);
  const int zero_stage = train_state.zero_stage;
  const double stall_s = hand_over(t0, step, std::move(slices), /*side_stream=*/false,
                                   shard_commit(step, zero_stage, train_state.to_json()));
  if (!config_.checkpoint.async) report(trainer);
  return stall_s;
}

checkpoint::ShardCommit Checkpointer::shard_commit(int64_t step, int zero_stage,
                                                   nlohmann::json state) const {
  checkpoint::ShardCommit c;
  c.root = config_.checkpoint.dir;
  c.rank = rank_;
  c.info = checkpoint::CommitInfo{step, world_, zero_stage, std::move(state)};
  c.retention = checkpoint::RetentionPolicy{static_cast<int>(config_.checkpoint.keep_last),
                                            config_.checkpoint.keep_every};
  c.protected_step = options_.resumed_step;
  c.timeout = options_.commit_timeout;
  c.abort = &abort_;
  return c;
}

// The committer of this run (checkpoint/commit.hpp): the one the options name, else the
// in-process registry, which only a single process can use.
checkpoint::CommitChannel& Checkpointer::channel(int64_t step) {
  if (!options_.commit) {
    DNALLM_CHECK(world_ == 1, ExitCode::kFailure,
                 "checkpoint of step {}: {} ranks but no store to publish shard descriptors "
                 "(the process group has no TCP store; set MASTER_ADDR and MASTER_PORT so that "
                 "rank 0 hosts one, or set checkpoint.save_steps = 0)",
                 step, world_);
    options_.commit = std::make_shared<checkpoint::LocalCommitChannel>();
  }
  return *options_.commit;
}

// Step 2 of the save protocol (header): the writer thread (or this one when checkpoint.async
// is off) writes the shard, then commits it.
double Checkpointer::hand_over(Clock::time_point t0, int64_t step,
                               std::vector<checkpoint::TensorSlice> slices, bool side_stream,
                               checkpoint::ShardCommit commit) {
  checkpoint::SaveRequest request;
  request.root = config_.checkpoint.dir;
  request.step = step;
  request.rank = rank_;
  request.slices = std::move(slices);
  request.codec = codec_options(config_.checkpoint.compression);
  if (request.codec.codec == checkpoint::Codec::kZstd) {
    request.codec.level = static_cast<int>(config_.checkpoint.compression_level);
  }
  request.codec.chunk_bytes =
      std::max<size_t>(4096, static_cast<size_t>(config_.checkpoint.chunk_mb * 1048576.0));
  if (side_stream) {
    request.borrowed = snapshot_;  // zero-copy: the writer reads the pinned buffers
    auto snap = snapshot_;
    request.ready = [snap] { snap->wait(); };
  }
  checkpoint::CommitChannel& committer = channel(step);
  last_saved_ = step;
  if (!config_.checkpoint.async) {
    if (side_stream) snapshot_->wait();
    const auto shard = checkpoint::write_shard(
        std::filesystem::path(request.root) / checkpoint::step_dir_name(step), rank_,
        request.slices, request.codec);
    in_flight_ = InFlight{seconds_since(t0), Clock::now()};
    commit_saved(committer, shard, commit);
    return in_flight_.stall_s;
  }
  request.on_durable = [this, &committer,
                        commit = std::move(commit)](const checkpoint::ShardDescriptor& own) {
    commit_saved(committer, own, commit);
  };
  writer_.save(request);
  in_flight_ = InFlight{seconds_since(t0), Clock::now()};
  return in_flight_.stall_s;
}

// Steps 2-3 of the save protocol: the one commit path (checkpoint::commit_shard).
void Checkpointer::commit_saved(checkpoint::CommitChannel& committer,
                                const checkpoint::ShardDescriptor& own,
                                const checkpoint::ShardCommit& commit) {
  const auto outcome = checkpoint::commit_shard(committer, own, commit);
  if (!outcome.committed) return;  // not rank 0, or aborted
  std::lock_guard<std::mutex> lock(mu_);
  committed_.push_back({commit.info.step, outcome.bytes, Clock::now()});
}

void keep_global_batch(Config& config, const checkpoint::CheckpointReader& ckpt, int world) {
  auto& t = config.training;
  if (!t.keep_global_batch) return;
  const auto state = checkpoint::read_train_state(ckpt);
  if (!state.micro_batch_size || !state.grad_accum_steps) return;
  const int64_t saved_world = state.world_size;
  const int64_t saved_micro = *state.micro_batch_size;
  const int64_t saved_accum = *state.grad_accum_steps;
  // Only a changed world: a configuration that changed the batch on purpose is left alone.
  if (saved_world == world || saved_micro != t.micro_batch_size ||
      saved_accum != t.grad_accum_steps) {
    return;
  }
  const int64_t global = saved_micro * saved_accum * saved_world;
  const int64_t per_accum = t.micro_batch_size * world;
  if (global % per_accum == 0) {
    spdlog::info(
        "keeping the global batch of {}: grad_accum_steps {} -> {} at world size {} "
        "(checkpoint {} was trained at world size {})",
        global, t.grad_accum_steps, global / per_accum, world, ckpt.dir().string(), saved_world);
    t.grad_accum_steps = global / per_accum;
  } else {
    const std::string what =
        global % world == 0
            ? fmt::format("set training.micro_batch_size to a divisor of {} to keep it",
                          global / world)
            : fmt::format("no micro_batch_size keeps it at world size {}", world);
    spdlog::warn(
        "checkpoint {} was trained with a global batch of {} at world size {}; at world "
        "size {} the global batch becomes {}: {}",
        ckpt.dir().string(), global, saved_world, world,
        t.micro_batch_size * t.grad_accum_steps * world, what);
  }
}

std::optional<checkpoint::CheckpointReader> open_resume(const Config& config,
                                                        const nlohmann::json& tokenizer) {
  const auto& c = config.checkpoint;
  if (c.resume.kind == cfg::Resume::Kind::kNone) {
    spdlog::info("checkpoint.resume = \"none\": starting fresh");
    return std::nullopt;
  }
  auto ckpt = checkpoint::find_resume(c.dir, c.resume);
  if (!ckpt) {
    spdlog::info("no committed checkpoint under {}: starting fresh", c.dir);
    return std::nullopt;
  }
  checkpoint::Expectation expected;
  expected.config_hash = hash_text(model_config_hash(config));
  expected.tokenizer = tokenizer;
  checkpoint::check_compatible(*ckpt, expected);
  return ckpt;
}

nlohmann::json saved_sampler_state(const checkpoint::CheckpointReader& ckpt) {
  auto sampler = checkpoint::read_train_state(ckpt).sampler;
  DNALLM_CHECK(sampler.has_value(), ExitCode::kCheckpointCorrupt,
               "checkpoint {} has no sampler state: it was not written by dnallm-train",
               ckpt.dir().string());
  return std::move(*sampler);
}

namespace {

// Where each parameter of this run lies in the checkpoint's flat buffers, by name.
using SavedOffsets = std::map<std::string, int64_t>;

// Restore, part 1: maps the saved layout onto this run's flat entries. Throws Error(kUsage)
// when the names or shapes differ, Error(kCheckpointCorrupt) when a saved entry lies outside
// the saved buffers (of `numel` elements, checked by check_compatible).
SavedOffsets map_layout(const optim::FlatParameters& flat,
                        const std::vector<checkpoint::LayoutEntry>& layout, int64_t numel,
                        const std::string& dir) {
  std::map<std::string, const checkpoint::LayoutEntry*> saved;
  for (const auto& e : layout) saved[e.name] = &e;
  DNALLM_CHECK(saved.size() == flat.entries().size(), ExitCode::kUsage,
               "checkpoint {} holds {} parameters, the model has {}: resume with the same model "
               "configuration or set checkpoint.resume = \"none\"",
               dir, saved.size(), flat.entries().size());
  SavedOffsets offsets;
  for (const auto& e : flat.entries()) {
    auto it = saved.find(e.name);
    DNALLM_CHECK(it != saved.end() && it->second->shape == e.shape, ExitCode::kUsage,
                 "checkpoint {} has no parameter {} of shape [{}]: resume with the same model "
                 "configuration or set checkpoint.resume = \"none\"",
                 dir, e.name, fmt::join(e.shape, ", "));
    const int64_t offset = it->second->offset;
    DNALLM_CHECK(offset >= 0 && offset + e.numel <= numel, ExitCode::kCheckpointCorrupt,
                 "checkpoint {}: state.layout places {} at [{}, {}), outside the {} saved "
                 "elements; the checkpoint is damaged: use another checkpoint",
                 dir, e.name, offset, offset + e.numel, numel);
    offsets[e.name] = offset;
  }
  return offsets;
}

// A piece of the optimizer range: `len` elements from `src` in the saved buffers to `dst`
// (relative to the range's begin) in this run's.
struct Run {
  int64_t dst = 0, src = 0, len = 0;
};

// The pieces of [begin, end) in this run's layout, mapped by name; pieces contiguous in both
// layouts are merged (one piece when the layouts agree).
std::vector<Run> moment_runs(const optim::FlatParameters& flat, const SavedOffsets& saved,
                             int64_t begin, int64_t end) {
  std::vector<const optim::FlatParameters::Entry*> entries;
  for (const auto& e : flat.entries()) entries.push_back(&e);
  std::sort(entries.begin(), entries.end(),
            [](const auto* a, const auto* b) { return a->offset < b->offset; });
  std::vector<Run> runs;
  for (const auto* e : entries) {
    const int64_t lo = std::max(begin, e->offset), hi = std::min(end, e->offset + e->numel);
    if (lo >= hi) continue;
    const Run piece{lo - begin, saved.at(e->name) + (lo - e->offset), hi - lo};
    if (!runs.empty() && runs.back().dst + runs.back().len == piece.dst &&
        runs.back().src + runs.back().len == piece.src) {
      runs.back().len += piece.len;
    } else {
      runs.push_back(piece);
    }
  }
  return runs;
}

// `pieces` of saved `tensor`, mapped by name, into `into` (host; the pieces' local offsets).
void read_pieces(const optim::FlatParameters& flat,
                 const std::vector<optim::FlatParameters::Piece>& pieces,
                 const checkpoint::CheckpointReader& ckpt, const SavedOffsets& saved,
                 const char* tensor, torch::Tensor& into) {
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  for (const auto& p : pieces) {
    for (const auto& r : moment_runs(flat, saved, p.global_begin, p.global_end)) {
      ckpt.read_range(tensor, u(r.src), u(r.src + r.len),
                      into.data_ptr<float>() + p.local_begin + r.dst);
    }
  }
}

// Restore, part 2: every rank needs all parameters. Reads the saved flat buffer once, then
// places each parameter at its offset in this run's layout.
void read_parameters(Trainer& trainer, const checkpoint::CheckpointReader& ckpt,
                     const SavedOffsets& saved) {
  auto& flat = trainer.flat();
  if (flat.sharded()) {  // this rank's pieces only, then the sync spreads what it gathers
    auto host = torch::zeros({flat.numel()}, torch::kFloat32);
    read_pieces(flat, flat.pieces(), ckpt, saved, kFlatParamsTensor, host);
    flat.params().copy_(host);
    trainer.reload_host_params();
    trainer.sync().after_optimizer_step(flat);
    return;
  }
  // The saved buffer may be longer than ours: ZeRO-3's layout keeps gaps between parameters.
  const uint64_t saved_n = ckpt.manifest().find(kFlatParamsTensor)->numel();
  std::vector<float> buffer(static_cast<size_t>(saved_n));
  ckpt.read_range(kFlatParamsTensor, 0, saved_n, buffer.data());
  auto host = torch::zeros({flat.numel()}, torch::kFloat32);  // gaps between entries stay 0
  float* dst = host.data_ptr<float>();
  for (const auto& e : flat.entries()) {
    std::copy_n(buffer.data() + saved.at(e.name), e.numel, dst + e.offset);
  }
  flat.params().copy_(host);
  trainer.reload_host_params();  // Note [Optimizer offload]: the host master copy too
}

// Restore, part 3: the optimizer moments of this rank's range only: its pieces when sharded
// (ZeRO-3), else the one range [begin, end) of the flat buffer.
void read_optimizer(Trainer& trainer, const checkpoint::CheckpointReader& ckpt,
                    const SavedOffsets& saved) {
  auto& adam = trainer.optimizer();
  const auto& flat = trainer.flat();
  const std::vector<optim::FlatParameters::Piece> pieces =
      flat.sharded() ? flat.pieces()
                     : std::vector<optim::FlatParameters::Piece>{{adam.begin(), adam.end(), 0}};
  auto avg = torch::zeros({adam.end() - adam.begin()}, torch::kFloat32);
  auto avg_sq = torch::zeros_like(avg);
  read_pieces(flat, pieces, ckpt, saved, kExpAvgTensor, avg);
  read_pieces(flat, pieces, ckpt, saved, kExpAvgSqTensor, avg_sq);
  adam.exp_avg().copy_(avg);
  adam.exp_avg_sq().copy_(avg_sq);
}

// Note [Dropout randomness]: a checkpoint drawn by another scheme cannot resume exactly; one
// with another seed can, with different masks from here on (warned).
void check_rng(const Trainer& trainer, const checkpoint::TrainState& state,
               const std::string& dir) {
  if (!state.rng) return;
  DNALLM_CHECK(state.rng->scheme == kRngScheme, ExitCode::kCheckpointCorrupt,
               "checkpoint {} draws dropout masks by \"{}\", this dnallm-train by \"{}\": "
               "resume it with the dnallm-train version that wrote it ({})",
               dir, state.rng->scheme, kRngScheme, state.version);
  const int64_t seed = trainer.config().training.seed;
  if (state.rng->seed != static_cast<uint64_t>(seed)) {
    spdlog::warn(
        "checkpoint {} was trained with training.seed = {}, this run has {}: the "
        "dropout masks from here on differ from an uninterrupted run",
        dir, state.rng->seed, seed);
  }
}

}  // namespace

void restore(Trainer& trainer, const checkpoint::CheckpointReader& ckpt) {
  const std::string dir = ckpt.dir().string();
  const auto state = checkpoint::read_train_state(ckpt);
  // The three flat tensors of the saving run's layout, whose size may differ from this run's
  // (ZeRO-3 leaves gaps between parameters); every parameter is then mapped by name.
  const auto* saved_flat = ckpt.manifest().find(kFlatParamsTensor);
  const int64_t n =
      saved_flat ? static_cast<int64_t>(saved_flat->numel()) : trainer.flat().global_numel();
  checkpoint::Expectation expected;
  expected.layout = {flat_spec(kFlatParamsTensor, n), flat_spec(kExpAvgTensor, n),
                     flat_spec(kExpAvgSqTensor, n)};
  checkpoint::check_compatible(ckpt, expected);
  const auto saved = map_layout(trainer.flat(), state.layout, n, dir);
  check_rng(trainer, state, dir);

  torch::NoGradGuard no_grad;
  read_parameters(trainer, ckpt, saved);
  read_optimizer(trainer, ckpt, saved);
  trainer.optimizer().set_steps(state.adam_steps);
  const auto& s = state.loss_scaler;
  trainer.loss_scaler().restore(s.scale, s.clean_steps, s.skipped);
  trainer.set_step(state.step);
  check_on_device(trainer);
  spdlog::info("resumed from {} at step {} (world size {} -> {})", dir, trainer.step(),
               ckpt.manifest().world_size, trainer.sync().world_size());
}

void check_on_device(Trainer& trainer) {
  const auto device = trainer.device();
  auto check = [&](const torch::Tensor& t, const std::string& what) {
    if (!t.defined()) return;
    const auto d = t.device();
    DNALLM_CHECK(d.type() == device.type() && (!device.has_index() || d.index() == device.index()),
                 ExitCode::kFailure,
                 "after resume {} is on {} but the trainer trains on {}: every parameter, "
                 "gradient and optimizer buffer must live on the rank's device (a bug; please "
                 "report it)",
                 what, d.str(), device.str());
  };
  for (const auto& p : trainer.model()->named_parameters()) {
    check(p.value(), "parameter " + p.key());
    check(p.value().grad(), "the gradient of " + p.key());
  }
  check(trainer.flat().params(), "the flat parameter buffer");
  check(trainer.flat().grads(), "the flat gradient buffer");
  check(trainer.flat().decay_mask(), "the weight-decay mask");
  if (trainer.offloaded()) {
    // Note [Optimizer offload]: the moments belong on the host.
    for (const auto* t : {&trainer.optimizer().exp_avg(), &trainer.optimizer().exp_avg_sq()}) {
      DNALLM_CHECK(t->is_cpu(), ExitCode::kFailure,
                   "after resume an offloaded optimizer moment is on {}, not the host (a bug; "
                   "please report it)",
                   t->device().str());
    }
    return;
  }
  check(trainer.optimizer().exp_avg(), std::string(kExpAvgTensor));
  check(trainer.optimizer().exp_avg_sq(), std::string(kExpAvgSqTensor));
}

}  // namespace dnallm::train
