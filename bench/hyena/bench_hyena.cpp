// dnallm-bench-hyena: forward + backward of a HyenaDNA-shaped model (worker/models/hyena) at one
// sequence length, the number bench/hyena/bench_hyena.sh sets beside the reference's (LongSafari's
// hub code, bench/hyena/hyena_peer.py) with the same shape, batch, length and threads.
// Prints one JSON line: tokens/s, seconds per step, peak RSS.
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "worker/models/hyena/hyena.hpp"

int main(int argc, char** argv) {
  using dnallm::models::hyena::HyenaLM;
  using dnallm::models::hyena::HyenaOptions;
  HyenaOptions o;
  int64_t seq = 32768, batch = 1, steps = 3, warmup = 1;
  CLI::App app{"HyenaDNA forward + backward throughput (see bench/hyena/bench_hyena.sh)"};
  app.add_option("--d-model", o.d_model);
  app.add_option("--d-inner", o.d_inner);
  app.add_option("--layers", o.n_layer);
  app.add_option("--seq", seq);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_flag("--checkpoint", o.gradient_checkpointing, "activation checkpointing per block");
  CLI11_PARSE(app, argc, argv);
  o.max_seq_len = seq + 2;
  o.emb_dim = 5;
  o.filter_order = 64;
  o.activation_freq = 10;
  torch::manual_seed(0);
  HyenaLM model(o);
  model->train();
  auto ids = torch::randint(7, 12, {batch, seq});
  auto step = [&] {
    auto logits = model->forward(ids);
    auto loss = torch::nn::functional::cross_entropy(
        logits.slice(1, 0, seq - 1).reshape({-1, logits.size(-1)}), ids.slice(1, 1).reshape({-1}));
    model->zero_grad();
    loss.backward();
  };
  for (int64_t i = 0; i < warmup; ++i) step();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) step();
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  nlohmann::ordered_json out;
  out["impl"] = "dnallm";
  out["d_model"] = o.d_model;
  out["layers"] = o.n_layer;
  out["seq"] = seq;
  out["batch"] = batch;
  out["threads"] = torch::get_num_threads();
  out["step_s"] = s;
  out["tokens_per_s"] = double(batch * seq) / s;
  out["peak_rss_mb"] = double(ru.ru_maxrss) / 1024.0;
  std::cout << out.dump() << std::endl;
  return 0;
}
