#include "worker/train/trainer.hpp"

#include <sys/resource.h>
#include <torch/version.h>

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/train/autocast.hpp"

namespace dnallm::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double peak_rss_mb() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

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

torch::Device pick_device(const std::string& name) {
  if (name == "cpu") return torch::kCPU;
  if (name == "cuda") {
    DNALLM_CHECK(torch::cuda::is_available(), ExitCode::kUsage,
                 "training.device = \"cuda\" but LibTorch sees no CUDA device: use \"cpu\"");
    return torch::kCUDA;
  }
  DNALLM_CHECK(name == "auto", ExitCode::kUsage,
               "training.device = \"{}\": use \"auto\", \"cpu\" or \"cuda\"", name);
  return torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
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
  return std::max<int64_t>(1, static_cast<int64_t>(
                                  std::ceil(t.num_train_epochs * double(samples_per_epoch) / global)));
}

models::TransformerLM build_model(const Config& config, int64_t vocab_size) {
  auto options = models::model_options_from_config(config, vocab_size);
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  const int64_t lora_r = options.lora_r;
  options.lora_r = 0;  // load base weights first, then add adapters
  models::TransformerLM model(options);
  if (!config.model.init_from.empty()) {
    const std::string path = config.model.init_from + "/model.safetensors";
    DNALLM_CHECK(std::filesystem::exists(path), ExitCode::kUsage,
                 "model.init_from = \"{}\" has no model.safetensors: point it at an exported "
                 "final/ directory",
                 config.model.init_from);
    auto weights = models::load_safetensors(path);
    int64_t loaded = 0;
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : model->named_weights()) {
      auto it = weights.find(name);
      if (it == weights.end() || it->second.sizes() != p.sizes()) continue;
      p.copy_(it->second);
      ++loaded;
    }
    DNALLM_CHECK(loaded > 0, ExitCode::kUsage,
                 "model.init_from = \"{}\": no tensor matches this model's names and shapes",
                 config.model.init_from);
    spdlog::info("initialised {} tensors from {}", loaded, path);
  }
  if (lora_r > 0) model->enable_lora(lora_r);
  if (config.lora.quantize_base != "none") {  // QLoRA: adapters over a 4-bit frozen base
    DNALLM_CHECK(lora_r > 0, ExitCode::kUsage,
                 "lora.quantize_base = \"{}\" quantizes the frozen base of a LoRA fine-tune: "
                 "set lora.r > 0",
                 config.lora.quantize_base);
    const auto r = models::quantize_linears(
        *model, models::parse_weight_format(config.lora.quantize_base, "lora.quantize_base"));
    spdlog::info("QLoRA: {} base linears in {} ({:.2f} MB, {:.3f}x bf16)", r.linears,
                 config.lora.quantize_base, r.quantized_bytes / 1e6,
                 double(r.quantized_bytes) / double(std::max<int64_t>(r.bf16_bytes(), 1)));
  }
  return model;
}

models::ForwardInputs to_inputs(const data::Batch& b, const models::TransformerLM& model,
                                const torch::Device& device) {
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  auto wrap = [&](const std::vector<int64_t>& v, std::vector<int64_t> shape) {
    // from_blob + to(): one copy into an owning tensor (on the device).
    return torch::from_blob(const_cast<int64_t*>(v.data()), shape, i64).to(device, false, true);
  };
  DNALLM_CHECK(int64_t(b.input_ids.size()) == b.rows * b.seq_len, ExitCode::kFailure,
               "batch has {} input ids for {} x {}", b.input_ids.size(), b.rows, b.seq_len);
  models::ForwardInputs in;
  in.input_ids = wrap(b.input_ids, {b.rows, b.seq_len});
  if (!b.attention_mask.empty()) in.attention_mask = wrap(b.attention_mask, {b.rows, b.seq_len});
  if (!b.segment_ids.empty()) in.segment_ids = wrap(b.segment_ids, {b.rows, b.seq_len});
  const auto task = model->options().task;
  if (!b.labels.empty()) {
    in.labels = task == models::Task::kPretrain ? wrap(b.labels, {b.rows, b.seq_len})
                                                : wrap(b.labels, {b.rows});
  }
  if (!b.targets.empty()) {
    in.targets = torch::from_blob(const_cast<float*>(b.targets.data()), {b.rows},
                                  torch::kFloat32).to(device, false, true);
  }
  return in;
}

