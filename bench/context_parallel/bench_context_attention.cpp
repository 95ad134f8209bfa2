// dnallm-bench-context-attention: attention context parallelism's forward + backward
// (models::context_attention, Note [Attention context parallelism]) at C ranks over gloo, one
// process with a thread a rank (loopback TCP between them), with the K/V exchange overlapped
// with the local blocks against the same call waiting for it first (the previous order:
// AttentionContext::overlap_exchange = false), measured alternately in the same run.
// Per length: both orders' median step (the slower rank's time of each step), the median of
// their ratio step by step, the exchange alone (the all-gather of k and v, then the
// reduce-scatter of their gradient, waited for: the time there is to hide), and the time each
// order spent blocked in the exchanges' waits on the less blocked rank
// (ContextAttentionCounts::seconds_waiting: what the overlap hid is the difference, even where
// the machine's noise hides it in the step).
//   dnallm-bench-context-attention [--lengths 1024 4096] [--ranks 2] [--heads 4] [--head-dim 32]
//     [--batch 1] [--causal] [--threads 1] [--warmup 2] [--iters 10]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "comm/communicator.hpp"
#include "comm/make_communicator.hpp"
#include "coordinator/store.hpp"
#include "worker/models/transformer/context_attention.hpp"
#include "worker/tensor_buffer.hpp"

namespace {

using dnallm::models::AttentionContext;
using torch::Tensor;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<int64_t> lengths{1024, 4096};
  int ranks = 2;
  int64_t heads = 4, head_dim = 32, batch = 1;
  bool causal = false;
  int threads = 1;
  int warmup = 2, iters = 10;
};

// Rank r's positions of `length`: contiguous, or zig-zag chunks r and 2C-1-r of 2C (causal).
std::vector<int64_t> positions_of(int64_t length, int C, int r, bool zig_zag) {
  std::vector<int64_t> out;
  auto add = [&](int64_t first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) out.push_back(first + i);
  };
  if (!zig_zag) {
    add(r * (length / C), length / C);
  } else {
    const int64_t chunk = length / (2 * C);
    add(r * chunk, chunk);
    add((2 * C - 1 - r) * chunk, chunk);
  }
  return out;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Timings {
  std::vector<double> waited, overlapped, exchange;  // seconds, per timed step
  // Seconds blocked in the exchanges' waits (ContextAttentionCounts), per timed step.
  std::vector<double> waited_blocked, overlapped_blocked;
};

// One rank's steps at `length`: each timed iteration runs both orders (alternating which goes
// first) and the exchange alone, each after a barrier.
Timings run_rank(const Options& o, int64_t length, int r, dnallm::comm::Communicator& group) {
  const int C = o.ranks;
  const auto pos = positions_of(length, C, r, o.causal);
  AttentionContext context;
  context.group = &group;
  context.query_positions = pos;
  for (int p = 0; p < C; ++p) {
    const auto theirs = positions_of(length, C, p, o.causal);
    context.key_positions.insert(context.key_positions.end(), theirs.begin(), theirs.end());
  }
  context.causal = o.causal;
  dnallm::models::ContextAttentionCounts counts;
  context.counts = &counts;
  const int64_t t = int64_t(pos.size());
  torch::manual_seed(100 + r);
  const auto shape = std::vector<int64_t>{o.batch, o.heads, t, o.head_dim};
  const auto q = torch::randn(shape).requires_grad_(true),
             k = torch::randn(shape).requires_grad_(true),
             v = torch::randn(shape).requires_grad_(true), g = torch::randn(shape);
  auto barrier = [&] { group.barrier()->wait(); };
  // The step's seconds, and those of them blocked in the exchanges' waits.
  auto step = [&](bool overlap) {
    context.overlap_exchange = overlap;
    barrier();
    const double blocked = counts.seconds_waiting;
    const auto start = Clock::now();
    const auto out = dnallm::models::context_attention(q, k, v, context, 0.0);
    (out * g).sum().backward();
    return std::pair<double, double>{seconds_since(start), counts.seconds_waiting - blocked};
  };
  // The exchange alone: the same all-gather and reduce-scatter, waited for at once.
  const auto sent = torch::randn({2, o.batch, o.heads, t, o.head_dim});
  auto received = torch::empty({C, 2, o.batch, o.heads, t, o.head_dim});
  auto exchange = [&] {
    barrier();
    const auto start = Clock::now();
    const auto dtype = dnallm::DType::kFloat32;
    group
        .allgather(dnallm::buffer_view(sent, 0, sent.numel(), dtype),
                   dnallm::buffer_view(received, 0, received.numel(), dtype))
        ->wait();
    auto mine = torch::empty_like(sent);
    group
        .reduce_scatter(dnallm::buffer_view(received, 0, received.numel(), dtype),
                        dnallm::buffer_view(mine, 0, mine.numel(), dtype),
                        dnallm::comm::ReduceOp::kSum)
        ->wait();
    return seconds_since(start);
  };
  Timings timings;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    std::pair<double, double> overlapped, waited;
    if (i % 2 == 0) {
      waited = step(false);
      overlapped = step(true);
    } else {
      overlapped = step(true);
      waited = step(false);
    }
    const double alone = exchange();
    if (i < o.warmup) continue;
    timings.waited.push_back(waited.first);
    timings.overlapped.push_back(overlapped.first);
    timings.waited_blocked.push_back(waited.second);
    timings.overlapped_blocked.push_back(overlapped.second);
    timings.exchange.push_back(alone);
  }
  return timings;
}

