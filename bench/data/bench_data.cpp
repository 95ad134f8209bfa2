// Data pipeline benchmark.
//
//   dnallm-bench-data loader [--genome PATH] [--steps N] [--seq 512] [--mbs 8]
//       Loader throughput on the bench-cpu shape (char tokens, MLM, seq 512, micro-batch 8)
//       for 0, 1 and 2 workers: warm-up, iterations, median micro-batch time, tokens/s and
//       the ratio against what the trainer consumes on 2 cores (8 x 512 / 2.2 s ~ 1.9k
//       tokens/s per process, measured by the trainer's bench-cpu run).
//   dnallm-bench-data table [--dir /tmp] [--gb 1.0] [--reads N]
//       Generates a CSV of ~gb GB in dir, builds its offset index, reads N random records
//       through the loader, and reports peak RSS (VmHWM) for each phase; deletes the files.
//       The bound to check: peak RSS does not grow with the file size.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench/proc_status.hpp"
#include "core/clock.hpp"
#include "core/config.hpp"
#include "core/log.hpp"
#include "worker/data/pipeline.hpp"
#include "worker/data/table_dataset.hpp"

namespace {

using dnallm::seconds_since;

using Clock = std::chrono::steady_clock;

// Peak resident set (VmHWM) and resident set now (VmRSS) in MiB.
double peak_rss_mb() { return dnallm::bench::proc_status_mb("VmHWM"); }
double rss_mb() { return dnallm::bench::proc_status_mb("VmRSS"); }
// Resets VmHWM to the current RSS (Linux: write "5" to clear_refs).
void reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
}

std::string arg(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 2; i + 1 < argc; ++i) {
    if (argv[i] == name) return argv[i + 1];
  }
  return def;
}

int bench_loader(int argc, char** argv) {
  dnallm::Config c;
  c.data.train_files = {arg(argc, argv, "--genome",
                            std::string(DNALLM_SOURCE_DIR_BENCH) + "/data/ecoli_k12_mg1655.fa.gz")};
  c.model.max_seq_length = std::stoll(arg(argc, argv, "--seq", "512"));
  c.training.micro_batch_size = std::stoll(arg(argc, argv, "--mbs", "8"));
  c.tokenizer.kind = dnallm::cfg::TokenizerKind::kChar;
  c.model.arch = dnallm::cfg::Arch::kBert;
  const int steps = std::stoi(arg(argc, argv, "--steps", "200"));
  const int warmup = 10;
  const double trainer_tokens_per_s = 8.0 * 512 / 2.2;
  auto tok = dnallm::data::make_tokenizer(c);
  std::printf("# loader: char tokens, MLM, seq %lld, micro-batch %lld, genome %s\n",
              static_cast<long long>(c.model.max_seq_length),
              static_cast<long long>(c.training.micro_batch_size), c.data.train_files[0].c_str());
  std::printf("%8s %7s %6s %12s %12s %14s %10s %10s\n", "workers", "warmup", "iters", "median_ms",
              "mean_ms", "tokens_per_s", "vs_trainer", "wait_s");
  for (int workers : {0, 1, 2}) {
    c.data.dataloader_num_workers = workers;
    auto loader = dnallm::data::make_train_loader(c, tok, 0, 1);
    for (int i = 0; i < warmup; ++i) loader->next();
    std::vector<double> times;
    int64_t tokens = 0;
    auto t_all = Clock::now();
    for (int i = 0; i < steps; ++i) {
      auto t0 = Clock::now();
      auto b = loader->next();
      times.push_back(seconds_since(t0));
      tokens += b.rows * b.seq_len;
    }
    double wall = seconds_since(t_all);
    std::sort(times.begin(), times.end());
    double tps = static_cast<double>(tokens) / wall;
    std::printf("%8d %7d %6d %12.3f %12.3f %14.0f %9.1fx %10.3f\n", workers, warmup, steps,
                times[times.size() / 2] * 1e3, wall / steps * 1e3, tps, tps / trainer_tokens_per_s,
                loader->data_wait_s());
  }
  std::printf(
      "# vs_trainer: tokens/s divided by the trainer's consumption (8*512/2.2 s = %.0f tokens/s)\n",
      trainer_tokens_per_s);
  std::printf("# peak RSS %.1f MiB\n", peak_rss_mb());
  return 0;
}

