// The pieces dnallm-train's main (worker/train_main.cpp) assembles into a run, each one step:
// the tokenizer check of a fine-tune, the resume point, the model, the data sources, the
// checkpointer's options, the step hooks that are not objects of their own, and the metrics
// lines written once before training. Training thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "comm/bootstrap.hpp"
#include "core/config.hpp"
#include "core/worker_env.hpp"
#include "worker/data/pipeline.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/transformer/transformer.hpp"
#include "worker/train/checkpointing.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {

// Builds the model for `config` (vocabulary from the tokenizer); loads model.init_from
// (an exported directory) by name where shapes match (task heads stay fresh).
models::TransformerLM build_model(const Config& config, int64_t vocab_size);
// Where this process will build its model: the device (training.device; loads the CUDA plugin
// where a GPU may be used) and the ranks sharing the memory (WORLD_SIZE, LOCAL_WORLD_SIZE).
models::BuildContext build_context(const Config& config);

// A fine-tune must tokenize as its base model did: init_from loads tensors by name and shape,
// so another tokenizer would leave the embeddings untrained (other shape) or, with the same
// vocabulary size, silently give every id another meaning. Throws Error(kUsage) when
// model.init_from (an exported directory, not a transformers one) has a tokenizer.json
// that differs from `tokenizer`.
void check_base_tokenizer(const Config& config, const nlohmann::json& tokenizer);

// Where this run starts: the newest committed checkpoint every rank picks and verifies
// (open_resume), and the sampler state saved with it.
struct ResumePoint {
  std::optional<checkpoint::CheckpointReader> checkpoint;
  std::optional<data::SamplerState> sampler;
  std::optional<int64_t> step() const {
    return checkpoint ? std::optional<int64_t>(checkpoint->step()) : std::nullopt;
  }
};
// Opens the resume point; `owns_dir` (rank 0 holding the directory lock) sets aside step
// directories newer than it; applies training.keep_global_batch to `config`.
ResumePoint open_resume_point(Config& config, const nlohmann::json& tokenizer, int world,
                              bool owns_dir);

// The model of `config`: imported from a transformers directory (model.init_from), else built
// (and initialised from an exported directory when model.init_from names one). A fresh build
// hands its blocks to `sync`'s sink as they are built (Note [Streamed build]); a resumed run's
// family sees the checkpoint's parameter names (BuildContext::resumed_parameters).
models::LanguageModel make_model(const Config& config, const data::Tokenizer& tokenizer,
                                 parallel::GradientSync& sync, const ResumePoint& resume);

// The evaluation batches when training.eval_steps > 0 and there is evaluation data; null
// otherwise (warns when eval_steps asks for data that is not there).
std::unique_ptr<BatchSource> make_eval_source(const Config& config,
                                              std::shared_ptr<const data::Tokenizer> tokenizer,
                                              int rank, int world);

// The checkpointer's options for this worker: descriptors through the group's store, or
// through an elastic coordinator's commit registry (env.external_coordinator); store keys
// named for the generation; the sampler state read from `loader` (which must outlive it).
CheckpointerOptions checkpointer_options(const Config& config, const WorkerEnv& env,
                                         const comm::ProcessGroup& group,
                                         const data::DataLoader& loader,
                                         const nlohmann::json& tokenizer,
                                         std::optional<int64_t> resumed_step);

// Elastic agents watch progress through this file (docs/elastic.md): after every step, the
// step and this process's pid, written to a temporary name and renamed so a reader never sees
// half a number. Note [Step hooks] item 4.
StepHook progress_file_hook(const std::string& path);
// Test-only hooks (WorkerTestHooks in core/worker_env.hpp), Note [Step hooks] items 3 and 5:
// SIGKILL right after the checkpoint hook handed step `step`'s save to the writer; sleep
// `delay` after every step.
StepHook kill_after_save_hook(int64_t step);
StepHook step_delay_hook(std::chrono::milliseconds delay);

// {"event":"memory",...}: model-state bytes on this rank, measured from the buffers, beside
// the ZeRO paper's accounting for the same parameter count, precision, stage and world size.
void write_memory_event(Trainer& trainer, int rank);
// {"event":"restart","generation","reason"} for a restarted elastic generation (> 1).
void write_restart_event(Trainer& trainer, const WorkerEnv& env);

}  // namespace dnallm::train