void add_options(CLI::App& app, Options& o) {
  app.add_option("--lengths", o.lengths, "whole sequence lengths (divisible by 2 C)");
  app.add_option("--ranks", o.ranks, "context-parallel degree C (threads of this process)");
  app.add_option("--heads", o.heads);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--batch", o.batch);
  app.add_flag("--causal", o.causal, "causal attention on zig-zag chunks (else bidirectional)");
  app.add_option("--threads", o.threads, "LibTorch threads a rank");
  app.add_option("--warmup", o.warmup);
  app.add_option("--iters", o.iters);
}

// The run's settings and the table's column names.
void print_header(const Options& o) {
  std::printf(
      "# C %d, %s, batch %lld, heads %lld, head_dim %lld, fp32, %d thread(s) a rank, "
      "warm-up %d, iterations %d, medians over the iterations\n",
      o.ranks, o.causal ? "causal zig-zag" : "bidirectional contiguous",
      static_cast<long long>(o.batch), static_cast<long long>(o.heads),
      static_cast<long long>(o.head_dim), o.threads, o.warmup, o.iters);
  // ratio: the median of each iteration's overlapped / waited (adjacent steps: less of the
  // machine's drift than the ratio of the medians); blocked: in the exchanges' waits.
  std::printf("%8s %11s %14s %8s %12s %16s %12s\n", "length", "waited_ms", "overlapped_ms", "ratio",
              "exchange_ms", "waited_blocked", "overl_blocked");
}

// Every rank's timings at `length`, a thread a rank over one in-memory store; false (the first
// failed rank's error printed) where a rank threw.
bool run_ranks(const Options& o, int64_t length, std::vector<Timings>& timings) {
  auto store = std::make_shared<dnallm::coordinator::InMemoryStore>();
  timings.assign(static_cast<size_t>(o.ranks), Timings{});
  std::vector<std::string> errors(static_cast<size_t>(o.ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < o.ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        torch::set_num_threads(o.threads);
        dnallm::comm::CommOptions co;
        co.backend = "gloo";
        co.rank = r;
        co.world_size = o.ranks;
        co.store = store;
        co.loopback = true;
        co.name = "bench_context_attention." + std::to_string(length);
        auto group = dnallm::comm::make_communicator(co);
        timings[r] = run_rank(o, length, r, *group);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < o.ranks; ++r) {
    if (!errors[r].empty()) {
      std::fprintf(stderr, "dnallm-bench-context-attention: rank %d: %s\n", r, errors[r].c_str());
      return false;
    }
  }
  return true;
}

// `field` step by step over the ranks: the slowest rank's value, or the least.
std::vector<double> over_ranks(const std::vector<Timings>& timings,
                               std::vector<double> Timings::*field, bool slowest) {
  std::vector<double> out = timings[0].*field;
  for (const auto& t : timings) {
    for (size_t i = 0; i < out.size(); ++i) {
      out[i] = slowest ? std::max(out[i], (t.*field)[i]) : std::min(out[i], (t.*field)[i]);
    }
  }
  return out;
}

// One row of the table: `length`'s medians over the timed steps.
void print_row(int64_t length, const std::vector<Timings>& timings) {
  // Each step's time is its slower rank's; its time blocked, the less blocked rank's (the
  // other ranks' include waiting for the last one to arrive: skew, not the exchange).
  auto slowest = [&](std::vector<double> Timings::*field) {
    return over_ranks(timings, field, true);
  };
  auto least = [&](std::vector<double> Timings::*field) {
    return over_ranks(timings, field, false);
  };
  const auto waited = slowest(&Timings::waited), overlapped = slowest(&Timings::overlapped);
  std::vector<double> ratios(waited.size());
  for (size_t i = 0; i < ratios.size(); ++i) ratios[i] = overlapped[i] / waited[i];
  std::printf("%8lld %11.2f %14.2f %8.3f %12.2f %16.2f %12.2f\n", static_cast<long long>(length),
              median(waited) * 1e3, median(overlapped) * 1e3, median(ratios),
              median(slowest(&Timings::exchange)) * 1e3,
              median(least(&Timings::waited_blocked)) * 1e3,
              median(least(&Timings::overlapped_blocked)) * 1e3);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"attention context parallelism: the K/V exchange overlapped or waited for first"};
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);
  if (!dnallm::comm::backend_available("gloo")) {
    std::fprintf(stderr, "dnallm-bench-context-attention: gloo was not built\n");
    return 2;
  }
  torch::set_num_threads(o.threads);
  print_header(o);
  for (const auto length : o.lengths) {
    if (length % (2 * o.ranks) != 0) {
      std::fprintf(stderr, "dnallm-bench-context-attention: length %lld is not divisible by 2 C\n",
                   static_cast<long long>(length));
      return 2;
    }
    std::vector<Timings> timings;
    if (!run_ranks(o, length, timings)) return 1;
    print_row(length, timings);
  }
  return 0;
}
