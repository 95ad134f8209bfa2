// bench/infer: inference paths against their plain peer, measured in the same run.
//   generate  tokens/s with the KV cache vs recomputing the prefix (GPT, 512 new tokens)
//   int8      INT8 dynamic-quantised linear vs fp32 linear (CPU), and the weight bytes
//   int8-model  with --model DIR: bits per token of an exported causal LM, fp32 vs INT8
//   nf4       QLoRA base memory: NF4 bytes vs bf16 bytes of the same block linears, and the
//             time of a forward with on-the-fly dequantisation vs bf16/fp32 weights
// Each prints warm-up, iterations, median seconds and the ratio; sizes are flags so a GPU
// node can run the large shapes. Embedding throughput against a PyTorch batch loop is
// bench/infer/bench_embed.sh (it needs the Python peer).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "worker/data/tokenizer.hpp"
#include "worker/infer/inference.hpp"
#include "worker/models/transformer/quantized_linear.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace {

using namespace dnallm;

struct Timing {
  double median_s = 0, min_s = 0;
};

Timing time_it(int warmup, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front()};
}

void row(const char* what, const char* variant, int warmup, int iters, const Timing& t,
         const std::string& extra) {
  fmt::print("{:<10} {:<14} {:>6} {:>5} {:>11.5f} {:>11.5f}  {}\n", what, variant, warmup, iters,
             t.median_s, t.min_s, extra);
}

void header() {
  fmt::print("{:<10} {:<14} {:>6} {:>5} {:>11} {:>11}  {}\n", "bench", "variant", "warmup", "iters",
             "median_s", "min_s", "rate / ratio");
}

// BERT-shaped: heads of 64, FFN 4x hidden, char vocabulary.
models::ModelOptions model_options(models::Arch arch, models::Task task, int64_t hidden,
                                   int64_t layers, int64_t max_seq) {
  models::ModelOptions o;
  o.arch = arch;
  o.task = task;
  o.vocab_size = 10;
  o.hidden = hidden;
  o.layers = layers;
  o.heads = std::max<int64_t>(1, hidden / 64);
  o.ffn = 4 * hidden;
  o.max_seq_length = max_seq;
  return o;
}

void bench_generate(int64_t hidden, int64_t layers, int64_t new_tokens, int64_t batch, int iters) {
  auto o =
      model_options(models::Arch::kGpt, models::Task::kPretrain, hidden, layers, new_tokens + 64);
  torch::manual_seed(1);
  models::TransformerLM model(o);
  model->eval();
  auto prompt = torch::randint(5, 9, {batch, 16});
  models::GenerateOptions g;
  g.max_new_tokens = new_tokens;
  torch::Tensor with, without;
  g.use_cache = true;
  auto cached = time_it(1, iters, [&] { with = model->generate(prompt, g); });
  g.use_cache = false;
  auto full = time_it(0, iters, [&] { without = model->generate(prompt, g); });
  const double tokens = double(batch * new_tokens);
  row("generate", "kv-cache", 1, iters, cached,
      fmt::format("{:.0f} tok/s", tokens / cached.median_s));
  row("generate", "no-cache", 0, iters, full,
      fmt::format("{:.0f} tok/s  ratio cache/no-cache {:.2f}x  same tokens: {}",
                  tokens / full.median_s, full.median_s / cached.median_s,
                  torch::equal(with, without) ? "yes" : "NO"));
}

void bench_int8(int64_t in, int64_t out, int64_t tokens, int iters) {
  torch::manual_seed(2);
  auto w = torch::randn({out, in}) * 0.02;
  auto b = torch::zeros({out});
  auto x = torch::randn({tokens, in});
  auto q = models::make_int8_weight(w, b);
  torch::InferenceMode mode;
  torch::Tensor y32, y8;
  auto fp32 = time_it(3, iters, [&] { y32 = torch::nn::functional::linear(x, w, b); });
  auto int8 = time_it(3, iters, [&] { y8 = q->linear(x, b); });
  const double flops = 2.0 * double(in * out * tokens);
  const double rel = ((y8 - y32).pow(2).mean().sqrt() / y32.pow(2).mean().sqrt()).item<double>();
  const std::string shape = fmt::format("[{}x{}]x[{}x{}]", tokens, in, in, out);
  row("int8", "fp32 linear", 3, iters, fp32,
      fmt::format("{:.1f} GFLOP/s {}  {:.2f} MB", flops / fp32.median_s / 1e9, shape,
                  double(w.numel() * 4) / 1e6));
  row("int8", "int8 linear", 3, iters, int8,
      fmt::format("{:.1f} GFLOP/s  ratio int8/fp32 speed {:.2f}x  size {:.3f}x  rel rms err {:.4f}",
                  flops / int8.median_s / 1e9, fp32.median_s / int8.median_s,
                  double(q->bytes()) / double(w.numel() * 4), rel));
}

