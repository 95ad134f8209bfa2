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

int64_t label_count(const data::Batch& b, models::Task task) {
  if (task == models::Task::kRegression) return b.rows;
  if (b.num_label_tokens > 0) return b.num_label_tokens;
  int64_t n = 0;
  for (auto l : b.labels) n += l != data::kIgnoreIndex;
  return n;
}

int64_t real_tokens(const data::Batch& b) {
  if (b.attention_mask.empty()) return b.rows * b.seq_len;
  int64_t n = 0;
  for (auto m : b.attention_mask) n += m != 0;
  return n;
}

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

models::TransformerLM build_model(const Config& config, int64_t vocab_size) {
  return models::build_transformer(config, vocab_size, build_context(config));
}

models::BuildContext build_context(const Config& config) {
  models::BuildContext c;
  c.on_cpu =
      config.training.device == cfg::Device::kCpu ||
      (config.training.device == cfg::Device::kAuto && !cuda_usable("auto", "training.device"));
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  c.local_world_size = std::max(1, local != nullptr ? std::atoi(local) : 1);
  const char* world = std::getenv("WORLD_SIZE");
  c.world_size = std::max(1, world != nullptr ? std::atoi(world) : 1);
  return c;
}

namespace {

// Note [Host-known batch facts] (worker/models/transformer/transformer.hpp): the facts the model
// would otherwise read back from the device, computed here from the host batch. Every int64 array
// of the micro-batch goes into ONE host buffer (pinned on CUDA) and one non-blocking copy.
class HostPack {
 public:
  int64_t add(const int64_t* data, size_t n) {
    const auto offset = static_cast<int64_t>(values_.size());
    values_.insert(values_.end(), data, data + n);
    return offset;
  }
  int64_t add(const std::vector<int64_t>& v) { return add(v.data(), v.size()); }
  // The buffer on `device`: one copy (non-blocking from pinned memory on CUDA).
  torch::Tensor to(const torch::Device& device) const {
    const auto n = static_cast<int64_t>(values_.size());
    auto options = torch::TensorOptions().dtype(torch::kInt64);
    if (!device.is_cpu()) options = options.pinned_memory(true);
    auto host = torch::empty({n}, options);
    std::copy(values_.begin(), values_.end(), host.data_ptr<int64_t>());
    // The caching host allocator keeps the pinned block until the copy has run.
    return device.is_cpu() ? host : host.to(device, /*non_blocking=*/true);
  }

 private:
  std::vector<int64_t> values_;
};

// Masked LM, scored positions only: per row the scored positions ascending, then the others
// ascending (the first M), and the row-major flat indices into [rows*M] of the scored ones.
// M = the largest scored count of a row (>= 1), rounded up to `multiple` (at most seq_len).
void mlm_selection(const data::Batch& b, int64_t multiple, std::vector<int64_t>& positions,
                   std::vector<int64_t>& selected, int64_t& m) {
  const int64_t t = b.seq_len;
  std::vector<int64_t> counts(static_cast<size_t>(b.rows), 0);
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t i = 0; i < t; ++i) counts[r] += b.labels[r * t + i] != data::kIgnoreIndex;
  }
  m = std::max<int64_t>(1, *std::max_element(counts.begin(), counts.end()));
  if (multiple > 1) m = std::min(t, (m + multiple - 1) / multiple * multiple);
  positions.assign(static_cast<size_t>(b.rows * m), 0);
  for (int64_t r = 0; r < b.rows; ++r) {
    int64_t k = 0;
    for (int pass = 0; pass < 2 && k < m; ++pass) {
      for (int64_t i = 0; i < t && k < m; ++i) {
        const bool scored = b.labels[r * t + i] != data::kIgnoreIndex;
        if (scored == (pass == 0)) positions[r * m + k++] = i;
      }
    }
    for (int64_t j = 0; j < counts[r]; ++j) selected.push_back(r * m + j);
  }
}

}  // namespace

