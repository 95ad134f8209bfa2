// dnallm-bench-hyena: forward + backward of a HyenaDNA-shaped model (worker/models/hyena) at one
// sequence length, the number bench/hyena/bench_hyena.sh sets beside the reference's (LongSafari's
// hub code, bench/hyena/hyena_peer.py) with the same shape, batch, length and threads.
// Prints one JSON line: tokens/s, seconds per step, peak RSS.
// --measure-memory: one forward + backward (no warm-up) at --seq, printing the process's peak
// resident memory (VmHWM) and its resident memory before the step (VmRSS: the model, its
// gradients' first allocation excluded), seconds, bytes a token ((peak - before) / tokens), and
// one prediction line a length of --predict (before + bytes a token x length): the numbers of
// docs/long-context.md.
//   dnallm-bench-hyena --measure-memory --seq 1048576 --max-seq-len 1048576 --checkpoint
//     --chunk-positions 16384 --chunk-channels 16   (one command line)
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/step_bench.hpp"
#include "worker/models/hyena/hyena.hpp"

namespace {

// A "VmHWM:" or "VmRSS:" line of /proc/self/status in MB (-1 where there is none).
double proc_status_mb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream fields(line.substr(key.size() + 1));
      double kb = 0;
      fields >> kb;
      return kb / 1024.0;
    }
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  using dnallm::models::hyena::HyenaLM;
  using dnallm::models::hyena::HyenaOptions;
  HyenaOptions o;
  int64_t seq = 32768, batch = 1, steps = 3, warmup = 1, max_seq_len = 0;
  bool measure_memory = false;
  std::vector<int64_t> predict{131072, 1048576};
  CLI::App app{"HyenaDNA forward + backward throughput (see bench/hyena/bench_hyena.sh)"};
  app.add_option("--d-model", o.d_model);
  app.add_option("--d-inner", o.d_inner);
  app.add_option("--layers", o.n_layer);
  app.add_option("--seq", seq);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--max-seq-len", max_seq_len, "the model's max_seq_len (default: --seq + 2)");
  app.add_flag("--checkpoint", o.gradient_checkpointing, "activation checkpointing per block");
  app.add_option("--chunk-positions", o.chunking.positions,
                 "Note [Hyena chunked block]: position-wise parts in pieces of this many");
  app.add_option("--chunk-channels", o.chunking.channels,
                 "Note [Hyena chunked block]: the long convolution this many channels at a time");
  app.add_flag("--measure-memory", measure_memory,
               "one step: peak resident memory, seconds, bytes a token, predictions");
  app.add_option("--predict", predict, "lengths to predict peak memory for (--measure-memory)");
  std::string profile;
  app.add_option(
      "--profile", profile,
      "after the timed steps, one more under LibTorch's profiler, its trace to this file "
      "(Chrome's trace format: chrome://tracing, or summed per operator with "
      "bench/hyena/profile_summary.py)");
  CLI11_PARSE(app, argc, argv);
  o.max_seq_len = max_seq_len > 0 ? max_seq_len : seq + 2;
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
  if (measure_memory) {
    const double before = proc_status_mb("VmRSS");
    const auto start = std::chrono::steady_clock::now();
    step();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double peak = proc_status_mb("VmHWM");
    const double tokens = double(batch * seq);
    const double per_token = (peak - before) * 1024 * 1024 / tokens;
    nlohmann::ordered_json m;
    m["impl"] = "dnallm";
    m["d_model"] = o.d_model;
    m["d_inner"] = o.d_inner;
    m["layers"] = o.n_layer;
    m["max_seq_len"] = o.max_seq_len;
    m["seq"] = seq;
    m["batch"] = batch;
    m["checkpoint"] = o.gradient_checkpointing;
    m["chunk_positions"] = o.chunking.positions;
    m["chunk_channels"] = o.chunking.channels;
    m["threads"] = torch::get_num_threads();
    m["step_s"] = seconds;
    m["rss_before_mb"] = before;
    m["peak_rss_mb"] = peak;
    m["bytes_per_token"] = per_token;
    std::cout << m.dump() << std::endl;
    for (const int64_t length : predict) {
      nlohmann::ordered_json p;
      p["prediction"] = "rss_before_mb + bytes_per_token x tokens";
      p["seq"] = length;
      p["peak_rss_mb"] = before + per_token * double(batch * length) / (1024 * 1024);
      std::cout << p.dump() << std::endl;
    }
    return 0;
  }
  nlohmann::ordered_json fields;
  fields["impl"] = "dnallm";
  fields["d_model"] = o.d_model;
  fields["layers"] = o.n_layer;
  fields["seq"] = seq;
  fields["batch"] = batch;
  fields["threads"] = torch::get_num_threads();
  dnallm::bench::time_steps_and_print(step, warmup, steps, double(batch * seq), fields);
  if (!profile.empty()) {
    torch::autograd::profiler::RecordProfile guard(profile);
    step();
  }
  return 0;
}
