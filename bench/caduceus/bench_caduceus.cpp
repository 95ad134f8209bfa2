// dnallm-bench-caduceus: forward + backward of a Caduceus-shaped model (worker/models/caduceus)
// at one sequence length, the number bench/caduceus/bench_caduceus.sh sets beside the
// reference's (kuleshov-group's code over mamba-ssm's pure-PyTorch scan, caduceus_peer.py) with
// the same shape, batch, length, loss and threads. Prints one JSON line.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/step_bench.hpp"
#include "worker/models/caduceus/caduceus.hpp"

int main(int argc, char** argv) {
  using dnallm::models::caduceus::CaduceusLM;
  using dnallm::models::caduceus::CaduceusOptions;
  CaduceusOptions o;
  o.d_model = 128, o.n_layer = 4, o.d_state = 16, o.vocab_size = 16;
  int64_t seq = 4096, batch = 1, steps = 2, warmup = 1;
  CLI::App app{"Caduceus forward + backward throughput (see bench/caduceus/bench_caduceus.sh)"};
  app.add_option("--d-model", o.d_model);
  app.add_option("--layers", o.n_layer);
  app.add_option("--d-state", o.d_state);
  app.add_option("--seq", seq);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_flag("--rcps", o.rcps, "Caduceus-PS (reverse-complement parameter sharing)");
  CLI11_PARSE(app, argc, argv);
  o.dt_rank = (o.d_model + 15) / 16;
  o.complement = {0, 1, 2, 3, 4, 5, 6, 10, 9, 8, 7, 11};
  torch::manual_seed(0);
  CaduceusLM model(o);
  model->train();
  auto ids = torch::randint(7, 12, {batch, seq});
  auto step = [&] {
    auto logits = model->forward(ids);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                     ids.reshape({-1}));
    model->zero_grad();
    loss.backward();
  };
  nlohmann::ordered_json fields;
  fields["impl"] = "dnallm";
  fields["d_model"] = o.d_model;
  fields["layers"] = o.n_layer;
  fields["rcps"] = o.rcps;
  fields["seq"] = seq;
  fields["batch"] = batch;
  fields["threads"] = torch::get_num_threads();
  dnallm::bench::time_steps_and_print(step, warmup, steps, double(batch * seq), fields);
  return 0;
}