EvalResult evaluate(models::TransformerLM& model, BatchSource& source, int64_t batches,
                    const torch::Device& device,
                    const std::function<int64_t(int64_t)>& bases_of_label, GradientSync* sync) {
  const bool was_training = model->is_training();
  model->eval();
  source.rewind();
  torch::NoGradGuard no_grad;
  double nll = 0.0;
  double tokens = 0, bases = 0, correct = 0, rows = 0;
  const auto task = model->options().task;
  for (int64_t i = 0; i < batches; ++i) {
    auto batch = source.next();
    if (batch.rows == 0) break;
    auto in = to_inputs(batch, model, device);
    in.logits_for_labels_only = true;
    auto out = model->forward(in);
    if (!out.loss_sum.defined()) continue;
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
      correct += out.logits.argmax(-1).eq(in.labels).sum().item<double>();
      rows += double(batch.rows);
    }
  }
  if (sync != nullptr) {
    nll = sync->sum_scalar(nll);
    tokens = sync->sum_scalar(tokens);
    bases = sync->sum_scalar(bases);
    correct = sync->sum_scalar(correct);
    rows = sync->sum_scalar(rows);
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
  return r;
}

Trainer::Trainer(Config config, models::TransformerLM model, std::unique_ptr<BatchSource> train,
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
  DNALLM_CHECK(t.precision == "fp32" || t.precision == "bf16" || t.precision == "fp16",
               ExitCode::kUsage, "training.precision = \"{}\": use \"fp32\", \"bf16\" or \"fp16\"",
               t.precision);
  device_ = pick_device(t.device);
  if (device_.is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(t.tf32);
    at::globalContext().setAllowTF32CuDNN(t.tf32);
  }
  autocast_bf16_ = t.precision == "bf16";
  autocast_fp16_ = t.precision == "fp16" && device_.is_cuda();
  optim::LossScalerOptions scaler_options;
  scaler_options.enabled = t.precision == "fp16";
  scaler_options.init_scale = options_.initial_loss_scale;
  scaler_ = optim::LossScaler(scaler_options);

  model_->to(device_);
  model_->train();
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& p : model_->named_parameters()) {
    if (p.value().requires_grad()) named.emplace_back(p.key(), p.value());
  }
  flat_ = std::make_unique<optim::FlatParameters>(sync_->order_parameters(named), device_);
  sync_->attach(*flat_, named);
  DNALLM_CHECK(flat_->numel() > 0, ExitCode::kUsage, "the model has no trainable parameters");
  const auto [begin, end] = sync_->shard_range(flat_->numel());
  optim::AdamWOptions adam{t.adam_beta1, t.adam_beta2, t.adam_epsilon, t.weight_decay};
  adamw_ = std::make_unique<optim::FlatAdamW>(adam, begin, end,
                                              flat_->decay_mask().narrow(0, begin, end - begin));
  total_steps_ = train::total_steps(config_, train_->samples_per_epoch(), sync_->world_size());
  schedule_ = optim::schedule_from_config(t, total_steps_);

  std::string metrics_path = config_.logging.metrics_file;
  if (!metrics_path.empty() && sync_->rank() == 0) {
    auto parent = std::filesystem::path(metrics_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    metrics_.open(metrics_path,
                  std::ios::out | (options_.append_metrics ? std::ios::app : std::ios::trunc));
    DNALLM_CHECK(metrics_.good(), ExitCode::kUsage, "cannot write logging.metrics_file \"{}\": {}",
                 metrics_path, errno_string());
  }
  spdlog::info("model {} ({} task): {} trainable parameters of {}, device {}, precision {}",
               config_.model.arch, config_.model.task, flat_->numel(),
               [&] {
                 int64_t n = 0;
                 for (const auto& p : model_->parameters()) n += p.numel();
                 return n;
               }(),
               device_.str(), t.precision);
}

