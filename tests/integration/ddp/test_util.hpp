// Helpers for integration tests that run the real binaries and compare their outputs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tests/support/process.hpp"  // kBin, kSrc, run_command, make_temp_dir

namespace dnallm::testing {

// What the equivalence tests (ddp_equivalence_test, context_parallel_train_test) compare of a
// finished tiny_train_command run: its folder, each step's loss (read_step_losses) and its final
// fp32 parameters (read_safetensors_f32).
struct TinyTrainRun {
  std::string dir;
  std::map<int64_t, double> losses;
  std::map<std::string, std::vector<float>> params;
};

// Reads every fp32 tensor of a safetensors file (name -> values); other dtypes are skipped.
std::map<std::string, std::vector<float>> read_safetensors_f32(const std::string& path);

// The "loss" of every step line of a metrics JSON Lines file, by step.
std::map<int64_t, double> read_step_losses(const std::string& metrics_path);

// dnallm-train on a tiny BERT (hidden 32, 2 layers, 64 tokens) over the bundled E. coli
// genome: 5 steps, fp32, lr 3e-3 without warm-up, seed 7, a loss line every step in
// <dir>/metrics.jsonl, small DDP buckets, checkpoints under <dir>/ckpt. `starter` runs the
// workers ("" = one process, or e.g. "dnallm-launch --nproc-per-node 2 --"); `extra` adds
// arguments. The runs the equivalence tests compare.
std::string tiny_train_command(const std::string& starter, const std::string& dir, int micro,
                               int accum, const std::string& extra);

}  // namespace dnallm::testing
