#include "worker/train/trainer.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "checkpoint/durable_io.hpp"
#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/host_memory.hpp"
#include "core/log.hpp"
#include "worker/models/registry.hpp"
#include "worker/parallel/context_mesh.hpp"
#include "worker/train/autocast.hpp"
#include "worker/train/device_stats.hpp"
#include "worker/train/mfu.hpp"

namespace dnallm::train {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

torch::Device pick_device(cfg::Device wanted) {
  // Indexed: the current CUDA device, which dnallm-train sets once at start to the rank's
  // GPU (Note [One GPU per rank] in cluster/gpu_placement.hpp).
  auto current_cuda = [] {
    return torch::Device(torch::kCUDA,
                         c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice().index());
  };
  if (wanted == cfg::Device::kCpu) return torch::kCPU;
  const std::string name = cfg::spelling(wanted);
  // Note [Lazy CUDA]: loads the CUDA plugin first.
  const bool cuda = cuda_usable(name, fmt::format("training.device = \"{}\"", name));
  DNALLM_CHECK(cuda || wanted == cfg::Device::kAuto, ExitCode::kUsage,
               "training.device = \"cuda\" but LibTorch sees no CUDA device: use \"cpu\"");
  return cuda ? current_cuda() : torch::Device(torch::kCPU);
}

uint64_t dropout_seed(uint64_t seed, int64_t step, int64_t micro_step, int rank) {
  // splitmix64 finaliser over each coordinate in turn: distinct inputs give unrelated seeds.
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(seed);
  h = mix(h ^ static_cast<uint64_t>(step));
  h = mix(h ^ static_cast<uint64_t>(micro_step));
  h = mix(h ^ static_cast<uint64_t>(rank));
  return h;
}

int64_t total_steps(const Config& config, uint64_t samples_per_epoch, int world_size) {
  const auto& t = config.training;
  if (t.max_steps > 0) return t.max_steps;
  DNALLM_CHECK(t.num_train_epochs > 0, ExitCode::kUsage,
               "set training.max_steps > 0 or training.num_train_epochs > 0");
  DNALLM_CHECK(samples_per_epoch > 0, ExitCode::kUsage,
               "training.num_train_epochs needs a dataset of known size: set training.max_steps");
  const double global = double(t.micro_batch_size * t.grad_accum_steps * world_size);
  return std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(t.num_train_epochs * double(samples_per_epoch) / global)));
}

Trainer::Trainer(Config config, models::LanguageModel model, std::unique_ptr<BatchSource> train,
                 std::unique_ptr<BatchSource> eval, std::shared_ptr<GradientSync> sync,
                 TrainerOptions options)
    : config_(std::move(config)),
      model_(std::move(model)),
      train_(std::move(train)),
      eval_(std::move(eval)),
      sync_(sync ? std::move(sync) : std::make_shared<SingleProcessSync>()),
      options_(std::move(options)) {
  const auto& t = config_.training;
  DNALLM_CHECK(t.micro_batch_size > 0 && t.grad_accum_steps > 0, ExitCode::kUsage,
               "training.micro_batch_size and training.grad_accum_steps must be positive");
  device_ = pick_device(t.device);
  if (device_.is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(t.tf32);
    at::globalContext().setAllowTF32CuDNN(t.tf32);
  }
  autocast_bf16_ = t.precision == cfg::Precision::kBf16;
  autocast_fp16_ = t.precision == cfg::Precision::kFp16 && device_.is_cuda();
  sync_free_ = options_.sync_free.value_or(
      t.sync_free == cfg::SyncFree::kAuto ? !device_.is_cpu() : t.sync_free == cfg::SyncFree::kOn);
  optim::LossScalerOptions scaler_options;
  scaler_options.enabled = t.precision == cfg::Precision::kFp16;
  scaler_options.init_scale = options_.initial_loss_scale;
  scaler_ = optim::LossScaler(scaler_options);

  if (options_.context) use_context_mesh();
  place_parameters();
  // Note [Data x context mesh]: the global batch counts data ranks.
  total_steps_ = train::total_steps(
      config_, train_->samples_per_epoch(),
      options_.context ? options_.context->coordinates().data_world : sync_->world_size());
  schedule_ = optim::schedule_from_config(t, total_steps_);

  if (sync_->rank() == 0) open_metrics(options_.append_metrics);
  peak_tflops_ = config_.logging.peak_tflops > 0 ? config_.logging.peak_tflops
                                                 : known_peak_tflops(device_name(device_));
  reset_device_memory_peaks(device_);
  spdlog::info(
      "model {} ({} task): {} trainable parameters of {}, device {}, precision {}",
      cfg::spelling(config_.model.arch), cfg::spelling(config_.model.task),
      flat_->parameter_count(),
      [&] {
        int64_t n = 0;
        for (const auto& p : model_->parameters()) n += p.numel();
        return n;
      }(),
      device_.str(), cfg::spelling(t.precision));
}

