#include "worker/train/train_setup.hpp"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "checkpoint/dir_lock.hpp"
#include "checkpoint/train_state.hpp"
#include "coordinator/commit_registry.hpp"
#include "core/error.hpp"
#include "core/host_memory.hpp"
#include "worker/models/registry.hpp"
#include "worker/parallel/plan.hpp"
#include "worker/train/data_source.hpp"
#include "worker/train/device_stats.hpp"

namespace dnallm::train {

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

void check_base_tokenizer(const Config& config, const nlohmann::json& tokenizer) {
  const std::string& base = config.model.init_from;
  if (base.empty() || models::is_hf_model_dir(base)) return;
  const std::string base_path = base + "/tokenizer.json";
  if (!std::filesystem::exists(base_path)) return;
  const auto base_json = data::load_tokenizer(base_path)->to_json();
  DNALLM_CHECK(base_json == tokenizer, ExitCode::kUsage,
               "model.init_from = \"{}\" was trained with the tokenizer {} but [tokenizer] "
               "here gives {}: set [tokenizer] to the base model's settings",
               base, base_json.dump(), tokenizer.dump());
}

ResumePoint open_resume_point(Config& config, const nlohmann::json& tokenizer, int world,
                              bool owns_dir) {
  ResumePoint p;
  p.checkpoint = open_resume(config, tokenizer);
  if (owns_dir) checkpoint::set_aside_newer_steps(config.checkpoint.dir, p.step().value_or(0));
  if (p.checkpoint) {
    p.sampler = data::SamplerState::from_json(saved_sampler_state(*p.checkpoint));
    keep_global_batch(config, *p.checkpoint, world);
  }
  return p;
}

models::LanguageModel make_model(const Config& config, const data::Tokenizer& tokenizer,
                                 parallel::GradientSync& sync, const ResumePoint& resume) {
  auto context = build_context(config);
  if (resume.checkpoint) {
    for (const auto& e : checkpoint::read_train_state(*resume.checkpoint).layout) {
      context.resumed_parameters.insert(e.name);
    }
  }
  if (models::streams_blocks(config)) {
    context.blocks = sync.block_sink(pick_device(config.training.device));
  }
  return models::build_model_for(config, tokenizer, context);
}

std::unique_ptr<BatchSource> make_eval_source(const Config& config,
                                              std::shared_ptr<const data::Tokenizer> tokenizer,
                                              int rank, int world) {
  if (config.training.eval_steps <= 0) return nullptr;
  auto loader = data::make_eval_loader(config, std::move(tokenizer), rank, world);
  if (loader) return std::make_unique<LoaderSource>(std::move(loader));
  spdlog::warn(
      "training.eval_steps = {} but there is no evaluation data (set data.eval_files or "
      "data.eval_fraction or data.eval_regions): evaluation is off",
      config.training.eval_steps);
  return nullptr;
}

CheckpointerOptions checkpointer_options(const Config& config, const WorkerEnv& env,
                                         const comm::ProcessGroup& group,
                                         const data::DataLoader& loader,
                                         const nlohmann::json& tokenizer,
                                         std::optional<int64_t> resumed_step) {
  CheckpointerOptions o;
  // The store's server (the coordinator, or rank 0's store) keeps the commit registry
  // (coordinator/commit_registry.hpp): shards are reported to it and it alone decides
  // retention. Without a TCP store a single process commits in process.
  o.commit = coordinator::commit_channel_for(group.store, env.generation.value_or(0));
  o.sampler_state = [&loader] { return loader.state().to_json(); };
  o.tokenizer = tokenizer;
  o.commit_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.parallel.timeout_s * 1000));
  o.resumed_step = resumed_step;
  return o;
}

StepHook progress_file_hook(const std::string& path) {
  return [path](Trainer&, const StepResult& r) {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      // Line 2, the pid: the agent checks whether this process is stopped when the job
      // stalls (Note [Hang culprit] in coordinator/elastic_state.cpp).
      out << r.step << "\n" << ::getpid() << "\n";
    }
    std::rename(tmp.c_str(), path.c_str());
    return StepAction::kContinue;
  };
}

StepHook kill_after_save_hook(int64_t step) {
  return [step](Trainer& t, const StepResult& r) {
    const int64_t every = t.config().checkpoint.save_steps;
    if (r.step == step && every > 0 && r.step % every == 0) {
      spdlog::warn("test hook: killing this process after handing step {}'s save over", step);
      ::raise(SIGKILL);
    }
    return StepAction::kContinue;
  };
}

StepHook step_delay_hook(std::chrono::milliseconds delay) {
  return [delay](Trainer&, const StepResult&) {
    std::this_thread::sleep_for(delay);
    return StepAction::kContinue;
  };
}

void write_memory_event(Trainer& trainer, int rank) {
  const Config& config = trainer.config();
  const int64_t n = trainer.flat().parameter_count();
  parallel::MemoryAccount allocated{n * 4, n * 4, n * 8};
  parallel::MemoryAccount paper = parallel::account_memory(n, config.training.precision, 0, 1);
  const auto memory = trainer.sync().memory();
  if (memory) {
    allocated = memory->allocated;
    paper = memory->paper;
  }
  nlohmann::ordered_json line;
  line["event"] = "memory";
  line["rank"] = rank;
  line["parameters"] = n;
  line["zero_stage"] = config.parallel.zero_stage;
  line["params_bytes"] = allocated.params;
  line["grads_bytes"] = allocated.grads;
  line["optimizer_bytes"] = allocated.optimizer;
  // Note [Optimizer offload] (worker/train/trainer.hpp): where the optimizer state lives;
  // with offload the host also holds the master copy of the range and its gradients.
  const int64_t owned = trainer.optimizer().end() - trainer.optimizer().begin();
  line["optimizer_offload"] = trainer.offloaded();
  line["optimizer_device_bytes"] = trainer.offloaded() ? 0 : allocated.optimizer;
  line["optimizer_host_bytes"] = trainer.offloaded() ? allocated.optimizer + owned * 8 : 0;
  if (memory && memory->frozen_total > 0) {
    // Note [Fully sharded frozen base]: the frozen parameters this rank holds between steps.
    line["frozen_bytes"] = memory->frozen_held;
    line["frozen_total_bytes"] = memory->frozen_total;
  }
  if (memory && memory->build_whole > 0) {
    // Note [Streamed build]: the blocks' parameters held whole at once while built.
    line["build_held_peak_bytes"] = memory->build_held_peak;
    line["build_whole_bytes"] = memory->build_whole;
  }
  // The host's high-water mark so far: the build, placement and restore (Note [Streamed build]).
  line["peak_rss_mb"] = peak_rss_mb();
  line["zero_paper_bytes"] = {
      {"params", paper.params}, {"grads", paper.grads}, {"optimizer", paper.optimizer}};
  const auto gpu = device_memory_stats(trainer.device());
  if (gpu.available) {
    line["peak_gpu_mb"] = gpu.peak_allocated_mb;
    line["peak_gpu_reserved_mb"] = gpu.peak_reserved_mb;
  }
  trainer.write_metrics(line);
}

void write_restart_event(Trainer& trainer, const WorkerEnv& env) {
  if (env.generation.value_or(0) <= 1) return;
  nlohmann::ordered_json line;
  line["event"] = "restart";
  line["kind"] = "full_restart";
  line["generation"] = *env.generation;
  line["reason"] = env.restart_reason;
  trainer.write_metrics(line);
}

}  // namespace dnallm::train
