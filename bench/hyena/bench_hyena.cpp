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
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/proc_status.hpp"
#include "bench/step_bench.hpp"
#include "worker/models/hyena/hyena.hpp"

namespace {

using dnallm::bench::proc_status_mb;

// The command line: the model's shape and the run's.
struct BenchOptions {
  dnallm::models::hyena::HyenaOptions model;
  int64_t seq = 32768, batch = 1, steps = 3, warmup = 1, max_seq_len = 0;
  bool measure_memory = false;
  std::vector<int64_t> predict{131072, 1048576};
  std::string profile;
};

void add_options(CLI::App& app, BenchOptions& b) {
  auto& o = b.model;
  app.add_option("--d-model", o.d_model);
  app.add_option("--d-inner", o.d_inner);
  app.add_option("--layers", o.n_layer);
  app.add_option("--seq", b.seq);
  app.add_option("--batch", b.batch);
  app.add_option("--steps", b.steps);
  app.add_option("--warmup", b.warmup);
  app.add_option("--max-seq-len", b.max_seq_len, "the model's max_seq_len (default: --seq + 2)");
  app.add_flag("--checkpoint", o.gradient_checkpointing, "activation checkpointing per block");
  app.add_option("--chunk-positions", o.chunking.positions,
                 "Note [Hyena chunked block]: position-wise parts in pieces of this many");
  app.add_option("--chunk-channels", o.chunking.channels,
                 "Note [Hyena chunked block]: the long convolution this many channels at a time");
  app.add_flag("--measure-memory", b.measure_memory,
               "one step: peak resident memory, seconds, bytes a token, predictions");
  app.add_option("--predict", b.predict, "lengths to predict peak memory for (--measure-memory)");
  app.add_option(
      "--profile", b.profile,
      "after the timed steps, one more under LibTorch's profiler, its trace to this file "
      "(Chrome's trace format: chrome://tracing, or summed per operator with "
      "bench/hyena/profile_summary.py)");
}

// The benchmark's fixed model settings, and max_seq_len from the command line or --seq.
void finish_model_options(BenchOptions& b) {
  auto& o = b.model;
  o.max_seq_len = b.max_seq_len > 0 ? b.max_seq_len : b.seq + 2;
  o.emb_dim = 5;
  o.filter_order = 64;
  o.activation_freq = 10;
}

// --measure-memory: one step, its peak resident memory and the predictions (lines as in the
// header).
void measure_memory_and_print(const std::function<void()>& step, const BenchOptions& b) {
  const auto& o = b.model;
  const double before = proc_status_mb("VmRSS");
  const auto start = std::chrono::steady_clock::now();
  step();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double peak = proc_status_mb("VmHWM");
  const double tokens = double(b.batch * b.seq);
  const double per_token = (peak - before) * 1024 * 1024 / tokens;
  nlohmann::ordered_json m;
  m["impl"] = "dnallm";
  m["d_model"] = o.d_model;
  m["d_inner"] = o.d_inner;
  m["layers"] = o.n_layer;
  m["max_seq_len"] = o.max_seq_len;
  m["seq"] = b.seq;
  m["batch"] = b.batch;
  m["checkpoint"] = o.gradient_checkpointing;
  m["chunk_positions"] = o.chunking.positions;
  m["chunk_channels"] = o.chunking.channels;
  m["threads"] = torch::get_num_threads();
  m["step_s"] = seconds;
  m["rss_before_mb"] = before;
  m["peak_rss_mb"] = peak;
  m["bytes_per_token"] = per_token;
  std::cout << m.dump() << std::endl;
  for (const int64_t length : b.predict) {
    nlohmann::ordered_json p;
    p["prediction"] = "rss_before_mb + bytes_per_token x tokens";
    p["seq"] = length;
    p["peak_rss_mb"] = before + per_token * double(b.batch * length) / (1024 * 1024);
    std::cout << p.dump() << std::endl;
  }
}

// Warm-up and timed steps (one JSON line), then --profile's step under the profiler.
void time_and_print(const std::function<void()>& step, const BenchOptions& b) {
  nlohmann::ordered_json fields;
  fields["impl"] = "dnallm";
  fields["d_model"] = b.model.d_model;
  fields["layers"] = b.model.n_layer;
  fields["seq"] = b.seq;
  fields["batch"] = b.batch;
  fields["threads"] = torch::get_num_threads();
  dnallm::bench::time_steps_and_print(step, b.warmup, b.steps, double(b.batch * b.seq), fields);
  if (!b.profile.empty()) {
    torch::autograd::profiler::RecordProfile guard(b.profile);
    step();
  }
}

}  // namespace

int main(int argc, char** argv) {
  BenchOptions b;
  CLI::App app{"HyenaDNA forward + backward throughput (see bench/hyena/bench_hyena.sh)"};
  add_options(app, b);
  CLI11_PARSE(app, argc, argv);
  finish_model_options(b);
  torch::manual_seed(0);
  dnallm::models::hyena::HyenaLM model(b.model);
  model->train();
  const int64_t seq = b.seq;
  auto ids = torch::randint(7, 12, {b.batch, seq});
  auto step = [&] {
    auto logits = model->forward(ids);
    auto loss = torch::nn::functional::cross_entropy(
        logits.slice(1, 0, seq - 1).reshape({-1, logits.size(-1)}), ids.slice(1, 1).reshape({-1}));
    model->zero_grad();
    loss.backward();
  };
  if (b.measure_memory) {
    measure_memory_and_print(step, b);
  } else {
    time_and_print(step, b);
  }
  return 0;
}
