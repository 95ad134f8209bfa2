// dnallm-train: one training worker (single process until the DDP engine is wired in).
#include <cstdlib>
#include <iostream>

#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/pipeline.hpp"
#include "worker/train/data_source.hpp"
#include "worker/train/trainer.hpp"

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  try {
    return std::stoi(v);
  } catch (const std::exception&) {
    dnallm::fail(dnallm::ExitCode::kUsage, "environment variable {}=\"{}\" is not an integer",
                 name, v);
  }
}

// DESIGN.md order: torchrun variables, OpenMPI, Slurm, else one process.
std::pair<int, int> rank_and_world() {
  if (std::getenv("WORLD_SIZE") != nullptr) return {env_int("RANK", 0), env_int("WORLD_SIZE", 1)};
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    return {env_int("OMPI_COMM_WORLD_RANK", 0), env_int("OMPI_COMM_WORLD_SIZE", 1)};
  }
  if (std::getenv("SLURM_NTASKS") != nullptr && std::getenv("SLURM_PROCID") != nullptr) {
    return {env_int("SLURM_PROCID", 0), env_int("SLURM_NTASKS", 1)};
  }
  return {0, 1};
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dnallm;
  CLI::App app{
      "dnallm-train: train a DNA language model (BERT masked LM, GPT causal LM, or a\n"
      "classification/regression fine-tune) from a TOML configuration. Writes JSON Lines\n"
      "metrics from rank 0 and exports <checkpoint.dir>/final at the end."};
  ConfigOptions options;
  add_config_options(app, options);
  return run_main("dnallm-train", app, argc, argv, [&]() -> int {
    Config config = resolve_config(options);
    if (options.print_config) {
      std::cout << to_toml(config);
      return 0;
    }
    init_logging("train", config.logging.level);
    const auto [rank, world] = rank_and_world();
    set_log_identity(rank);
    DNALLM_CHECK(world == 1, ExitCode::kUsage,
                 "WORLD_SIZE={} (rank {}) but this dnallm-train runs a single process: "
                 "multi-process data parallelism is not wired in yet; run with WORLD_SIZE=1",
                 world, rank);
    auto tokenizer = data::make_tokenizer(config);
    auto model = train::build_model(config, tokenizer->vocab_size());
    auto train_source = std::make_unique<train::LoaderSource>(
        data::make_train_loader(config, tokenizer, rank, world));
    std::unique_ptr<train::BatchSource> eval_source;
    if (config.training.eval_steps > 0) {
      auto eval_loader = data::make_eval_loader(config, tokenizer, rank, world);
      if (eval_loader) {
        eval_source = std::make_unique<train::LoaderSource>(std::move(eval_loader));
      } else {
        spdlog::warn("training.eval_steps = {} but there is no evaluation data (set "
                     "data.eval_files or data.eval_fraction): evaluation is off",
                     config.training.eval_steps);
      }
    }
    train::TrainerOptions trainer_options;
    trainer_options.bases_of_label = train::bases_of_label(tokenizer);
    trainer_options.write_tokenizer = [tokenizer](const std::string& dir) {
      data::save_tokenizer(*tokenizer, dir + "/tokenizer.json");
    };
    train::Trainer trainer(config, std::move(model), std::move(train_source),
                           std::move(eval_source), std::make_shared<train::SingleProcessSync>(),
                           trainer_options);
    trainer.run();
    return 0;
  });
}