Trainer::~Trainer() = default;

void BatchSource::reshard(int rank, int world_size) {
  fail(ExitCode::kFailure, "internal: this batch source cannot become rank {}'s of {}", rank,
       world_size);
}

void Trainer::open_metrics(bool append) {
  metrics_ = std::make_unique<MetricsWriter>(
      MetricsOptions{config_.logging.metrics_file, append, config_.logging.tensorboard_dir});
  if (!metrics_->tensorboard_path().empty())
    spdlog::info("TensorBoard events: {}", metrics_->tensorboard_path());
}

void Trainer::regroup(int64_t grad_accum_steps) {
  DNALLM_CHECK(!options_.context, ExitCode::kFailure,
               "internal: a context-parallel group cannot change size in process");
  config_.training.grad_accum_steps = grad_accum_steps;
  if (eval_) eval_->reshard(sync_->rank(), sync_->world_size());
  if (sync_->rank() == 0 && !metrics_) {
    open_metrics(/*append=*/true);
  } else if (sync_->rank() != 0) {
    metrics_.reset();
  }
}

namespace {

// Note [Data x context mesh]: every batch of `whole` cut to this rank's positions.
class ContextShardSource : public BatchSource {
 public:
  ContextShardSource(std::unique_ptr<BatchSource> whole,
                     std::shared_ptr<parallel::ContextMesh> mesh)
      : whole_(std::move(whole)), mesh_(std::move(mesh)) {}
  data::Batch next() override { return mesh_->shard(whole_->next()); }
  void rewind() override { whole_->rewind(); }
  uint64_t samples_per_epoch() const override { return whole_->samples_per_epoch(); }
  double data_wait_s() const override { return whole_->data_wait_s(); }

 private:
  std::unique_ptr<BatchSource> whole_;
  std::shared_ptr<parallel::ContextMesh> mesh_;
};

}  // namespace

void Trainer::use_context_mesh() {
  const auto& mesh = options_.context;
  DNALLM_CHECK(
      sync_->world_size() == mesh->coordinates().data_world * mesh->coordinates().context_size,
      ExitCode::kFailure, "internal: a context mesh of {} x {} ranks over a world of {}",
      mesh->coordinates().data_world, mesh->coordinates().context_size, sync_->world_size());
  model_->set_context_parallel(mesh->model_view());
  train_ = std::make_unique<ContextShardSource>(std::move(train_), mesh);
  if (eval_) eval_ = std::make_unique<ContextShardSource>(std::move(eval_), mesh);
}

void Trainer::place_parameters() {
  const auto& t = config_.training;
  // Note [Sharded placement]: a sync that shards the parameters (ZeRO-3) copies them to the
  // device unit by unit from where the model was built (the host; a fresh model's blocks as
  // the chunks its build kept: Note [Streamed build]), so the device never holds the whole model;
  // what it did not take (buffers, the root's frozen parameters) follows.
  if (!sync_->places_from_host()) model_->to(device_);
  model_->train();
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& p : model_->named_parameters()) {
    if (p.value().requires_grad()) named.emplace_back(p.key(), p.value());
  }
  flat_ = sync_->place(model_, named, device_);
  if (sync_->places_from_host()) model_->to(device_);
  DNALLM_CHECK(!flat_->entries().empty(), ExitCode::kUsage,
               "the model has no trainable parameters");
  const auto [begin, end] = sync_->shard_range(flat_->numel());
  optim::AdamWOptions adam{t.adam_beta1, t.adam_beta2, t.adam_epsilon, t.weight_decay};
  torch::Tensor mask = flat_->decay_mask().narrow(0, begin, end - begin);
  if (t.optimizer_offload) {
    // Note [Optimizer offload]: the optimizer's state follows its decay mask to the host.
    auto host = torch::TensorOptions().dtype(torch::kFloat32);
    if (!device_.is_cpu()) host = host.pinned_memory(true);
    mask = torch::empty({end - begin}, host).copy_(mask);
    host_params_ = torch::empty({end - begin}, host);
    host_grads_ = torch::empty({end - begin}, host);
    reload_host_params();
  }
  adamw_ = std::make_unique<optim::FlatAdamW>(adam, begin, end, mask);
}

