// dnallm-train: one training worker. Alone it trains in one process; with a world size
// above 1 (torchrun-style variables from dnallm-launch, OpenMPI under mpirun, or a Slurm
// step) it joins the process group and trains data-parallel (DDP / ZeRO, [parallel]).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include <iostream>
#include <nlohmann/json.hpp>

#include "checkpoint/dir_lock.hpp"
#include "cluster/topology.hpp"
#include "comm/bootstrap.hpp"
#include "coordinator/commit_registry.hpp"
#include "coordinator/store.hpp"
#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/pipeline.hpp"
#include "worker/models/hf_export.hpp"
#include "worker/models/hf_import.hpp"
#include "worker/parallel/ddp.hpp"
#include "worker/parallel/device_group.hpp"
#include "worker/train/auto_batch.hpp"
#include "worker/train/checkpointing.hpp"
#include "worker/train/data_source.hpp"
#include "worker/train/device_stats.hpp"
#include "worker/train/profiler.hpp"
#include "worker/train/stop_watchdog.hpp"
#include "worker/train/trainer.hpp"

namespace {

// Note [Preemption] (the worker's side; the launcher's is in launcher/worker_group.hpp):
// SIGUSR1 (Slurm's --signal=B:USR1@T, forwarded by the batch script, srun and dnallm-launch)
// and SIGTERM ask this worker to save and stop. The handler only stores the first signal's
// number (a lock-free atomic: async-signal-safe). Repeats are ignored on purpose: the same
// notice often arrives twice (srun signals every process of the step and dnallm-launch
// forwards it too); a stuck worker is ended by the launcher's SIGKILL after its grace period,
// and SIGINT keeps its default action. After every step every rank
// sums its flag over all ranks (one scalar allreduce, a max in effect), so all ranks stop at
// the same step even when the signal reached them at different steps; each then saves that
// step synchronously (waits for the writer and rank 0's commit), and exits with
// ExitCode::kRequeue (75).
std::atomic<int> g_preempt_signal{0};  // the only global: a signal handler needs one
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_preempt_signal(int sig) {
  int expected = 0;
  g_preempt_signal.compare_exchange_strong(expected, sig);
}

void install_preempt_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_preempt_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGUSR1, SIGTERM}) ::sigaction(sig, &sa, nullptr);
  // dnallm-launch starts workers with both blocked (Note [Early stop signals] in
  // launcher/spawner.hpp): one that arrived before this point is delivered now.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGUSR1);
  sigaddset(&stop, SIGTERM);
  ::pthread_sigmask(SIG_UNBLOCK, &stop, nullptr);
}

