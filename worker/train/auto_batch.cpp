#include "worker/train/auto_batch.hpp"

#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <fstream>
#include <new>

#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "core/host_memory.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/train/autocast.hpp"
#include "worker/train/batch_search.hpp"

namespace dnallm::train {
namespace {

double resident_bytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return double(resident) * double(sysconf(_SC_PAGESIZE));
}

bool is_out_of_memory(const std::string& what) {
  return what.find("out of memory") != std::string::npos ||
         what.find("not enough memory") != std::string::npos ||
         what.find("can't allocate memory") != std::string::npos;
}

// Returns freed heap pages to the system, so that the resident set measured by the next trial
// starts from what is live rather than from the previous (larger) trial's high-water mark.
void release_free_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

void drop_gradients(models::LanguageModel& model) {
  for (auto& p : model->parameters()) {
    if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
  }
}

}  // namespace

MicroBatchTrial probe_micro_batch(models::LanguageModel model, const Config& config,
                                  int64_t micro_batch, const torch::Device& device,
                                  double memory_budget_bytes) {
  const auto& o = model->spec();
  const int64_t t = o.max_seq_length;
  int64_t trainable = 0;
  for (const auto& p : model->parameters()) trainable += p.requires_grad() ? p.numel() : 0;
  const double adam_bytes = 8.0 * double(trainable);
  MicroBatchTrial trial;
  model->to(device);
  model->train();
  release_free_memory();
  double peak = resident_bytes();
  try {
    const auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(device);
    const int64_t low = std::min(data::kFirstRegularId, o.vocab_size - 1);
    models::ForwardInputs in;
    in.input_ids = torch::randint(low, o.vocab_size, {micro_batch, t}, i64);
    if (o.task == models::Task::kPretrain) {
      in.labels = in.input_ids.clone();
      in.logits_for_labels_only = true;
    } else if (o.task == models::Task::kClassification) {
      in.labels = torch::zeros({micro_batch}, i64);
    } else {
      in.targets = torch::zeros({micro_batch}, i64.dtype(torch::kFloat32));
    }
    torch::Tensor loss;
    {
      AutocastGuard autocast(config.training.precision == cfg::Precision::kBf16,
                             config.training.precision == cfg::Precision::kFp16 && device.is_cuda(),
                             device);
      loss = model->forward(in).loss_sum;
    }
    peak = std::max(peak, resident_bytes());
    loss.backward();
    peak = std::max(peak, resident_bytes());
    if (device.is_cuda()) torch::cuda::synchronize();
    trial.fits = true;
  } catch (const std::bad_alloc&) {
    trial.why = "std::bad_alloc";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    if (!is_out_of_memory(what)) throw;
    trial.why = what.substr(0, what.find('\n'));
  }
  drop_gradients(model);
  release_free_memory();
  if (device.is_cuda()) return trial;
  trial.peak_bytes = peak + adam_bytes;
  if (trial.fits && trial.peak_bytes > memory_budget_bytes) {
    trial.fits = false;
    trial.why = fmt::format("{:.0f} MiB resident > budget {:.0f} MiB", trial.peak_bytes / 1048576.0,
                            memory_budget_bytes / 1048576.0);
  }
  return trial;
}

double auto_batch_budget_bytes(const Config& config, int local_world_size) {
  if (config.training.auto_batch_memory_mb > 0) {
    return config.training.auto_batch_memory_mb * 1048576.0;
  }
  return 0.8 * mem_available_bytes() / double(std::max(1, local_world_size)) + resident_bytes();
}

void resolve_auto_batch(Config& config, models::LanguageModel model, GradientSync& sync,
                        int local_world_size) {
  auto& t = config.training;
  if (t.batch_size != cfg::BatchSize::kAuto) return;
  const auto device = pick_device(t.device);
  const int world = sync.world_size();
  const int64_t per_rank = t.micro_batch_size * t.grad_accum_steps;
  const double budget = auto_batch_budget_bytes(config, local_world_size);
  if (!device.is_cuda()) {
    spdlog::info("training.batch_size = \"auto\": CPU memory budget {:.0f} MiB per rank{}",
                 budget / 1048576.0,
                 t.auto_batch_memory_mb > 0 ? " (training.auto_batch_memory_mb)"
                                            : " (80% of available memory; set "
                                              "training.auto_batch_memory_mb to choose)");
  }
  // Every rank must take the same path through the search: a size fits only if it fits on
  // every rank (sum of votes == world).
  auto probe = [&](int64_t m) {
    auto trial = probe_micro_batch(model, config, m, device, budget);
    const bool all = sync.sum_scalar(trial.fits ? 1.0 : 0.0) >= double(world) - 0.5;
    spdlog::info("training.batch_size = \"auto\": micro-batch {} {}{}{}", m,
                 all ? "fits" : "does not fit",
                 trial.peak_bytes > 0 ? fmt::format(" ({:.0f} MiB)", trial.peak_bytes / 1048576.0)
                                      : std::string(),
                 trial.why.empty() ? std::string() : ": " + trial.why);
    return all;
  };
  auto found = search_micro_batch(probe, {1, per_rank});
  DNALLM_CHECK(
      found.largest_fit >= 1, ExitCode::kUsage,
      "training.batch_size = \"auto\": not even a micro-batch of 1 sequence of {} tokens "
      "fits{}: raise training.auto_batch_memory_mb, lower model.max_seq_length, or set "
      "model.gradient_checkpointing = true",
      model->spec().max_seq_length,
      device.is_cuda() ? " in GPU memory" : fmt::format(" in {:.0f} MiB", budget / 1048576.0));
  const auto plan = plan_accumulation(per_rank, found.largest_fit);
  const auto line = describe_batch_plan(plan, found.largest_fit, per_rank, world);
  if (plan.reduced_to_divide) {
    spdlog::warn("{}", line);
  } else {
    spdlog::info("{}", line);
  }
  t.micro_batch_size = plan.micro_batch_size;
  t.grad_accum_steps = plan.grad_accum_steps;
}

}  // namespace dnallm::train
