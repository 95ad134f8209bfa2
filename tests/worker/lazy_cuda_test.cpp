// Note [Lazy CUDA] (core/cuda_plugin.hpp) through the real binaries: the worker programs link
// LibTorch's CPU half only (readelf), a GPU run asked for loads libdnallm_cuda.so into each of
// them (on a machine without a GPU: the "no CUDA device" refusal, which only a loaded plugin
// with LibTorch's CUDA hooks can give), a plugin that cannot load is one clear line, and a
// refusal of bad input comes before any of it. No LibTorch in the test itself.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/process.hpp"

namespace {

// Loads the CUDA plugin for --device cuda even where no GPU is visible (Note [Lazy CUDA]).
const std::string kForce = "DNALLM_TEST_LOAD_CUDA_PLUGIN=1 ";

namespace fs = std::filesystem;
using dnallm::testing::kBin;
using dnallm::testing::kSrc;
using dnallm::testing::run_shell;

// The NEEDED entries of an ELF file, in order.
std::vector<std::string> needed(const std::string& file) {
  const auto r = run_shell("readelf -d " + file, dnallm::testing::Streams::kStdoutOnly);
  EXPECT_EQ(r.code, 0) << "readelf -d " << file;
  std::vector<std::string> out;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    if (line.find("(NEEDED)") == std::string::npos) continue;
    const auto open = line.find('['), close = line.find(']');
    if (open != std::string::npos && close != std::string::npos)
      out.push_back(line.substr(open + 1, close - open - 1));
  }
  return out;
}

bool has(const std::vector<std::string>& libs, const std::string& prefix) {
  for (const auto& l : libs)
    if (l.rfind(prefix, 0) == 0) return true;
  return false;
}

bool gpu_visible() {
  std::error_code ec;
  if (fs::exists("/dev/nvidiactl", ec) || fs::exists("/dev/dxg", ec)) return true;
  fs::directory_iterator it("/proc/driver/nvidia/gpus", ec);
  return !ec && it != fs::directory_iterator();
}

TEST(LazyCuda, WorkersNeedOnlyLibTorchsCpuHalf) {
  for (const std::string exe : {"dnallm-train", "dnallm-infer", "dnallm-eval"}) {
    SCOPED_TRACE(exe);
    const auto libs = needed(kBin + exe);
    ASSERT_TRUE(has(libs, "libtorch_cpu.so")) << "not a LibTorch program?";
    for (const std::string cuda : {"libtorch_cuda", "libc10_cuda", "libnccl", "libcudart",
                                   "libcublas", "libcudnn", "libtorch.so"}) {
      EXPECT_FALSE(has(libs, cuda)) << exe << " needs " << cuda << ": it belongs in the plugin";
    }
#ifdef DNALLM_TEST_GLOO
    // Note [Libraries that clash with LibTorch]: the system Gloo comes first.
    EXPECT_EQ(libs.at(0).rfind("libgloo", 0), 0u) << libs.at(0);
#endif
  }
}

TEST(LazyCuda, ThePluginNeedsTheCudaHalf) {
#ifndef DNALLM_TEST_PLUGIN
  GTEST_SKIP() << "this build has no CUDA plugin (no CUDA LibTorch, no NCCL)";
#else
  const auto libs = needed(DNALLM_TEST_PLUGIN);
#ifdef DNALLM_TEST_TORCH_CUDA
  EXPECT_TRUE(has(libs, "libtorch_cuda.so"));
  EXPECT_TRUE(has(libs, "libc10_cuda.so"));
#endif
#ifdef DNALLM_TEST_NCCL
  EXPECT_TRUE(has(libs, "libnccl"));
#endif
#endif
}