void bench_nf4(int64_t hidden, int64_t layers, int64_t tokens, int iters) {
  auto o =
      model_options(models::Arch::kBert, models::Task::kClassification, hidden, layers, tokens);
  o.lora_r = 8;
  o.lora_targets = {"query", "key", "value", "dense"};
  torch::manual_seed(3);
  models::TransformerLM model(o);
  models::ForwardInputs in;
  in.input_ids = torch::randint(5, 9, {4, tokens});
  in.labels = torch::randint(0, 2, {4});
  auto step = [&] {
    auto r = model->forward(in);
    r.loss_sum.backward();
  };
  model->train();
  auto plain = time_it(1, iters, step);
  const auto report = models::quantize_linears(*model, models::WeightFormat::kNf4);
  auto nf4 = time_it(1, iters, step);
  row("qlora", "fp32 base", 1, iters, plain,
      fmt::format("fwd+bwd [4x{}], {} layers x {} hidden", tokens, layers, hidden));
  row("qlora", "nf4 base", 1, iters, nf4,
      fmt::format("time ratio nf4/fp32 {:.2f}x  base memory: bf16 {:.2f} MB, nf4 {:.2f} MB, "
                  "ratio {:.3f}x ({} linears)",
                  nf4.median_s / plain.median_s, report.bf16_bytes() / 1e6,
                  report.quantized_bytes / 1e6,
                  double(report.quantized_bytes) / double(report.bf16_bytes()), report.linears));
}

// Accuracy of --quantize int8 on real data: bits per token of an exported causal LM on
// windows of a FASTA file, fp32 vs INT8 (char tokens: bits per base), and the forward time.
void bench_int8_model(const std::string& dir, const std::string& fasta, int64_t windows) {
  auto model = models::load_exported_model(dir);
  const auto& o = model->spec();
  if (o.arch != models::Arch::kGpt || o.task != models::Task::kPretrain) {
    fmt::print("int8-model: {} is not a causal LM; skipped\n", dir);
    return;
  }
  auto tok = data::load_tokenizer(dir + "/tokenizer.json");
  std::vector<std::vector<int64_t>> rows;
  infer::SequenceInput input(fasta);
  infer::InputSequence rec;
  const auto len = static_cast<size_t>(o.max_seq_length - 1);
  while (int64_t(rows.size()) < windows && input.next(rec)) {
    for (size_t at = 0; at + len <= rec.bases.size() && int64_t(rows.size()) < windows; at += len) {
      rows.push_back(infer::frame_sequence(*tok, o, rec.bases.substr(at, len)));
    }
  }
  torch::InferenceMode mode;
  auto score = [&](double* bits) {
    double nats = 0;
    int64_t count = 0;
    for (size_t at = 0; at < rows.size(); at += 8) {
      std::vector<std::vector<int64_t>> batch(rows.begin() + at,
                                              rows.begin() + std::min(rows.size(), at + 8));
      auto in = infer::pad_batch(batch, o.pad_id, torch::kCPU);
      in.labels = in.input_ids.masked_fill(in.input_ids.lt(data::kFirstRegularId), -100);
      auto r = model->forward(in);
      nats += r.loss_sum.item<double>();
      count += r.loss_count;
    }
    *bits = nats / double(std::max<int64_t>(count, 1)) / std::log(2.0);
  };
  double fp32_bits = 0, int8_bits = 0;
  auto fp32 = time_it(1, 3, [&] { score(&fp32_bits); });
  const auto report = models::quantize_linears(*model, models::WeightFormat::kInt8);
  auto int8 = time_it(1, 3, [&] { score(&int8_bits); });
  row("int8-model", "fp32", 1, 3, fp32,
      fmt::format("{:.4f} bits/token on {} windows of {} tokens", fp32_bits, rows.size(),
                  o.max_seq_length));
  row("int8-model", "int8", 1, 3, int8,
      fmt::format("{:.4f} bits/token (change {:+.4f})  speed ratio {:.2f}x  block linears "
                  "{:.2f} MB -> {:.2f} MB",
                  int8_bits, int8_bits - fp32_bits, fp32.median_s / int8.median_s,
                  report.fp32_bytes() / 1e6, report.quantized_bytes / 1e6));
}

