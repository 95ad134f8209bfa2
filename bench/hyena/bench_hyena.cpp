// dnallm-bench-hyena: forward + backward of a HyenaDNA-shaped model (worker/models/hyena) at one
// sequence length, the number bench/hyena/bench_hyena.sh sets beside the reference's (LongSafari's
// hub code, bench/hyena/hyena_peer.py) with the same shape, batch, length and threads.
// Prints one JSON line: tokens/s, seconds per step, peak RSS.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/step_bench.hpp"
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
  nlohmann::ordered_json fields;
  fields["impl"] = "dnallm";
  fields["d_model"] = o.d_model;
  fields["layers"] = o.n_layer;
  fields["seq"] = seq;
  fields["batch"] = batch;
  fields["threads"] = torch::get_num_threads();
  dnallm::bench::time_steps_and_print(step, warmup, steps, double(batch * seq), fields);
  return 0;
}