// Thrown from the after-step hook once the preemption checkpoint is committed.
struct Preempted {
  int64_t step = 0;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace dnallm;
  install_preempt_handlers();  // first: a stop signal must never find the default action
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
  return run_main("dnallm-train", app, argc, argv, [&]() -> int {
    Config config = resolve_config(options);
    if (options.print_config) {
      std::cout << to_toml(config);
      return 0;
    }
    init_logging("train", config.logging.level);
    std::optional<train::ProfileRange> profile_range;
    if (!profile.empty()) profile_range = train::parse_profile_range(profile, "--profile");
    // Note [Stop while blocked]: from here on (opening the data, joining the process group
    // and resuming can all block). DNALLM_STOP_GRACE_MS (default 5000) must stay below the
    // launcher's --grace-period (10 s) so that this, not SIGKILL, ends a blocked worker.
    std::chrono::milliseconds stop_grace{5000};
    if (const char* grace = std::getenv("DNALLM_STOP_GRACE_MS"); grace != nullptr && *grace)
      stop_grace = std::chrono::milliseconds(std::atoll(grace));
    train::StopWatchdog watchdog(g_preempt_signal, stop_grace, config.checkpoint.dir,
                                 [](int) { std::_Exit(static_cast<int>(ExitCode::kRequeue)); });
    watchdog.start();
    // DESIGN.md order: torchrun variables, OpenMPI, Slurm, else one process.
    const auto env = cluster::current_env();
    const cluster::Topology topo = cluster::detect_topology(env);
    const int rank = topo.rank;
    const int world = topo.world_size;
    set_log_identity(rank);
    // Note [Checkpoint directory lock] (checkpoint/dir_lock.hpp): the directory is checked and
    // owned before any training time is spent; rank 0 (the committer) holds it to the end.
    std::optional<checkpoint::DirLock> ckpt_lock;
    if (config.checkpoint.save_steps > 0 || config.checkpoint.save_final) {
      checkpoint::validate_checkpoint_dir(config.checkpoint.dir, "checkpoint.dir");
      if (rank == 0) ckpt_lock = checkpoint::DirLock::acquire(config.checkpoint.dir);
    }
    // An elastic agent's generation (docs/elastic.md): names this generation's communicator
    // and store keys; "" / 0 outside an elastic job.
    const auto gen_it = env.find("DNALLM_GENERATION");
    const std::string generation_name = gen_it != env.end() ? gen_it->second : "";
    const int64_t generation = generation_name.empty() ? 0 : std::atoll(generation_name.c_str());
    // One GPU per rank (Note [One GPU per rank]), current from here on.
    const parallel::RankDevice rank_device =
        parallel::select_rank_device(config, topo.local_rank, topo.local_world_size,
                                     topo.source == cluster::TopologySource::kSlurm ||
                                         topo.source == cluster::TopologySource::kOpenMpi);
    comm::ProcessGroup group;
    std::shared_ptr<train::GradientSync> sync = std::make_shared<train::SingleProcessSync>();
    // An explicit nccl backend builds its communicator at world size 1 too (a store in
    // memory: nothing to reach), so one GPU runs the same code path as many.
    const bool nccl_alone = world == 1 && config.parallel.backend == "nccl";
    if (world > 1 || nccl_alone) {
      comm::CommOptions wanted;
      wanted.backend = config.parallel.backend;
      wanted.device = parallel::comm_device(rank_device.device);
      wanted.device_shared = rank_device.shared;
      comm::ProcessGroupOptions po;
      po.backend = config.parallel.backend;
      po.rank = rank;
      po.world_size = world;
      po.master_addr = topo.master_addr;
      po.device = wanted.device;
      po.device_shared = wanted.device_shared;
      // Under mpirun without MASTER_ADDR, MPI bootstraps itself: no store to host or reach.
      const bool mpi = comm::resolve_backend(wanted) == "mpi";
      if (topo.source == cluster::TopologySource::kOpenMpi && mpi &&
          env.count("MASTER_ADDR") == 0) {
        po.master_addr.clear();
      }
      po.master_port = topo.master_port > 0 ? topo.master_port : 29500;
      po.rank0_hosts_store = env.count("DNALLM_EXTERNAL_COORDINATOR") == 0;
      if (auto it = env.find("DNALLM_JOB_TOKEN"); it != env.end()) po.token = it->second;
      po.timeout =
          std::chrono::milliseconds(static_cast<int64_t>(config.parallel.timeout_s * 1000));
      if (!generation_name.empty()) po.name = "g" + generation_name;
      if (nccl_alone) {
        wanted.store = std::make_shared<coordinator::InMemoryStore>();
        wanted.timeout = po.timeout;
        group.store = wanted.store;
        group.comm = comm::make_communicator(wanted);
      } else {
        group = comm::connect_process_group(po);
      }
      // Note [Staged collectives]: gloo/mpi with a CUDA model, or nccl with host scalars.
      parallel::StagingOptions staging;
      if (auto it = env.find("DNALLM_TEST_STAGE_HOST_BUFFERS"); it != env.end()) {
        staging.stage_host_buffers = it->second == "1";  // tests: the staging path on CPU
      }
      group.comm = parallel::stage_for_device(std::move(group.comm), rank_device.device, staging);
      spdlog::info("rank {} of {} ({} backend on {}, topology from {})", rank, world,
                   group.comm->backend(), rank_device.device.str(),
                   cluster::to_string(topo.source));
      sync = std::make_shared<parallel::DdpGradientSync>(
          *group.comm, parallel::ddp_options_from_config(config.parallel),
          config.training.precision);
    }
    auto tokenizer = data::make_tokenizer(config);
    const nlohmann::json tokenizer_json = tokenizer->to_json();
    // A fine-tune must tokenize as its base model did: init_from loads tensors by name and shape,
    // so another tokenizer would leave the embeddings untrained (other shape) or, with the same
    // vocabulary size, silently give every id another meaning.
    const bool init_from_hf =
        !config.model.init_from.empty() && models::is_hf_model_dir(config.model.init_from);
    if (!config.model.init_from.empty() && !init_from_hf) {
      const std::string base_path = config.model.init_from + "/tokenizer.json";
      if (std::filesystem::exists(base_path)) {
        const auto base_json = data::load_tokenizer(base_path)->to_json();
        DNALLM_CHECK(base_json == tokenizer_json, ExitCode::kUsage,
                     "model.init_from = \"{}\" was trained with the tokenizer {} but [tokenizer] "
                     "here gives {}: set [tokenizer] to the base model's settings",
                     config.model.init_from, base_json.dump(), tokenizer_json.dump());
      }
    }
    // Every rank picks (and verifies) the same newest committed checkpoint.
    auto resume = train::open_resume(config, tokenizer_json);
    if (ckpt_lock)
      checkpoint::set_aside_newer_steps(config.checkpoint.dir, resume ? resume->step() : 0);
    std::optional<data::SamplerState> sampler_state;
    if (resume) {
      sampler_state = data::SamplerState::from_json(train::saved_sampler_state(*resume));
      train::keep_global_batch(config, *resume, world);
    }
    auto model = init_from_hf ? models::init_from_hf(config, *tokenizer)
                              : train::build_model(config, tokenizer->vocab_size());
    // training.batch_size = "auto": before the loaders, which take the micro-batch size.
    train::resolve_auto_batch(config, model, *sync, topo.local_world_size);
    auto train_loader = data::make_train_loader(config, tokenizer, rank, world, sampler_state);
    const data::DataLoader* loader = train_loader.get();  // owned by the trainer below
    auto train_source = std::make_unique<train::LoaderSource>(std::move(train_loader));
    std::unique_ptr<train::BatchSource> eval_source;
    if (config.training.eval_steps > 0) {
      auto eval_loader = data::make_eval_loader(config, tokenizer, rank, world);
      if (eval_loader) {
        eval_source = std::make_unique<train::LoaderSource>(std::move(eval_loader));
      } else {
        spdlog::warn(
            "training.eval_steps = {} but there is no evaluation data (set "
            "data.eval_files or data.eval_fraction): evaluation is off",
            config.training.eval_steps);
      }
    }
    train::TrainerOptions trainer_options;
    trainer_options.bases_of_label = train::bases_of_label(tokenizer);
    // A resumed run, or a restarted elastic generation (even one with no checkpoint to
    // resume yet), continues the metrics file of the runs before it.
    trainer_options.append_metrics = resume.has_value() || generation > 1;
    trainer_options.write_tokenizer = [tokenizer, model](const std::string& dir) mutable {
      data::save_tokenizer(*tokenizer, dir + "/tokenizer.json");
      // The same model in a transformers layout that computes the same function.
      models::export_hf_directory(model, *tokenizer, dir + "/hf");
    };
    train::CheckpointerOptions ckpt_options;
    // The store's server (the coordinator, or rank 0's store) keeps the commit registry
    // (coordinator/commit_registry.hpp): shards are reported to it and it alone decides
    // retention. Without a TCP store a single process commits in process.
    ckpt_options.commit = coordinator::commit_channel_for(group.store, generation);
    ckpt_options.sampler_state = [loader] { return loader->state().to_json(); };
    ckpt_options.tokenizer = tokenizer_json;
    ckpt_options.commit_timeout =
        std::chrono::milliseconds(static_cast<int64_t>(config.parallel.timeout_s * 1000));
    if (resume) ckpt_options.resumed_step = resume->step();
    if (auto it = env.find("DNALLM_TEST_KILL_AFTER_SAVE_STEP"); it != env.end()) {
      ckpt_options.kill_after_save_step = std::stoll(it->second);
    }
    // --profile: refused here (exit 2) when this LibTorch has no Kineto.
    std::unique_ptr<train::StepProfiler> profiler;
    if (profile_range) {
      const std::string dir = config.checkpoint.dir.empty() ? "." : config.checkpoint.dir;
      profiler = std::make_unique<train::StepProfiler>(
          *profile_range, fmt::format("{}/trace_steps_{}-{}_rank_{}.json", dir,
                                      profile_range->first, profile_range->last, rank));
      train::StepProfiler* p = profiler.get();
      trainer_options.before_step = [p](train::Trainer& t, int64_t step) {
        p->before_step(step, t.device());
      };
    }
    // Declared before the trainer: its hooks call into the checkpointer.
    train::Checkpointer checkpointer(config, ckpt_options);
    checkpointer.install(trainer_options);
    // Elastic agents watch progress through this file (docs/elastic.md): the last completed
    // step, written to a temporary name and renamed so a reader never sees half a number.
    if (auto it = env.find("DNALLM_PROGRESS_FILE"); it != env.end() && !it->second.empty()) {
      const std::string path = it->second;
      auto checkpoint_hook = trainer_options.after_step;
      trainer_options.after_step = [path, checkpoint_hook](train::Trainer& t,
                                                           const train::StepResult& r) {
        if (checkpoint_hook) checkpoint_hook(t, r);
        const std::string tmp = path + ".tmp";
        {
          std::ofstream out(tmp, std::ios::trunc);
          // Line 2, the pid: the agent checks whether this process is stopped when the job
          // stalls (Note [Hang culprit] in coordinator/elastic_state.cpp).
          out << r.step << "\n" << ::getpid() << "\n";
        }
        std::rename(tmp.c_str(), path.c_str());
      };
    }
    {
      // Test only: sleep this long after every step, so that a test can signal a run of a
      // tiny model while it still runs however fast the machine is.
      std::chrono::milliseconds step_delay{0};
      if (auto it = env.find("DNALLM_TEST_STEP_DELAY_MS"); it != env.end()) {
        step_delay = std::chrono::milliseconds(std::atoll(it->second.c_str()));
      }
      auto inner = trainer_options.after_step;
      const int64_t save_steps = config.checkpoint.save_steps;
      trainer_options.after_step = [inner, &checkpointer, step_delay, save_steps, &watchdog](
                                       train::Trainer& t, const train::StepResult& r) {
        watchdog.step_boundary();
        if (inner) inner(t, r);
        if (step_delay.count() > 0) std::this_thread::sleep_for(step_delay);
        // Collective: every rank calls it after every step (Note [Preemption]).
        const int own = g_preempt_signal.load();
        if (t.sync().sum_scalar(own != 0 ? 1.0 : 0.0) == 0.0) return;
        const std::string why =
            own != 0 ? fmt::format("received {}", own == SIGUSR1 ? "SIGUSR1" : "SIGTERM")
                     : std::string("a peer rank was signalled");
        spdlog::warn("preemption ({}): saving step {} and stopping", why, r.step);
        if (save_steps <= 0) {
          spdlog::warn(
              "checkpoint.save_steps = 0: saving step {} anyway so that the requeued "
              "job can resume",
              r.step);
          checkpointer.save(t);
        }
        // Saves this step unless the save_steps hook just did, then waits for the writer and
        // rank 0's commit.
        checkpointer.finish(t);
        nlohmann::ordered_json line;
        line["event"] = "preempted";
        line["step"] = r.step;
        line["reason"] = why;
        line["exit_code"] = static_cast<int>(ExitCode::kRequeue);
        t.write_metrics(line);
        throw Preempted{r.step};
      };
    }
    if (profiler) {
      auto inner = trainer_options.after_step;
      train::StepProfiler* p = profiler.get();
      trainer_options.after_step = [inner, p](train::Trainer& t, const train::StepResult& r) {
        p->after_step(r.step);  // before the checkpoint hooks: the trace holds the steps only
        if (inner) inner(t, r);
      };
    }
    train::Trainer trainer(config, std::move(model), std::move(train_source),
                           std::move(eval_source), sync, trainer_options);
    if (resume) train::restore(trainer, *resume);
    // Model-state bytes on this rank, measured from the buffers, beside the ZeRO paper's
    // accounting for the same parameter count, precision, stage and world size.
    {
      auto ddp = std::dynamic_pointer_cast<parallel::DdpGradientSync>(sync);
      parallel::MemoryAccount allocated, paper;
      if (ddp) {
        allocated = ddp->allocated_memory();
        paper = ddp->paper_memory();
      } else {
        const int64_t n = trainer.flat().numel();
        allocated = {n * 4, n * 4, n * 8};
        paper = parallel::account_memory(n, config.training.precision, 0, 1);
      }
      nlohmann::ordered_json line;
      line["event"] = "memory";
      line["rank"] = rank;
      line["parameters"] = trainer.flat().numel();
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
      line["zero_paper_bytes"] = {
          {"params", paper.params}, {"grads", paper.grads}, {"optimizer", paper.optimizer}};
      const auto gpu = train::device_memory_stats(trainer.device());
      if (gpu.available) {
        line["peak_gpu_mb"] = gpu.peak_allocated_mb;
        line["peak_gpu_reserved_mb"] = gpu.peak_reserved_mb;
      }
      trainer.write_metrics(line);
    }
    if (generation > 1) {
      nlohmann::ordered_json line;
      line["event"] = "restart";
      line["generation"] = generation;
      auto reason = env.find("DNALLM_RESTART_REASON");
      line["reason"] = reason != env.end() ? reason->second : "";
      trainer.write_metrics(line);
    }
    try {
      trainer.run();
    } catch (const Preempted& p) {
      spdlog::warn(
          "checkpoint of step {} committed under {}; exiting with code {} so that the "
          "job is requeued and resumes from it",
          p.step, config.checkpoint.dir, static_cast<int>(ExitCode::kRequeue));
      return static_cast<int>(ExitCode::kRequeue);
    }
    return 0;
  });
}