// The command line: each benchmark's sizes, and which of them to run.
struct BenchOptions {
  int64_t gen_hidden = 128, gen_layers = 4, new_tokens = 512, gen_batch = 4;
  int64_t lin_in = 768, lin_out = 3072, lin_tokens = 512;
  int64_t q_hidden = 768, q_layers = 2, q_tokens = 128;
  int iters = 5, threads = 0;
  std::vector<std::string> only;
  std::string model_dir, fasta = "data/ecoli_k12_mg1655.fa.gz";
  int64_t windows = 64;
};

void add_options(CLI::App& app, BenchOptions& b) {
  app.add_option("--gen-hidden", b.gen_hidden)->capture_default_str();
  app.add_option("--gen-layers", b.gen_layers)->capture_default_str();
  app.add_option("--new-tokens", b.new_tokens)->capture_default_str();
  app.add_option("--gen-batch", b.gen_batch)->capture_default_str();
  app.add_option("--linear-in", b.lin_in)->capture_default_str();
  app.add_option("--linear-out", b.lin_out)->capture_default_str();
  app.add_option("--linear-tokens", b.lin_tokens)->capture_default_str();
  app.add_option("--qlora-hidden", b.q_hidden)->capture_default_str();
  app.add_option("--qlora-layers", b.q_layers)->capture_default_str();
  app.add_option("--qlora-tokens", b.q_tokens)->capture_default_str();
  app.add_option("--iters", b.iters, "timed iterations (generation: at least 1)")
      ->capture_default_str();
  app.add_option("--threads", b.threads, "intra-op threads (0: LibTorch's default)");
  app.add_option("--only", b.only, "generate | int8 | nf4 | int8-model (repeatable; default all)");
  app.add_option("--model", b.model_dir, "int8-model: an exported causal LM (dnallm-train final/)");
  app.add_option("--fasta", b.fasta, "int8-model: sequences to score")->capture_default_str();
  app.add_option("--windows", b.windows, "int8-model: windows to score")->capture_default_str();
}

// The benchmarks --only names (all without it), a table row or two each.
void run_selected(const BenchOptions& b) {
  auto wants = [&](const char* name) {
    return b.only.empty() || std::find(b.only.begin(), b.only.end(), name) != b.only.end();
  };
  if (wants("int8")) bench_int8(b.lin_in, b.lin_out, b.lin_tokens, b.iters);
  if (wants("int8-model") && !b.model_dir.empty()) {
    bench_int8_model(b.model_dir, b.fasta, b.windows);
  }
  if (wants("nf4")) bench_nf4(b.q_hidden, b.q_layers, b.q_tokens, std::max(1, b.iters / 2));
  if (wants("generate")) {
    torch::InferenceMode mode;
    bench_generate(b.gen_hidden, b.gen_layers, b.new_tokens, b.gen_batch, std::max(1, b.iters / 3));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dnallm-bench-infer: KV-cache generation, INT8 linear and NF4 QLoRA base vs "
      "their plain peers (ratios in one run)"};
  BenchOptions b;
  add_options(app, b);
  CLI11_PARSE(app, argc, argv);
  if (b.threads > 0) torch::set_num_threads(b.threads);
  fmt::print("bench/infer: LibTorch threads {}\n", torch::get_num_threads());
  header();
  run_selected(b);
  return 0;
}