void Trainer::reload_host_params() {
  if (!offloaded()) return;
  torch::NoGradGuard no_grad;
  const int64_t begin = adamw_ ? adamw_->begin() : sync_->shard_range(flat_->numel()).first;
  host_params_.copy_(flat_->params().narrow(0, begin, host_params_.numel()));
}

void Trainer::offloaded_update(const torch::Tensor& params, const torch::Tensor& grads, double lr,
                               double grad_scale) {
  // Note [Optimizer offload]: gradients down (the host must see them: a blocking copy), the
  // update on the host over the shard's master copy, the parameters up without a host wait.
  torch::NoGradGuard no_grad;
  host_grads_.copy_(grads);
  adamw_->step(host_params_, host_grads_, lr, grad_scale);
  params.copy_(host_params_, /*non_blocking=*/!device_.is_cpu());
}

double Trainer::flops_per_token(int64_t seq_len) const { return model_->flops_per_token(seq_len); }

std::string Trainer::export_dir() const {
  if (!config_.training.output_dir.empty()) return config_.training.output_dir;
  return config_.checkpoint.dir + "/final";
}

void Trainer::write_metrics(const nlohmann::ordered_json& event) {
  const std::string kind = event.value("event", "");
  if (!logged_through_.empty() && kind != "restart" && event.contains("step") &&
      event["step"].is_number_integer()) {
    const int64_t step = event["step"].get<int64_t>();
    const auto through = [&](const std::string& k) {
      const auto it = logged_through_.find(k);
      return it == logged_through_.end() ? int64_t{0} : it->second;
    };
    if (step <= through("*") || step <= through(kind)) return;  // set_logged_through()
  }
  if (metrics_) metrics_->write(event);
}

namespace {

// Every device -> host read of a step goes through here (Note [Sync-free step]).
double read_back(const torch::Tensor& t, StepResult& r) {
  ++r.host_reads;
  return t.item<double>();
}

}  // namespace

StepResult Trainer::train_step(bool read_host_values) {
  const auto t0 = Clock::now();
  const double wait0 = train_->data_wait_s();
  StepResult r;
  r.step = step_ + 1;
  std::vector<data::Batch> micro;
  const double global_count = take_micro_batches(micro, r);
  flat_->zero_grad();
  const double scale = scaler_.scale();
  const LossSum loss_sum = forward_backward(micro, global_count, scale, r);
  r.comm_exposed_s = sync_->wait_gradients();
  r.lr = optim::lr_at(schedule_, step_);
  apply_pending_reads();
  if (sync_free_) {
    sync_free_update(loss_sum.device, global_count, scale, read_host_values, r);
  } else {
    host_update(loss_sum.host, global_count, scale, r);
  }
  ++step_;
  r.data_wait_s = train_->data_wait_s() - wait0;
  r.step_s = seconds_since(t0);
  return r;
}

double Trainer::take_micro_batches(std::vector<data::Batch>& micro, StepResult& r) {
  // Note [Loss normalisation]: the whole step's batches first, then the global count.
  const int64_t accum = config_.training.grad_accum_steps;
  const auto task = model_->spec().task;
  micro.reserve(accum);
  int64_t local_count = 0;
  for (int64_t j = 0; j < accum; ++j) {
    micro.push_back(train_->next());
    local_count += label_count(micro.back(), task);
    r.tokens += real_tokens(micro.back());
    // Under context parallelism the sequences are C shards long (FLOPs a token depend on it).
    r.seq_len = std::max(r.seq_len,
                         micro.back().seq_len *
                             (options_.context ? options_.context->coordinates().context_size : 1));
    r.rows += micro.back().rows;
  }
  const double global_count = sync_->sum_scalar(double(local_count));
  DNALLM_CHECK(global_count > 0, ExitCode::kBadData,
               "step {} has no label tokens in its global batch: check data.mlm_probability and "
               "the input files",
               r.step);
  return global_count;
}

