// dnallm-infer: batched inference with a model directory (Note [One model loader]: dnallm-train's
// <checkpoint.dir>/final, a Hugging Face directory as downloaded, a PEFT adapter): `embed` (pooled
// or per-token embeddings to .npy/.safetensors), `generate` (causal LM continuation of prompts, KV
// cache), `predict` (classifier labels and probabilities), `variants` and `mutagenesis` (zero-shot
// variant effects). A separate binary from dnallm-eval (which scores) so that each stays small;
// each subcommand is a cli_<name>.cpp beside this file (cli_common.hpp); see docs/inference.md.
#include "core/cli.hpp"
#include "worker/infer/cli_common.hpp"

int main(int argc, char** argv) {
  using namespace dnallm;
  CLI::App app{
      "dnallm-infer: batched inference with an exported model. Exit codes: 0 ok, 2 usage, 3 bad "
      "data, 4 a peer rank failed, 5 a damaged model file."};
  app.require_subcommand(1);
  std::vector<std::unique_ptr<infer::cli::Command>> commands;
  for (auto* add : {infer::cli::add_embed, infer::cli::add_generate, infer::cli::add_predict,
                    infer::cli::add_variants, infer::cli::add_mutagenesis}) {
    commands.push_back(add(app));
  }
  return run_main("dnallm-infer", app, argc, argv, [&]() -> int {
    const auto env = cluster::current_env();
    const auto topo = cluster::detect_topology(env);
    for (const auto& c : commands) {
      if (c->parsed()) return c->run(topo, env);
    }
    return 2;  // (require_subcommand(1): CLI11 refused the command line before)
  });
}