Trainer::~Trainer() = default;

std::string Trainer::export_dir() const {
  if (!config_.training.output_dir.empty()) return config_.training.output_dir;
  return config_.checkpoint.dir + "/final";
}

void Trainer::write_metrics(const std::string& line) {
  if (!metrics_.is_open()) return;
  metrics_ << line << '\n';
  metrics_.flush();
}

StepResult Trainer::train_step() {
  const auto t0 = Clock::now();
  const double wait0 = train_->data_wait_s();
  const int64_t accum = config_.training.grad_accum_steps;
  const auto task = model_->options().task;
  StepResult r;
  r.step = step_ + 1;

  // Note [Loss normalisation]: the whole step's batches first, then the global count.
  std::vector<data::Batch> micro;
  micro.reserve(accum);
  int64_t local_count = 0;
  for (int64_t j = 0; j < accum; ++j) {
    micro.push_back(train_->next());
    local_count += label_count(micro.back(), task);
    r.tokens += real_tokens(micro.back());
  }
  const double global_count = sync_->sum_scalar(double(local_count));
  DNALLM_CHECK(global_count > 0, ExitCode::kBadData,
               "step {} has no label tokens in its global batch: check data.mlm_probability and "
               "the input files",
               r.step);

  flat_->zero_grad();
  const double scale = scaler_.scale();
  double local_loss_sum = 0.0;
  for (int64_t j = 0; j < accum; ++j) {
    auto in = to_inputs(micro[j], model_, device_);
    in.logits_for_labels_only = true;
    // Note [Dropout randomness]
    torch::manual_seed(dropout_seed(static_cast<uint64_t>(config_.training.seed), r.step, j,
                                    sync_->rank()));
    torch::Tensor loss;
    {
      AutocastGuard autocast(autocast_bf16_, autocast_fp16_, device_);
      auto out = model_->forward(in);
      loss = out.loss_sum;
    }
    const double value = loss.item<double>();
    if (!std::isfinite(value)) {
      fail(ExitCode::kFailure,
           "loss is {} at step {} (micro-step {}): training diverged; lower training.lr, keep "
           "training.max_grad_norm > 0, or use training.precision = \"fp32\" or \"bf16\"",
           value, r.step, j);
    }
    local_loss_sum += value;
    sync_->before_backward(j, j + 1 == accum);
    (loss * (scale / global_count)).backward();
    sync_->after_backward(j, j + 1 == accum);
  }
  r.comm_exposed_s = sync_->wait_gradients();
  r.loss = sync_->sum_scalar(local_loss_sum) / global_count;

  const auto [begin, end] = std::make_pair(adamw_->begin(), adamw_->end());
  auto grads = flat_->grads().narrow(0, begin, end - begin);
  const double norm = std::sqrt(sync_->grad_sq_norm(grads)) / scale;
  const bool found_inf = !std::isfinite(norm);
  r.grad_norm = norm;
  r.lr = optim::lr_at(schedule_, step_);
  if (scaler_.update(found_inf)) {
    const double coef = optim::clip_coefficient(norm, config_.training.max_grad_norm);
    adamw_->step(flat_->params().narrow(0, begin, end - begin), grads, r.lr, coef / scale);
    sync_->after_optimizer_step(*flat_);
  } else {
    r.skipped = true;
    spdlog::warn("step {}: gradient overflow (norm {}), step skipped; loss scale now {}", r.step,
                 norm, scaler_.scale());
  }
  ++step_;
  r.data_wait_s = train_->data_wait_s() - wait0;
  r.step_s = seconds_since(t0);
  return r;
}