Trainer::LossSum Trainer::forward_backward(const std::vector<data::Batch>& micro,
                                           double global_count, double scale, StepResult& r) {
  const auto accum = static_cast<int64_t>(micro.size());
  LossSum sum;
  for (int64_t j = 0; j < accum; ++j) {
    auto in = to_inputs(micro[j], model_, device_);
    in.logits_for_labels_only = true;
    // The positions of this micro-batch, until its backward is done.
    if (options_.context) options_.context->select(micro[j].seq_len, device_);
    // Note [Dropout randomness]
    torch::manual_seed(
        dropout_seed(static_cast<uint64_t>(config_.training.seed), r.step, j, sync_->rank()));
    torch::Tensor loss;
    sync_->before_forward(j);
    {
      AutocastGuard autocast(autocast_bf16_, autocast_fp16_, device_);
      auto out = model_->forward(in);
      loss = out.loss_sum;
    }
    if (sync_free_) {
      auto detached = loss.detach().to(torch::kFloat32);
      sum.device = sum.device.defined() ? sum.device + detached : detached;
    } else {
      const double value = read_back(loss, r);
      if (!std::isfinite(value)) {
        fail(ExitCode::kFailure,
             "loss is {} at step {} (micro-step {}): training diverged; lower training.lr, keep "
             "training.max_grad_norm > 0, or use training.precision = \"fp32\" or \"bf16\"",
             value, r.step, j);
      }
      sum.host += value;
    }
    sync_->before_backward(j, j + 1 == accum);
    (loss * (scale / global_count)).backward();
    sync_->after_backward(j, j + 1 == accum);
  }
  return sum;
}

void Trainer::apply_pending_reads() {
  // Note [Snapshot on a side stream]: the optimizer must not overwrite what a checkpoint
  // copy still reads. The compute stream waits for those copies (no host wait).
  for (auto& wait : pending_reads_) wait();
  pending_reads_.clear();
}

void Trainer::optimizer_step(double lr, double grad_scale) {
  const int64_t begin = adamw_->begin(), n = adamw_->end() - begin;
  auto params = flat_->params().narrow(0, begin, n);
  if (offloaded()) {
    offloaded_update(params, shard_grads(), lr, grad_scale);
  } else {
    adamw_->step(params, shard_grads(), lr, grad_scale);
  }
  sync_->after_optimizer_step(*flat_);
}

void Trainer::optimizer_step(double lr, const torch::Tensor& grad_scale) {
  const int64_t begin = adamw_->begin(), n = adamw_->end() - begin;
  adamw_->step(flat_->params().narrow(0, begin, n), shard_grads(), lr, grad_scale);
  sync_->after_optimizer_step(*flat_);
}

torch::Tensor Trainer::shard_grads() const {
  return flat_->grads().narrow(0, adamw_->begin(), adamw_->end() - adamw_->begin());
}

void Trainer::host_update(double local_loss_sum, double global_count, double scale, StepResult& r) {
  r.loss = sync_->sum_scalar(local_loss_sum) / global_count;
  const double norm = std::sqrt(sync_->grad_sq_norm(shard_grads())) / scale;
  const bool found_inf = !std::isfinite(norm);
  r.grad_norm = norm;
  if (scaler_.update(found_inf)) {
    const double coef = optim::clip_coefficient(norm, config_.training.max_grad_norm);
    optimizer_step(r.lr, coef / scale);
  } else {
    r.skipped = true;
    spdlog::warn("step {}: gradient overflow (norm {}), step skipped; loss scale now {}", r.step,
                 norm, scaler_.scale());
  }
}