class LazyCudaRuns : public ::testing::Test {
 protected:
  void SetUp() override {
#if !defined(DNALLM_TEST_PLUGIN) || !defined(DNALLM_TEST_TORCH_CUDA)
    GTEST_SKIP() << "this build has no CUDA plugin with LibTorch's CUDA half";
#endif
    if (gpu_visible())
      GTEST_SKIP() << "a GPU is visible: scripts/gpu-node-check.sh checks the plugin there";
    dir_ = dnallm::testing::make_temp_dir("lazy_cuda");
    std::string bases;
    for (int i = 0; i < 60; ++i) bases += "ACGTTGCA";
    std::ofstream(dir_ / "in.fa") << ">a\n" << bases << "\n>b\n" << bases.substr(7) << "\n";
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  // Expects `cmd` to exit 2 with `needle` in its output and no sign of a bug.
  static void expect_refused(const std::string& cmd, const std::string& needle) {
    SCOPED_TRACE(cmd);
    const auto r = run_shell(cmd);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("internal error"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("frame #"), std::string::npos) << r.out;
  }
  // `env`: variable assignments for dnallm-train ("" or "A=b ").
  static std::string train_cmd(const std::string& ckpt, const std::string& device,
                               const std::string& env = "") {
    return "cd " + kSrc + " && " + env + kBin +
           "dnallm-train --config configs/gpt.toml --set model.hidden=32 --set model.layers=2"
           " --set model.heads=2 --set model.ffn=64 --set model.max_seq_length=64"
           " --set training.micro_batch_size=4 --set training.max_steps=2"
           " --set checkpoint.save_steps=0 --set training.eval_steps=0"
           " --set training.device=" +
           device + " --set checkpoint.dir=" + ckpt;
  }
  fs::path dir_;
};

TEST_F(LazyCudaRuns, TrainingDeviceCudaLoadsThePluginOrSaysWhyNot) {
  const auto ck = (dir_ / "ck").string();
  // Loaded, LibTorch's CUDA hooks in place (else "internal error"), and no GPU here.
  // No GPU in sight: refused before the plugin is even looked for (a small refusal) ...
  if (!fs::exists("/dev/nvidiactl") && !fs::exists("/dev/dxg")) {
    expect_refused(train_cmd(ck, "cuda", "DNALLM_CUDA_PLUGIN=/nowhere.so "),
                   "this machine shows no NVIDIA GPU");
  }
  // ... and, told to load it anyway, the loading path itself.
  expect_refused(train_cmd(ck, "cuda", kForce), "LibTorch sees no CUDA device");
  // A plugin that cannot load: the reason (dlerror's text) and what to do, exit 2.
  const std::string missing = (dir_ / "nowhere/libdnallm_cuda.so").string();
  expect_refused(train_cmd(ck, "cuda", kForce + "DNALLM_CUDA_PLUGIN=" + missing + " "),
                 "needs the CUDA plugin libdnallm_cuda.so, which did not load: " + missing);
  const std::string broken = (dir_ / "libdnallm_cuda.so").string();
  std::ofstream(broken) << "not an ELF file\n";
  expect_refused(train_cmd(ck, "cuda", kForce + "DNALLM_CUDA_PLUGIN=" + broken + " "),
                 "which did not load: " + broken + ": file too short");
  // "auto" on a machine without an NVIDIA GPU never looks for it: the run trains on the CPU.
  const auto r = run_shell(train_cmd(ck, "auto", "DNALLM_CUDA_PLUGIN=" + missing + " "));
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST_F(LazyCudaRuns, InferAndEvalLoadThePluginAfterTheModelWasChecked) {
  const auto ck = (dir_ / "ck").string();
  const auto trained = run_shell(train_cmd(ck, "cpu"));
  ASSERT_EQ(trained.code, 0) << trained.out;
  const std::string model = ck + "/final", fa = (dir_ / "in.fa").string();
  const std::string missing = "DNALLM_CUDA_PLUGIN=" + (dir_ / "nowhere.so").string() + " ";
  expect_refused(kForce + kBin + "dnallm-infer embed --device cuda --model " + model + " --input " +
                     fa + " --out " + (dir_ / "e.npy").string(),
                 "LibTorch sees no CUDA device here");
  expect_refused(kForce + kBin + "dnallm-eval --device cuda --model " + model + " --fasta " + fa,
                 "LibTorch sees no CUDA device here");
  expect_refused(
      kForce + missing + kBin + "dnallm-eval --device cuda:0 --model " + model + " --fasta " + fa,
      "--device cuda:0 needs the CUDA plugin");
  // A damaged model directory is refused before the device is resolved: the plugin that
  // cannot load is never asked for.
  fs::copy(model, dir_ / "damaged", fs::copy_options::recursive);
  std::ofstream(dir_ / "damaged/model.safetensors") << "garbage";
  const auto r = run_shell(kForce + missing + kBin + "dnallm-infer embed --device cuda --model " +
                           (dir_ / "damaged").string() + " --input " + fa + " --out " +
                           (dir_ / "d.npy").string());
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("CUDA plugin"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.safetensors"), std::string::npos) << r.out;
}

}  // namespace