void Trainer::run() {
  const auto t_start = Clock::now();
  const auto& t = config_.training;
  const bool rank0 = sync_->rank() == 0;
  double train_s = 0.0;
  double tokens = 0.0;
  double final_loss = std::nan("");
  spdlog::info("training {} steps (global batch {} sequences)", total_steps_,
               t.micro_batch_size * t.grad_accum_steps * sync_->world_size());
  while (step_ < total_steps_) {
    auto r = train_step();
    train_s += r.step_s;
    const double global_tokens = double(r.tokens) * sync_->world_size();
    tokens += global_tokens;
    final_loss = r.loss;
    const bool log_now = t.logging_steps > 0 &&
                         (r.step % t.logging_steps == 0 || r.step == total_steps_ || r.step == 1);
    if (log_now && rank0) {
      const double tps = global_tokens / std::max(r.step_s, 1e-9);
      nlohmann::ordered_json line;
      line["step"] = r.step;
      line["loss"] = r.loss;
      line["lr"] = r.lr;
      line["grad_norm"] = std::isfinite(r.grad_norm) ? r.grad_norm : -1.0;
      line["tokens_per_s"] = tps;
      line["step_s"] = r.step_s;
      line["comm_exposed_s"] = r.comm_exposed_s;
      line["data_wait_s"] = r.data_wait_s;
      if (r.skipped) line["skipped"] = true;
      if (scaler_.scale() != 1.0) line["loss_scale"] = scaler_.scale();
      write_metrics(line.dump());
      if (options_.console_progress) {
        const double eta = train_s / double(r.step) * double(total_steps_ - r.step);
        spdlog::info("step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} {:.0f} tok/s ETA {}",
                     r.step, total_steps_, r.loss, r.lr, r.grad_norm, tokens / train_s,
                     format_duration(eta));
      }
    }
    if (eval_ && t.eval_steps > 0 && (r.step % t.eval_steps == 0 || r.step == total_steps_)) {
      auto e = evaluate(model_, *eval_, t.eval_batches, device_, options_.bases_of_label,
                        sync_.get());
      if (rank0) {
        nlohmann::ordered_json line;
        line["event"] = "eval";
        line["step"] = r.step;
        line["loss"] = std::isfinite(e.loss) ? e.loss : -1.0;
        if (model_->options().task == models::Task::kPretrain) {
          line["bits_per_base"] = std::isfinite(e.bits_per_base) ? e.bits_per_base : -1.0;
        } else if (model_->options().task == models::Task::kClassification) {
          line["accuracy"] = std::isfinite(e.accuracy) ? e.accuracy : -1.0;
        }
        line["tokens"] = e.tokens;
        write_metrics(line.dump());
        const auto task = model_->options().task;
        if (task == models::Task::kPretrain) {
          spdlog::info("eval at step {}: loss {:.4f} bits/base {:.4f}", r.step, e.loss,
                       e.bits_per_base);
        } else if (task == models::Task::kClassification) {
          spdlog::info("eval at step {}: loss {:.4f} accuracy {:.4f} ({} rows)", r.step, e.loss,
                       e.accuracy, e.rows);
        } else {
          spdlog::info("eval at step {}: loss {:.4f}", r.step, e.loss);
        }
      }
    }
    if (options_.after_step) options_.after_step(*this, r);
  }
  if (options_.at_end) options_.at_end(*this);
  if (rank0 && config_.checkpoint.save_final) {
    const auto dir = export_dir();
    models::export_model(model_, dir, config_.model.arch);
    if (options_.write_tokenizer) options_.write_tokenizer(dir);
    spdlog::info("exported the model to {}", dir);
  }
  if (rank0) {
    nlohmann::ordered_json line;
    line["event"] = "summary";
    line["steps"] = step_;
    line["tokens"] = static_cast<int64_t>(tokens);
    line["tokens_per_s"] = train_s > 0 ? tokens / train_s : 0.0;
    line["wall_s"] = seconds_since(t_start);
    line["final_loss"] = std::isfinite(final_loss) ? final_loss : -1.0;
    line["world_size"] = sync_->world_size();
    line["peak_rss_mb"] = peak_rss_mb();
    line["skipped_steps"] = scaler_.skipped_steps();
    write_metrics(line.dump());
    spdlog::info("done: {} steps, {:.0f} tokens/s, final loss {:.4f}, {:.1f} s", step_,
                 train_s > 0 ? tokens / train_s : 0.0, final_loss, seconds_since(t_start));
  }
}

}  // namespace dnallm::train