void Trainer::sync_free_update(const torch::Tensor& device_loss_sum, double global_count,
                               double scale, bool read_host_values, StepResult& r) {
  // Note [Sync-free step]: norm, clip coefficient and update stay on the device.
  torch::NoGradGuard no_grad;
  const auto norm = sync_->grad_sq_norm_tensor(shard_grads()).sqrt() / scale;
  const auto coef = optim::clip_coefficient(norm, config_.training.max_grad_norm);
  bool apply = true;
  if (scaler_.enabled()) {
    // fp16: the scaler's skip decision is read once per step (see the Note).
    apply = scaler_.update(!std::isfinite(read_back(norm, r)));
  }
  if (apply && offloaded()) {
    // The host update needs the coefficient on the host (one read; see the Note).
    optimizer_step(r.lr, read_back(coef, r) / scale);
  } else if (apply) {
    optimizer_step(r.lr, coef / scale);
  } else {
    r.skipped = true;
    spdlog::warn("step {}: gradient overflow, step skipped; loss scale now {}", r.step,
                 scaler_.scale());
  }
  r.host_values = read_host_values;
  if (!read_host_values) {
    r.loss = std::nan("");
    r.grad_norm = std::nan("");
    return;
  }
  r.loss = sync_->sum_scalar(read_back(device_loss_sum, r)) / global_count;
  r.grad_norm = read_back(norm, r);
  if (!std::isfinite(r.loss)) {
    fail(ExitCode::kFailure,
         "loss is {} at step {} (or a step since the last logged one): training diverged; "
         "lower training.lr, keep training.max_grad_norm > 0, or use training.precision = "
         "\"fp32\" or \"bf16\"",
         r.loss, r.step);
  }
}

// Note [Step hooks] (worker/train/trainer.hpp): in list order; the first kStop ends the run.
StepAction Trainer::run_after_step_hooks(const StepResult& r) {
  for (auto& hook : options_.after_step) {
    if (hook(*this, r) == StepAction::kStop) return StepAction::kStop;
  }
  return StepAction::kContinue;
}

bool Trainer::logs_step(int64_t step) const {
  const int64_t every = config_.training.logging_steps;
  return every > 0 && (step % every == 0 || step == total_steps_ || step == 1);
}

RunEnd Trainer::run() {
  RunTotals totals;
  totals.start = Clock::now();
  const auto& t = config_.training;
  spdlog::info("training {} steps (global batch {} sequences)", total_steps_,
               t.micro_batch_size * t.grad_accum_steps * sync_->world_size());
  while (step_ < total_steps_) {
    const int64_t next = step_ + 1;
    const bool log_now = logs_step(next);
    for (auto& hook : options_.before_step) hook(*this, next);
    // Note [Sync-free step]: the loss and norm are read back on logging steps only.
    // Note [In-process recovery]: after a peer's failure in the step, its evaluation or its
    // hooks, a re-formed group goes on from the newest step any rank completed (this one again
    // when none did); the evaluation or checkpoint save it broke off is not made again (a spare
    // that joined starts at the next step: its peers must too).
    const auto recovered = [this] { return options_.recover && options_.recover(*this); };
    StepResult r;
    try {
      r = train_step(log_now);
    } catch (...) {
      if (!recovered()) throw;
      continue;
    }
    last_step_ = r;
    const double global_tokens = account(r, totals);
    if (log_now && sync_->rank() == 0) log_step(r, global_tokens, totals);
    StepAction action = StepAction::kContinue;
    try {
      if (eval_ && t.eval_steps > 0 && (r.step % t.eval_steps == 0 || r.step == total_steps_)) {
        evaluate_at(r.step);
      }
      action = run_after_step_hooks(r);
    } catch (...) {
      if (!recovered()) throw;
      continue;
    }
    if (action == StepAction::kStop) return RunEnd::kStopped;
  }
  for (auto& hook : options_.at_end) hook(*this);
  if (config_.checkpoint.save_final) {
    const auto dir = export_dir();
    export_model(dir);  // every rank: ZeRO-3 gathers the model unit by unit
    // The hook also writes final/hf (train_main.cpp: each family's Hugging Face layout),
    // gathered unit by unit as our own files are.
    if (options_.write_tokenizer)
      options_.write_tokenizer(dir, parameter_units(), sync_->rank() == 0);
    if (sync_->rank() == 0) spdlog::info("exported the model to {}", dir);
  }
  if (sync_->rank() == 0) write_summary(totals);
  return RunEnd::kCompleted;
}

double Trainer::account(const StepResult& r, RunTotals& totals) {
  totals.train_s += r.step_s;
  const double global_tokens = double(r.tokens) * sync_->world_size();
  totals.tokens += global_tokens;
  if (r.seq_len != totals.flops_seq) {
    totals.flops_seq = r.seq_len;
    totals.flops_per_token_at_seq = flops_per_token(r.seq_len);
  }
  totals.flops += global_tokens * totals.flops_per_token_at_seq;
  if (r.host_values) totals.final_loss = r.loss;
  return global_tokens;
}

