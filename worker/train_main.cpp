// dnallm-train: one training worker. Alone it trains in one process; with a world size
// above 1 (torchrun-style variables from dnallm-launch, OpenMPI under mpirun, or a Slurm
// step) it joins the process group and trains data-parallel (DDP / ZeRO, [parallel]).
#include <iostream>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "checkpoint/dir_lock.hpp"
#include "cluster/topology.hpp"
#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/worker_env.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/transformer/hf_import.hpp"
#include "worker/parallel/context_mesh.hpp"
#include "worker/parallel/process_group.hpp"
#include "worker/train/auto_batch.hpp"
#include "worker/train/data_source.hpp"
#include "worker/train/in_process_recovery.hpp"
#include "worker/train/preemption.hpp"
#include "worker/train/profiler.hpp"
#include "worker/train/train_setup.hpp"

namespace dnallm {
namespace {

// Note [Checkpoint directory lock] (checkpoint/dir_lock.hpp): the directory is checked and
// owned before any training time is spent; rank 0 (the committer) holds it to the end.
std::optional<checkpoint::DirLock> lock_checkpoint_dir(const Config& config, int rank) {
  if (config.checkpoint.save_steps <= 0 && !config.checkpoint.save_final) return std::nullopt;
  checkpoint::validate_checkpoint_dir(config.checkpoint.dir, "checkpoint.dir");
  if (rank != 0) return std::nullopt;
  return checkpoint::DirLock::acquire(config.checkpoint.dir);
}

// --profile: refused here (exit 2) when this LibTorch has no Kineto.
std::unique_ptr<train::StepProfiler> make_profiler(const Config& config,
                                                   const std::optional<train::ProfileRange>& range,
                                                   int rank) {
  if (!range) return nullptr;
  const std::string dir = config.checkpoint.dir.empty() ? "." : config.checkpoint.dir;
  return std::make_unique<train::StepProfiler>(
      *range,
      fmt::format("{}/trace_steps_{}-{}_rank_{}.json", dir, range->first, range->last, rank));
}

// Note [Step hooks] (worker/train/trainer.hpp): dnallm-train's list, in its documented order.
void install_step_hooks(train::TrainerOptions& o, train::StepProfiler* profiler,
                        train::Preemption& preemption, train::Checkpointer& checkpointer,
                        const WorkerEnv& env) {
  if (profiler != nullptr) {
    o.before_step.push_back(
        [profiler](train::Trainer& t, int64_t step) { profiler->before_step(step, t.device()); });
    o.after_step.push_back([profiler](train::Trainer&, const train::StepResult& r) {
      profiler->after_step(r.step);  // before the checkpoint hooks: the trace holds the steps
      return train::StepAction::kContinue;
    });
  }
  o.after_step.push_back(preemption.boundary_hook());
  checkpointer.install(o);
  if (env.test.kill_after_save_step > 0) {
    o.after_step.push_back(train::kill_after_save_hook(env.test.kill_after_save_step));
  }
  if (!env.progress_file.empty())
    o.after_step.push_back(train::progress_file_hook(env.progress_file));
  if (env.test.step_delay.count() > 0) {
    o.after_step.push_back(train::step_delay_hook(env.test.step_delay));
  }
  o.after_step.push_back(preemption.stop_hook(checkpointer));
}

// Note [In-process recovery]: with spares in the job, the world communicator can be re-formed
// in place; null when this run cannot recover in process (why is logged once).
std::unique_ptr<train::InProcessRecovery> make_recovery(
    const Config& config, const WorkerEnv& env, const cluster::Topology& topo,
    const parallel::RankDevice& device, comm::ProcessGroup& group, data::DataLoader& loader,
    train::Checkpointer& checkpointer, parallel::ContextMesh* context, models::LanguageModel model,
    const std::optional<train::SparePlace>& spare, std::function<void()> on_rank_zero) {
  auto* world = dynamic_cast<comm::ReformableCommunicator*>(group.comm.get());
  if (world == nullptr) return nullptr;
  if (const auto why = coordinator::in_process_recovery_unsupported(config); !why.empty()) {
    spdlog::warn("no in-process recovery in this run ({}): a failure restarts the generation", why);
    return nullptr;
  }
  train::RecoveryOptions o;
  o.config = &config;
  o.env = env;
  o.topo = topo;
  o.device = device;
  o.store = group.store;
  o.comm = world;
  o.loader = &loader;
  o.abandon_saves = [&checkpointer] { checkpointer.abandon_in_flight(); };
  // Note [Shrink and grow]: the place this process holds, and the group it began in.
  o.place = spare ? spare->record.rank : topo.rank;
  o.initial_world = spare ? spare->initial_world : topo.world_size;
  o.initial_accum = spare ? spare->initial_accum : config.training.grad_accum_steps;
  o.on_rank_zero = std::move(on_rank_zero);
  if (context != nullptr) {
    // Note [Data x context mesh]: the context group is a split of the world, made again.
    o.reform_groups = [context, model](comm::Communicator& w, const std::string& name) mutable {
      const auto& c = context->coordinates();
      dynamic_cast<comm::ReformableCommunicator&>(context->group())
          .replace(w.split(c.data_rank, c.context_rank), name + ".context");
      // The model set on the mesh again, as a spare's fresh one is (make_context_mesh): its
      // attention context is built on the next forward (a collective over the new group, at
      // the same point on every rank), not kept from the old group.
      const auto view = context->model_view();
      view->positions = torch::Tensor();
      view->full_length = 0;
      model->set_context_parallel(view);
    };
    o.abort_groups = [context] {
      dynamic_cast<comm::ReformableCommunicator&>(context->group()).abort();
    };
  }
  return std::make_unique<train::InProcessRecovery>(std::move(o));
}

// Everything after the process group: data, model, resume, checkpointer, hooks, training.
// `spare`: this worker is a spare that took a dead rank's place (Note [In-process recovery]).
int train_in_group(Config& config, const WorkerEnv& env, const cluster::Topology& topo,
                   const parallel::RankDevice& rank_device, comm::ProcessGroup& group,
                   train::Preemption& preemption,
                   const std::optional<train::ProfileRange>& profile_range,
                   std::shared_ptr<std::optional<checkpoint::DirLock>> dir_lock,
                   const std::shared_ptr<const data::Tokenizer>& tokenizer,
                   const std::optional<train::SparePlace>& spare) {
  const bool owns_dir = dir_lock->has_value();
  // Note [Data x context mesh]: the samples and the global batch follow the data ranks.
  const auto mesh =
      parallel::mesh_coordinates(topo.rank, topo.world_size, config.parallel.context_parallel);
  const int data_rank = mesh.data_rank, data_world = mesh.data_world;
  auto sync = parallel::make_gradient_sync(config, group, spare.has_value());
  const nlohmann::json tokenizer_json = tokenizer->to_json();
  train::check_base_tokenizer(config, tokenizer_json);
  // A spare takes the state of its peers, not a checkpoint's.
  train::ResumePoint resume =
      spare ? train::ResumePoint{}
            : train::open_resume_point(config, tokenizer_json, data_world, owns_dir);
  auto model = train::make_model(config, *tokenizer, *sync, resume);
  auto context = parallel::make_context_mesh(config, group.comm.get(), *model);
  // training.batch_size = "auto": before the loaders, which take the micro-batch size.
  train::resolve_auto_batch(config, model, *sync, topo.local_world_size);
  auto train_loader =
      data::make_train_loader(config, tokenizer, data_rank, data_world, resume.sampler,
                              resume.step().value_or(0), spare ? spare->train_set : nullptr);
  data::DataLoader& loader = *train_loader;  // owned by the trainer below
  train::TrainerOptions trainer_options;
  trainer_options.bases_of_label = train::bases_of_label(tokenizer);
  trainer_options.context = context;
  // A resumed run, or a restarted elastic generation (even one with no checkpoint to
  // resume yet), continues the metrics file of the runs before it.
  trainer_options.append_metrics =
      resume.checkpoint.has_value() || env.generation.value_or(0) > 1 || spare.has_value();
  // A Hugging Face base (model.init_from) lends its export its config keys and remote code.
  const std::string hf_source =
      !config.model.init_from.empty() && models::is_hf_model_dir(config.model.init_from)
          ? config.model.init_from
          : std::string();
  trainer_options.write_tokenizer = [tokenizer, model, hf_source](
                                        const std::string& dir, const models::ParameterUnits& units,
                                        bool write) mutable {
    if (write) data::save_tokenizer(*tokenizer, dir + "/tokenizer.json");
    // The same model in a transformers layout that computes the same function (every rank:
    // a model sharded by ZeRO-3 is gathered a unit at a time).
    models::export_hf_directory(model, *tokenizer, dir + "/hf", hf_source, units, write);
  };
  const auto profiler = make_profiler(config, profile_range, topo.rank);
  // Declared before the trainer: its hooks call into the checkpointer.
  train::Checkpointer checkpointer(
      config,
      train::checkpointer_options(config, env, group, loader, tokenizer_json, resume.step()));
  const auto recovery = make_recovery(config, env, topo, rank_device, group, loader, checkpointer,
                                      context.get(), model, spare, [dir_lock, &config] {
                                        if (!dir_lock->has_value())
                                          *dir_lock = lock_checkpoint_dir(config, 0);
                                      });
  if (recovery) recovery->install(trainer_options);
  install_step_hooks(trainer_options, profiler.get(), preemption, checkpointer, env);
  train::Trainer trainer(
      config, std::move(model), std::make_unique<train::LoaderSource>(std::move(train_loader)),
      train::make_eval_source(config, tokenizer, data_rank, data_world), sync, trainer_options);
  if (resume.checkpoint) train::restore(trainer, *resume.checkpoint);
  if (spare) {
    DNALLM_CHECK(recovery != nullptr, ExitCode::kFailure,
                 "a spare took a place in a run that cannot recover in process (a bug)");
    recovery->join(trainer, spare->record, spare->assigned);
  } else {
    train::write_memory_event(trainer, topo.rank);
    train::write_restart_event(trainer, env);
  }
  trainer.run();
  return preemption.exit_code(config.checkpoint.dir);
}

int train_worker(const ConfigOptions& options, const std::string& profile) {
  Config config = resolve_config(options);
  if (options.print_config) {
    std::cout << to_toml(config);
    return 0;
  }
  init_logging("train", config.logging.level);
  std::optional<train::ProfileRange> profile_range;
  if (!profile.empty()) profile_range = train::parse_profile_range(profile, "--profile");
  cluster::EnvMap process_env = cluster::current_env();
  WorkerEnv env = WorkerEnv::from_environment(process_env);
  // Note [Stop while blocked]: from here on (opening the data, joining the process group
  // and resuming can all block).
  train::Preemption preemption(env.stop_grace, config.checkpoint.dir);
  const std::shared_ptr<const data::Tokenizer> tokenizer = data::make_tokenizer(config);
  // Note [In-process recovery]: a spare waits here, warm, until it is given a dead rank's place.
  std::optional<train::SparePlace> spare;
  if (env.spare_id) {
    auto train_set = data::make_dataset(config, *tokenizer, data::Split::kTrain);
    spare = train::wait_for_place(env);
    if (!spare) return 0;
    spare->train_set = std::move(train_set);
    spare->initial_accum = config.training.grad_accum_steps;
    train::take_place(*spare, process_env, env);
  }
  // DESIGN.md order: torchrun variables, OpenMPI, Slurm, else one process.
  cluster::Topology topo = cluster::detect_topology(process_env);
  if (spare) train::place_in_group(*spare, topo, config);
  set_log_identity(topo.rank);
  auto ckpt_lock =
      std::make_shared<std::optional<checkpoint::DirLock>>(lock_checkpoint_dir(config, topo.rank));
  // One GPU per rank (Note [One GPU per rank]), current from here on.
  const parallel::RankDevice rank_device =
      parallel::select_rank_device(config, topo.local_rank, topo.local_world_size,
                                   topo.source == cluster::TopologySource::kSlurm ||
                                       topo.source == cluster::TopologySource::kOpenMpi);
  // Note [Memory predicted]: a model that cannot fit is refused before the ranks connect, so
  // every rank exits 2 on its own instead of one leaving another in a collective.
  models::check_model_memory(config, *tokenizer, train::build_context(config));
  comm::ProcessGroup group;
  if (parallel::needs_process_group(config, topo)) {
    // A spare joins the group the survivors re-form for its record.
    group = spare ? train::join_as_spare(config, env, topo, rank_device, *spare)
                  : parallel::join_process_group(config, env, topo, rank_device,
                                                 parallel::process_group_name(env));
    const std::string name =
        spare ? coordinator::recovery_comm_name(*env.generation, spare->record.number)
              : parallel::process_group_name(env);
    if (env.in_process_recovery && env.generation) {
      group.comm = std::make_unique<comm::ReformableCommunicator>(std::move(group.comm), name);
    }
  }
  return train_in_group(config, env, topo, rank_device, group, preemption, profile_range, ckpt_lock,
                        tokenizer, spare);
}

}  // namespace
}  // namespace dnallm

int main(int argc, char** argv) {
  using namespace dnallm;
  // First: a stop signal must never find the default action (Note [Preemption]).
  train::install_preemption_handlers();
  CLI::App app{
      "dnallm-train: train a DNA language model (BERT masked LM, GPT causal LM, or a\n"
      "classification/regression fine-tune) from a TOML configuration. Writes JSON Lines\n"
      "metrics from rank 0 and exports <checkpoint.dir>/final at the end. SIGUSR1 or SIGTERM:\n"
      "save a checkpoint at the next step (all ranks) and exit 75, resumable (docs/slurm.md)."};
  ConfigOptions options;
  add_config_options(app, options);
  std::string profile;
  app.add_option("--profile", profile,
                 "write a Chrome/Perfetto trace of optimizer steps START:END (Kineto) to "
                 "<checkpoint.dir>/trace_steps_START-END_rank_R.json");
  return run_main("dnallm-train", app, argc, argv,
                  [&]() -> int { return train_worker(options, profile); });
}