models::ForwardInputs to_inputs(const data::Batch& b, const models::LanguageModel& model,
                                const torch::Device& device) {
  DNALLM_CHECK(int64_t(b.input_ids.size()) == b.rows * b.seq_len, ExitCode::kFailure,
               "batch has {} input ids for {} x {}", b.input_ids.size(), b.rows, b.seq_len);
  const auto& o = model->spec();
  const int64_t rows = b.rows, t = b.seq_len;
  HostPack pack;
  const int64_t ids_at = pack.add(b.input_ids);
  const int64_t mask_at = b.attention_mask.empty() ? -1 : pack.add(b.attention_mask);
  const int64_t seg_at = b.segment_ids.empty() ? -1 : pack.add(b.segment_ids);
  const int64_t labels_at = b.labels.empty() ? -1 : pack.add(b.labels);

  models::ForwardInputs in;
  in.padded = b.padded.has_value() ? *b.padded
                                   : std::find(b.attention_mask.begin(), b.attention_mask.end(),
                                               0) != b.attention_mask.end();
  // Host-known label facts for the loss (no nonzero()/item() on the device).
  int64_t positions_at = -1, selected_at = -1, index_at = -1, m = 0;
  std::vector<int64_t> index;
  const bool lm = o.task == models::Task::kPretrain && !b.labels.empty();
  if (lm && o.arch == models::Arch::kBert && b.segment_ids.empty()) {
    std::vector<int64_t> positions, selected;
    // Static-ish shapes on accelerators (the allocator reuses blocks); exact M on CPU.
    mlm_selection(b, device.is_cpu() ? 1 : 8, positions, selected, m);
    positions_at = pack.add(positions);
    selected_at = pack.add(selected);
    in.label_count = static_cast<int64_t>(selected.size());
    index = std::move(selected);
  } else if (lm) {
    const bool shift = o.arch == models::Arch::kGpt && o.shift_labels;
    const int64_t width = shift ? t - 1 : t;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < width; ++i) {
        if (b.labels[r * t + i + (shift ? 1 : 0)] != data::kIgnoreIndex) {
          index.push_back(r * width + i);
        }
      }
    }
    index_at = pack.add(index);
    in.label_count = static_cast<int64_t>(index.size());
  } else if (o.task == models::Task::kClassification && !b.labels.empty()) {
    in.label_count = std::count_if(b.labels.begin(), b.labels.end(),
                                   [](int64_t l) { return l != data::kIgnoreIndex; });
  }

  auto all = pack.to(device);
  auto slice = [&](int64_t at, int64_t n) { return all.narrow(0, at, n); };
  in.input_ids = slice(ids_at, rows * t).view({rows, t});
  if (mask_at >= 0) in.attention_mask = slice(mask_at, rows * t).view({rows, t});
  if (seg_at >= 0) in.segment_ids = slice(seg_at, rows * t).view({rows, t});
  if (labels_at >= 0) {
    in.labels = o.task == models::Task::kPretrain ? slice(labels_at, rows * t).view({rows, t})
                                                  : slice(labels_at, rows);
  }
  if (positions_at >= 0) {
    in.mlm_positions = slice(positions_at, rows * m).view({rows, m});
    in.mlm_selected = slice(selected_at, static_cast<int64_t>(index.size()));
  }
  if (index_at >= 0) in.label_index = slice(index_at, static_cast<int64_t>(index.size()));
  if (!b.targets.empty()) {
    in.targets = torch::from_blob(const_cast<float*>(b.targets.data()), {b.rows}, torch::kFloat32)
                     .to(device, false, true);
  }
  return in;
}