void Trainer::log_step(const StepResult& r, double global_tokens, const RunTotals& totals) {
  const double tps = global_tokens / std::max(r.step_s, 1e-9);
  const int world = sync_->world_size();
  nlohmann::ordered_json line;
  line["step"] = r.step;
  line["loss"] = r.loss;
  line["lr"] = r.lr;
  line["grad_norm"] = std::isfinite(r.grad_norm) ? r.grad_norm : -1.0;
  line["tokens_per_s"] = tps;
  if (peak_tflops_ > 0) line["mfu"] = mfu(tps, totals.flops_per_token_at_seq, peak_tflops_, world);
  line["step_s"] = r.step_s;
  line["comm_exposed_s"] = r.comm_exposed_s;
  line["data_wait_s"] = r.data_wait_s;
  // The batch shape (Note [Sequence-length warm-up] changes it between stages): rank 0's.
  line["seq_len"] = r.seq_len;
  line["rows"] = r.rows;
  if (r.skipped) line["skipped"] = true;
  if (scaler_.scale() != 1.0) line["loss_scale"] = scaler_.scale();
  write_metrics(line);
  if (!options_.console_progress) return;
  const double eta = totals.train_s / double(r.step) * double(total_steps_ - r.step);
  const std::string mfu_text =
      peak_tflops_ > 0 ? fmt::format(" MFU {:.1f}%", 100.0 * mfu(totals.flops / totals.train_s, 1.0,
                                                                 peak_tflops_, world))
                       : std::string();
  // Note [Sequence-length warm-up]: the current length while the stages change it.
  const std::string length_text = config_.data.seq_len_warmup.empty()
                                      ? std::string()
                                      : fmt::format(" seq_len {} x {} rows", r.seq_len, r.rows);
  spdlog::info("step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f}{} {:.0f} tok/s{} ETA {}", r.step,
               total_steps_, r.loss, r.lr, r.grad_norm, length_text, totals.tokens / totals.train_s,
               mfu_text, format_duration(eta));
}

void Trainer::export_model(const std::string& dir) {
  // Note [Exports unit by unit] (models/family_io.hpp): the ranks gather the model a unit at a
  // time (ZeRO-3; other syncs hold it whole: one visit), rank 0 writes.
  models::export_live_model(model_, dir, parameter_units(), sync_->rank() == 0);
}

models::ParameterUnits Trainer::parameter_units() {
  return [this](const auto& visit) { sync_->visit_parameter_units(visit); };
}

void Trainer::write_summary(const RunTotals& totals) {
  const double train_s = totals.train_s;
  nlohmann::ordered_json line;
  line["event"] = "summary";
  line["steps"] = step_;
  line["tokens"] = static_cast<int64_t>(totals.tokens);
  line["tokens_per_s"] = train_s > 0 ? totals.tokens / train_s : 0.0;
  line["wall_s"] = seconds_since(totals.start);
  line["final_loss"] = std::isfinite(totals.final_loss) ? totals.final_loss : -1.0;
  line["world_size"] = sync_->world_size();
  // Note [Data x context mesh]: world_size = data_parallel x context_parallel.
  const int context = options_.context ? options_.context->coordinates().context_size : 1;
  line["context_parallel"] = context;
  line["peak_rss_mb"] = peak_rss_mb();
  const auto gpu = device_memory_stats(device_);
  if (gpu.available) {
    line["peak_gpu_mb"] = gpu.peak_allocated_mb;
    line["peak_gpu_reserved_mb"] = gpu.peak_reserved_mb;
  }
  if (peak_tflops_ > 0 && train_s > 0) {
    line["mfu"] = mfu(totals.flops / train_s, 1.0, peak_tflops_, sync_->world_size());
  }
  line["skipped_steps"] = scaler_.skipped_steps();
  if (const auto memory = sync_->memory(); memory && memory->gathered_predicted > 0) {
    // ZeRO-3 (Note [Fully sharded]): model-state bytes at their peak, measured and predicted.
    const int64_t state = memory->allocated.total() + memory->frozen_held;
    line["model_state_peak_bytes"] = state + memory->gathered_peak;
    line["model_state_predicted_peak_bytes"] = state + memory->gathered_predicted;
  }
  write_metrics(line);
  spdlog::info("done: {} steps, {:.0f} tokens/s, final loss {:.4f}, {:.1f} s", step_,
               train_s > 0 ? totals.tokens / train_s : 0.0, totals.final_loss,
               seconds_since(totals.start));
}

}  // namespace dnallm::train