// Writes ~bytes of CSV: "sequence,label" with 1,000-base records.
uint64_t generate_csv(const std::string& path, uint64_t bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::perror(path.c_str());
    std::exit(1);
  }
  std::fputs("sequence,label\n", f);
  std::string line(1000, 'A');
  uint64_t x = 88172645463325252ULL, written = 0, records = 0;
  while (written < bytes) {
    for (auto& ch : line) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      ch = "ACGT"[x & 3];
    }
    std::fwrite(line.data(), 1, line.size(), f);
    std::fputs((x & 4) != 0U ? ",1\n" : ",0\n", f);
    written += line.size() + 3;
    ++records;
  }
  std::fclose(f);
  return records;
}

int bench_table(int argc, char** argv) {
  namespace fs = std::filesystem;
  const double gb = std::stod(arg(argc, argv, "--gb", "1.0"));
  const int reads = std::stoi(arg(argc, argv, "--reads", "2000"));
  fs::path dir = fs::path(arg(argc, argv, "--dir", "/tmp")) /
                 ("dnallm-bench-table-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string csv = (dir / "big.csv").string();
  auto t0 = Clock::now();
  const uint64_t records = generate_csv(csv, static_cast<uint64_t>(gb * (1ULL << 30)));
  double gen_s = seconds_since(t0);
  std::printf("# table: %s, %.2f GiB, %llu records of 1000 bases (generated in %.1f s)\n",
              csv.c_str(), static_cast<double>(fs::file_size(csv)) / (1ULL << 30),
              static_cast<unsigned long long>(records), gen_s);
  std::printf("%-28s %10s %14s %12s\n", "phase", "seconds", "peak_rss_mib", "rss_mib");
  std::printf("%-28s %10s %14.1f %12.1f\n", "start", "-", peak_rss_mb(), rss_mb());

  dnallm::Config c;
  c.data.train_files = {csv};
  c.model.task = dnallm::cfg::Task::kClassification;
  c.model.max_seq_length = 512;
  c.training.micro_batch_size = 8;
  c.data.dataloader_num_workers = 2;
  auto tok = dnallm::data::make_char_tokenizer();
  reset_peak_rss();
  t0 = Clock::now();
  auto loader = dnallm::data::make_train_loader(c, tok, 0, 1);  // builds the index
  std::printf("%-28s %10.1f %14.1f %12.1f\n", "index build (first open)", seconds_since(t0),
              peak_rss_mb(), rss_mb());
  reset_peak_rss();
  t0 = Clock::now();
  int64_t tokens = 0;
  for (int i = 0; i < reads / 8; ++i) {
    auto b = loader->next();
    tokens += b.rows * b.seq_len;
  }
  double read_s = seconds_since(t0);
  std::printf("%-28s %10.1f %14.1f %12.1f\n", ("random reads x" + std::to_string(reads)).c_str(),
              read_s, peak_rss_mb(), rss_mb());
  loader.reset();
  reset_peak_rss();
  t0 = Clock::now();
  loader = dnallm::data::make_train_loader(c, tok, 0, 1);
  std::printf("%-28s %10.3f %14.1f %12.1f\n", "reopen (index reused)", seconds_since(t0),
              peak_rss_mb(), rss_mb());
  std::printf(
      "# random-read loader throughput: %.0f tokens/s; index %.1f MiB on disk (8 bytes/record)\n",
      static_cast<double>(tokens) / read_s,
      static_cast<double>(fs::file_size(csv + ".dnaidx")) / (1 << 20));
  loader.reset();
  fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  dnallm::init_logging("bench-data", "warn");
  std::string mode = argc > 1 ? argv[1] : "loader";
  if (mode == "loader") return bench_loader(argc, argv);
  if (mode == "table") return bench_table(argc, argv);
  std::fprintf(stderr, "usage: dnallm-bench-data loader|table [options]\n");
  return 2;
}