EvalResult evaluate(models::LanguageModel model, BatchSource& source, int64_t batches,
                    const torch::Device& device,
                    const std::function<int64_t(int64_t)>& bases_of_label, GradientSync* sync,
                    parallel::ContextMesh* context) {
  const bool was_training = model->is_training();
  model->eval();
  source.rewind();
  torch::NoGradGuard no_grad;
  double nll = 0.0;
  double tokens = 0, bases = 0, correct = 0, rows = 0;
  const auto task = model->spec().task;
  // Note [Classification scores]: the confusion matrix, summed over ranks cell by cell (one
  // collective a cell), for up to kMaxScoredClasses labels; more labels: accuracy alone.
  const int64_t labels = model->spec().num_labels;
  const bool scored = task == models::Task::kClassification && labels <= kMaxScoredClasses;
  ConfusionMatrix confusion(scored ? labels : 0, std::vector<double>(scored ? labels : 0, 0.0));
  // Note [Sharded evaluation]: where a forward is collective (ZeRO-3 gathers unit by unit),
  // every rank runs as many as the rank with the most batches: one that ran out repeats its
  // first batch and drops the result. A rank with none at all has nothing to repeat: then every
  // rank holds the whole model for this evaluation instead, and forwards are local.
  bool lockstep = sync != nullptr && sync->forwards_are_collective();
  std::optional<data::Batch> first, spare;
  std::optional<parallel::FullParameters> whole;
  if (lockstep && batches > 0) {
    first = source.next();
    const double without = sync->sum_scalar(first->rows == 0 ? 1.0 : 0.0);
    if (without > 0 && without < double(sync->world_size())) {
      spdlog::warn(
          "evaluation: {} rank(s) have no evaluation batch, so this evaluation holds the whole "
          "model on every rank (Note [Sharded evaluation]); a larger evaluation set avoids it",
          static_cast<int64_t>(without));
      whole.emplace(*sync);
      lockstep = false;
    }
  }
  bool exhausted = false;
  for (int64_t i = 0; i < batches; ++i) {
    data::Batch batch;
    if (first) {
      batch = std::move(*first);
      first.reset();
    } else if (!exhausted) {
      batch = source.next();
    }
    exhausted = batch.rows == 0;
    if (lockstep) {
      if (sync->sum_scalar(exhausted ? 0.0 : 1.0) == 0) break;
      if (!spare) spare = batch;
    } else if (exhausted) {
      break;
    }
    const bool counted = !exhausted;
    if (!counted) batch = *spare;
    auto in = to_inputs(batch, model, device);
    in.logits_for_labels_only = true;
    if (context != nullptr) context->select(batch.seq_len, device);
    if (lockstep) sync->before_forward_only();
    auto out = model->forward(in);
    if (lockstep) sync->after_forward_only();
    if (!counted || !out.loss_sum.defined()) continue;
    nll += out.loss_sum.item<double>();
    tokens += double(out.loss_count);
    if (task == models::Task::kPretrain) {
      if (bases_of_label) {
        for (auto l : batch.labels) {
          if (l != data::kIgnoreIndex) bases += double(bases_of_label(l));
        }
      } else {
        bases += double(out.loss_count);
      }
    } else if (task == models::Task::kClassification) {
      const auto predicted = out.logits.argmax(-1).to(torch::kCPU).contiguous();
      const int64_t* p = predicted.data_ptr<int64_t>();
      for (int64_t r = 0; r < batch.rows; ++r) {
        const int64_t truth = batch.labels[static_cast<size_t>(r)];
        if (truth < 0 || truth >= labels) continue;
        correct += p[r] == truth ? 1.0 : 0.0;
        if (scored) confusion[truth][p[r]] += 1.0;
      }
      // Note [Context-parallel pooling]: a context group's rows are context rank 0's (the
      // others hold no labels; their truth above is kIgnoreIndex).
      if (context == nullptr || context->coordinates().context_rank == 0) {
        rows += double(batch.rows);
      }
    }
  }
  if (sync != nullptr) {
    nll = sync->sum_scalar(nll);
    tokens = sync->sum_scalar(tokens);
    bases = sync->sum_scalar(bases);
    correct = sync->sum_scalar(correct);
    rows = sync->sum_scalar(rows);
    for (auto& row : confusion) {
      for (auto& cell : row) cell = sync->sum_scalar(cell);
    }
  }
  if (was_training) model->train();
  EvalResult r;
  r.tokens = static_cast<int64_t>(tokens);
  r.bases = static_cast<int64_t>(bases);
  r.loss = tokens > 0 ? nll / tokens : std::nan("");
  r.bits_per_base = bases > 0 ? nll / std::log(2.0) / bases : std::nan("");
  r.correct = static_cast<int64_t>(correct);
  r.rows = static_cast<int64_t>(rows);
  r.accuracy = rows > 0 ? correct / rows : std::nan("");
  if (scored) r.scores = classification_scores(confusion);
  return r;
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

  if (sync_->rank() == 0) {
    metrics_ = std::make_unique<MetricsWriter>(MetricsOptions{
        config_.logging.metrics_file, options_.append_metrics, config_.logging.tensorboard_dir});
    if (!metrics_->tensorboard_path().empty())
      spdlog::info("TensorBoard events: {}", metrics_->tensorboard_path());
  }
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

RunEnd Trainer::run() {
  RunTotals totals;
  totals.start = Clock::now();
  const auto& t = config_.training;
  spdlog::info("training {} steps (global batch {} sequences)", total_steps_,
               t.micro_batch_size * t.grad_accum_steps * sync_->world_size());
  while (step_ < total_steps_) {
    const int64_t next = step_ + 1;
    const bool log_now =
        t.logging_steps > 0 && (next % t.logging_steps == 0 || next == total_steps_ || next == 1);
    for (auto& hook : options_.before_step) hook(*this, next);
    // Note [Sync-free step]: the loss and norm are read back on logging steps only.
    const auto r = train_step(log_now);
    const double global_tokens = account(r, totals);
    if (log_now && sync_->rank() == 0) log_step(r, global_tokens, totals);
    if (eval_ && t.eval_steps > 0 && (r.step % t.eval_steps == 0 || r.step == total_steps_)) {
      evaluate_at(r.step);
    }
    if (run_after_step_hooks(r) == StepAction::kStop) return RunEnd::kStopped;
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

void Trainer::evaluate_at(int64_t step) {
  const auto& t = config_.training;
  // Every rank: under ZeRO-3 evaluation's forwards gather unit by unit (Note [Sharded
  // evaluation]), as does an export of the best model (Note [Exports unit by unit]).
  EvalResult e;
  {
    parallel::ShardedForwards forwards(*sync_);
    e = evaluate(model_, *eval_, t.eval_batches, device_, options_.bases_of_label, sync_.get(),
                 options_.context.get());
  }
  if (sync_->rank() == 0) log_evaluation(step, e);
  // Every rank: the export of a new best model is collective under ZeRO-3.
  if (config_.checkpoint.best_metric != cfg::BestMetric::kNone) keep_if_best(step, e);
}

void Trainer::log_evaluation(int64_t step, const EvalResult& e) {
  const auto task = model_->spec().task;
  nlohmann::ordered_json line;
  line["event"] = "eval";
  line["step"] = step;
  line["loss"] = std::isfinite(e.loss) ? e.loss : -1.0;
  if (task == models::Task::kPretrain) {
    line["bits_per_base"] = std::isfinite(e.bits_per_base) ? e.bits_per_base : -1.0;
  } else if (task == models::Task::kClassification) {
    line["accuracy"] = std::isfinite(e.accuracy) ? e.accuracy : -1.0;
    if (e.scores) {
      line["mcc"] = e.scores->mcc;
      line["f1"] = e.scores->f1;
    }
    line["rows"] = e.rows;
  }
  line["tokens"] = e.tokens;
  write_metrics(line);
  if (task == models::Task::kPretrain) {
    spdlog::info("eval at step {}: loss {:.4f} bits/base {:.4f}", step, e.loss, e.bits_per_base);
  } else if (task == models::Task::kClassification) {
    spdlog::info("eval at step {}: loss {:.4f} accuracy {:.4f}{} ({} rows)", step, e.loss,
                 e.accuracy,
                 e.scores ? fmt::format(" mcc {:.4f} f1 {:.4f}", e.scores->mcc, e.scores->f1)
                          : std::string(),
                 e.rows);
  } else {
    spdlog::info("eval at step {}: loss {:.4f}", step, e.loss);
  }
}

namespace {

// Note [Best checkpoint]: the value of `metric` in `e`, and whether higher is better.
std::pair<double, bool> best_metric_value(cfg::BestMetric metric, const EvalResult& e) {
  switch (metric) {
    case cfg::BestMetric::kLoss:
      return {e.loss, false};
    case cfg::BestMetric::kBitsPerBase:
      return {e.bits_per_base, false};
    case cfg::BestMetric::kAccuracy:
      return {e.accuracy, true};
    case cfg::BestMetric::kMcc:
    case cfg::BestMetric::kF1:
    case cfg::BestMetric::kNone:
      break;
  }
  DNALLM_CHECK(metric != cfg::BestMetric::kNone, ExitCode::kUsage,
               "checkpoint.best_metric = \"none\" is not a metric");
  DNALLM_CHECK(e.scores.has_value(), ExitCode::kUsage,
               "checkpoint.best_metric = \"{}\" needs at most {} labels (model.num_labels); use "
               "\"accuracy\" or \"loss\"",
               cfg::spelling(metric), kMaxScoredClasses);
  return {metric == cfg::BestMetric::kMcc ? e.scores->mcc : e.scores->f1, true};
}

}  // namespace

void Trainer::export_model(const std::string& dir) {
  // Note [Exports unit by unit] (models/family_io.hpp): the ranks gather the model a unit at a
  // time (ZeRO-3; other syncs hold it whole: one visit), rank 0 writes.
  models::export_live_model(model_, dir, parameter_units(), sync_->rank() == 0);
}

models::ParameterUnits Trainer::parameter_units() {
  return [this](const auto& visit) { sync_->visit_parameter_units(visit); };
}

void Trainer::keep_if_best(int64_t step, const EvalResult& e) {
  namespace fs = std::filesystem;
  const cfg::BestMetric metric = config_.checkpoint.best_metric;
  const fs::path best = best_dir();
  if (!best_read_ && sync_->rank() == 0) {  // a resumed run: the value to beat survives the restart
    best_read_ = true;
    std::error_code ec;
    if (step_ > 0 && fs::is_regular_file(best / "best.json", ec)) {
      const auto j = nlohmann::json::parse(checkpoint::read_small_file(best / "best.json"), nullptr,
                                           /*allow_exceptions=*/false);
      if (j.is_object() && j.value("metric", std::string()) == cfg::spelling(metric) &&
          j["value"].is_number()) {
        best_value_ = j["value"].get<double>();
      }
    }
  }
  // Every rank holds the same summed metrics; rank 0, which reads best.json, decides.
  const auto [value, higher] = best_metric_value(metric, e);
  const bool better =
      sync_->rank() == 0 && std::isfinite(value) &&
      (std::isnan(best_value_) || (higher ? value > best_value_ : value < best_value_));
  if (sync_->sum_scalar(better ? 1.0 : 0.0) == 0) return;
  best_value_ = value;
  const fs::path tmp = best.string() + ".tmp", old = best.string() + ".old";
  if (sync_->rank() == 0) fs::remove_all(tmp);
  export_model(tmp.string());      // every rank: ZeRO-3 gathers the model unit by unit
  if (options_.write_tokenizer) {  // best/hf, as final/hf (run())
    options_.write_tokenizer(tmp.string(), parameter_units(), sync_->rank() == 0);
  }
  if (sync_->rank() != 0) return;
  nlohmann::ordered_json info;
  info["step"] = step;
  info["metric"] = cfg::spelling(metric);
  info["value"] = value;
  checkpoint::write_file_durable(tmp / "best.json", info.dump(2) + "\n");
  fs::remove_all(old);
  std::error_code ec;
  if (fs::exists(best, ec)) fs::rename(best, old);
  fs::rename(tmp, best);
  checkpoint::fsync_dir(best.parent_path());
  fs::remove_all(old);
  nlohmann::ordered_json line;
  line["event"] = "best";
  line["step"] = step;
  line[cfg::spelling(metric)] = value;
  write_metrics(line);
  spdlog::info("best {} so far ({:.4f}) at step {}: exported to {}", cfg::spelling(metric), value,
               step, best.string());
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
