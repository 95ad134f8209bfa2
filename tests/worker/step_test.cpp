// The sync-free training step on CPU (Note [Sync-free step]): host-known batch facts give the
// same loss as the device computation, the sync-free step matches the host path, non-logging
// steps read nothing back (checked with an operator observer, so a read inside the model counts
// too), plus MFU accounting, the --profile seam, the device seam and checkpoint save -> resume
// -> save on the sync-free path.
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "core/cuda_plugin.hpp"
#include "core/error.hpp"
#include "lm_batches.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/train/checkpointing.hpp"
#include "worker/train/device_stats.hpp"
#include "worker/train/mfu.hpp"
#include "worker/train/profiler.hpp"
#include "worker/train/train_setup.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {
namespace {

using dnallm::testing::expect_error;

namespace fs = std::filesystem;

using namespace testing;  // NOLINT: lm_batches.hpp

// The rows of these tests; `padded`: some rows end in padding.
LmRows rows_of(bool padded) { return LmRows{500, 30, padded ? 2 : 0}; }
data::Batch make_batch(uint64_t first_row, int64_t rows, int64_t seq, bool padded) {
  return make_lm_batch(first_row, rows, seq, rows_of(padded));
}
Config tiny(const std::string& arch) {
  Config c = testing::small_lm_config(arch, 32, 16, 3, 1e-2);
  c.training.warmup_steps = 1;
  c.training.logging_steps = 1;
  c.training.max_grad_norm = 0.5;  // clips: the device-side coefficient is exercised
  c.training.device = cfg::Device::kCpu;
  return c;
}

// Counts the operators that read a tensor back to the host while it is alive (this thread).
// On a GPU each of them is a synchronisation.
class HostReadProbe {
 public:
  HostReadProbe() {
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          static const std::set<std::string> kReads = {"aten::_local_scalar_dense", "aten::item",
                                                       "aten::nonzero", "aten::is_nonzero"};
          if (kReads.count(fn.name()) > 0) ++counter();
          return nullptr;
        }));
    counter() = 0;
  }
  ~HostReadProbe() { at::removeCallback(handle_); }
  int64_t count() const { return counter(); }

 private:
  static std::atomic<int64_t>& counter() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  at::CallbackHandle handle_;
};

struct Case {
  std::string arch;
  bool padded;
};

class SyncFree : public ::testing::TestWithParam<Case> {};

TEST_P(SyncFree, HostBatchFactsGiveTheDeviceResultBitForBit) {
  const auto [arch, padded] = GetParam();
  auto cfg = tiny(arch);
  auto model = build_model(cfg, 9);
  model->eval();
  auto batch = make_batch(0, 4, 16, padded);
  auto with_facts = to_inputs(batch, model, torch::kCPU);
  with_facts.logits_for_labels_only = true;
  ASSERT_TRUE(with_facts.padded.has_value());
  EXPECT_EQ(*with_facts.padded, padded);
  auto without = with_facts;
  without.padded.reset();
  without.label_count = -1;
  without.label_index = torch::Tensor();
  without.mlm_positions = torch::Tensor();
  without.mlm_selected = torch::Tensor();
  torch::NoGradGuard no_grad;
  const auto a = model->forward(with_facts);
  const auto b = model->forward(without);
  EXPECT_EQ(a.loss_count, b.loss_count);
  EXPECT_EQ(a.loss_count, batch.num_label_tokens);  // position 0 is never scored here
  EXPECT_TRUE(torch::equal(a.loss_sum, b.loss_sum))
      << a.loss_sum.item<double>() << " vs " << b.loss_sum.item<double>();
  EXPECT_TRUE(torch::equal(a.logits, b.logits));
}

TEST_P(SyncFree, StepsMatchTheHostPath) {
  const auto [arch, padded] = GetParam();
  auto cfg = tiny(arch);
  Trainer host(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(padded)),
               nullptr, nullptr, testing::quiet_options(false));
  Trainer free(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(padded)),
               nullptr, nullptr, testing::quiet_options(true));
  ASSERT_FALSE(host.sync_free());
  ASSERT_TRUE(free.sync_free());
  for (int s = 0; s < 4; ++s) {
    const auto h = host.train_step();
    const auto f = free.train_step(true);
    EXPECT_NEAR(f.loss, h.loss, 1e-5 * std::abs(h.loss)) << "step " << h.step;
    EXPECT_NEAR(f.grad_norm, h.grad_norm, 1e-4 * std::abs(h.grad_norm)) << "step " << h.step;
  }
  const auto diff = (free.flat().params() - host.flat().params()).abs();
  std::printf("max |param difference| %.3g, mean %.3g\n", diff.max().item<double>(),
              diff.mean().item<double>());
  // Updates are ~lr = 1e-2 per step: a wrong scale or clip would differ by far more.
  EXPECT_TRUE(torch::allclose(free.flat().params(), host.flat().params(), 1e-4, 1e-5));
  EXPECT_FALSE(torch::equal(free.flat().params(), build_model(cfg, 9)->parameters()[0]));
}

TEST_P(SyncFree, NonLoggingStepsReadNothingBack) {
  const auto [arch, padded] = GetParam();
  auto cfg = tiny(arch);
  Trainer free(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(padded)),
               nullptr, nullptr, testing::quiet_options(true));
  free.train_step(true);  // warm-up
  {
    HostReadProbe probe;
    const auto r = free.train_step(false);
    EXPECT_EQ(probe.count(), 0) << "a non-logging step read a tensor back";
    EXPECT_EQ(r.host_reads, 0);
    EXPECT_FALSE(r.host_values);
    EXPECT_TRUE(std::isnan(r.loss));
  }
  {
    HostReadProbe probe;
    const auto r = free.train_step(true);  // a logging step reads loss and norm
    EXPECT_GT(probe.count(), 0);
    EXPECT_EQ(r.host_reads, 2);
    EXPECT_TRUE(std::isfinite(r.loss));
  }
  // The probe sees the host path's reads (it can fail).
  Trainer host(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(padded)),
               nullptr, nullptr, testing::quiet_options(false));
  HostReadProbe probe;
  const auto r = host.train_step(false);
  EXPECT_GE(probe.count(), 3);  // a loss per micro-step and the norm
  EXPECT_GE(r.host_reads, 2);
}

INSTANTIATE_TEST_SUITE_P(Models, SyncFree,
                         ::testing::Values(Case{"bert", false}, Case{"bert", true},
                                           Case{"gpt", false}, Case{"gpt", true}),
                         [](const auto& info) {
                           return info.param.arch + (info.param.padded ? "_padded" : "_full");
                         });

TEST(SyncFreeTest, NanLossIsReportedAtTheNextLoggingStep) {
  auto cfg = tiny("bert");
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(false)),
                  nullptr, nullptr, testing::quiet_options(true));
  trainer.flat().params().narrow(0, 0, 1000).fill_(std::nan(""));
  EXPECT_NO_THROW(trainer.train_step(false));
  try {
    trainer.train_step(true);
    FAIL() << "NaN loss accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss is nan"), std::string::npos) << e.what();
  }
}

TEST(SyncFreeTest, ConfigKeyChoosesThePath) {
  auto cfg = tiny("bert");
  TrainerOptions o;
  o.console_progress = false;
  cfg.training.sync_free = cfg::SyncFree::kOn;
  EXPECT_TRUE(Trainer(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(false)),
                      nullptr, nullptr, o)
                  .sync_free());
  cfg.training.sync_free = cfg::SyncFree::kAuto;  // CPU: off
  EXPECT_FALSE(Trainer(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(false)),
                       nullptr, nullptr, o)
                   .sync_free());
}

// ---------------------------------------------------------------------------------------------
// MFU, device seam, profiler

TEST(MfuTest, FlopsPerTokenCountsTrainableFrozenAndAttention) {
  // 6 x 10 + 4 x 4 + 12 x 2 x 8 x 16
  EXPECT_DOUBLE_EQ(model_flops_per_token(10, 4, 2, 8, 16), 60.0 + 16.0 + 3072.0);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA H100 80GB HBM3"), 989.0);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA H200"), 989.0);
  EXPECT_DOUBLE_EQ(known_peak_tflops("NVIDIA A100-SXM4-80GB"), 312.0);
  EXPECT_DOUBLE_EQ(known_peak_tflops("cpu"), 0.0);
  EXPECT_NEAR(mfu(1e5, 1e9, 989.0, 1), 1e14 / 989e12, 1e-12);
  EXPECT_NEAR(mfu(2e5, 1e9, 989.0, 2), 1e14 / 989e12, 1e-12);
  EXPECT_EQ(mfu(1e5, 1e9, 0.0, 1), 0.0);

  auto cfg = tiny("bert");
  cfg.lora.r = 4;
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(false)),
                  nullptr, nullptr, testing::quiet_options(false));
  int64_t trainable = 0, frozen = 0;
  for (const auto& p : trainer.model()->parameters()) {
    (p.requires_grad() ? trainable : frozen) += p.numel();
  }
  ASSERT_GT(frozen, 0);
  EXPECT_DOUBLE_EQ(trainer.flops_per_token(16),
                   6.0 * trainable + 4.0 * frozen + 12.0 * 2 * 32 * 16);
}

TEST(DeviceStatsTest, CpuReportsNoGpuMemory) {
  EXPECT_FALSE(device_memory_stats(torch::kCPU).available);
  EXPECT_EQ(device_name(torch::kCPU), "cpu");
}

// Note [Lazy CUDA]: once ATen looked its CUDA hooks up without the plugin loaded, loading it
// cannot bring CUDA back: cuda_usable says so (an internal error) instead of a CPU run.
TEST(DeviceStatsTest, CudaHooksLookedUpBeforeThePluginAreAnInternalError) {
  if (!cuda_build()) GTEST_SKIP() << "this build has no CUDA plugin";
  if (cuda_plugin::loaded()) GTEST_SKIP() << "the CUDA plugin is loaded already";
  (void)torch::cuda::is_available();               // ATen looks its CUDA hooks up and keeps them
  setenv("DNALLM_TEST_LOAD_CUDA_PLUGIN", "1", 1);  // past the "no GPU in sight" refusal
  expect_error([&] { cuda_usable("cuda", "the test"); }, ExitCode::kFailure,
               {"looked up before the CUDA plugin was loaded"});
  unsetenv("DNALLM_TEST_LOAD_CUDA_PLUGIN");
}

TEST(ProfilerTest, RangeIsStartColonEnd) {
  const auto r = parse_profile_range("3:5", "--profile");
  EXPECT_EQ(r.first, 3);
  EXPECT_EQ(r.last, 5);
  for (const std::string bad : {"5:3", "0:2", "3", "a:b", "3:4x", ""}) {
    SCOPED_TRACE(bad);
    expect_error([&] { parse_profile_range(bad, "--profile"); }, ExitCode::kUsage, {"START:END"});
  }
}

TEST(ProfilerTest, WritesATraceOrRefusesClearly) {
  const auto path =
      (fs::temp_directory_path() / ("dnallm-trace-test-" + std::to_string(::getpid()) + ".json"))
          .string();
  if (!kineto_available()) {
    std::printf("this LibTorch has no Kineto: checking the refusal\n");
    expect_error([&] { StepProfiler p(ProfileRange{1, 1}, path); }, ExitCode::kUsage, {"Kineto"});
    return;
  }
  StepProfiler p(ProfileRange{2, 2}, path);
  p.before_step(1, torch::kCPU);
  p.after_step(1);
  EXPECT_FALSE(p.written());
  p.before_step(2, torch::kCPU);
  auto x = torch::randn({64, 64});
  auto y = torch::matmul(x, x);
  p.after_step(2);
  ASSERT_TRUE(p.written());
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("traceEvents"), std::string::npos);
  EXPECT_NE(text.str().find("aten::mm"), std::string::npos);
  fs::remove(path);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: Note [Resume on the device], save -> resume -> save on the sync-free path

// Trains `cfg` from scratch on padded rows with checkpoints on (checkpoint.save_steps);
// returns the final flat parameters and the flat layout.
struct Trained {
  torch::Tensor params;
  std::vector<optim::FlatParameters::Entry> entries;
};
Trained train_with_checkpoints(const Config& cfg) {
  Checkpointer ck(cfg, CheckpointerOptions{});
  TrainerOptions o = testing::quiet_options(true);
  ck.install(o);
  Trainer t(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(true)), nullptr,
            nullptr, o);
  t.run();
  return {t.flat().params().clone(), t.flat().entries()};
}

TEST(ResumeOnDeviceTest, NamesATensorLeftOffTheDevice) {
  auto cfg = tiny("bert");
  Trainer trainer(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(false)),
                  nullptr, nullptr, testing::quiet_options(false));
  EXPECT_NO_THROW(check_on_device(trainer));
  trainer.optimizer().exp_avg() = torch::zeros({trainer.flat().numel()}, torch::kMeta);
  try {
    check_on_device(trainer);
    FAIL() << "a moment on another device passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.exp_avg"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("meta"), std::string::npos) << e.what();
  }
}

TEST(ResumeOnDeviceTest, SaveResumeSaveCommitsAndMatchesAnUninterruptedRun) {
  const auto root = fs::temp_directory_path() / ("dnallm-step-test-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto cfg = tiny("bert");
  cfg.training.sync_free = cfg::SyncFree::kOn;
  cfg.training.logging_steps = 3;  // steps 2, 4, 5 are not read back
  cfg.training.lr_scheduler = cfg::LrScheduler::kConstant;
  cfg.checkpoint.save_steps = 2;
  cfg.checkpoint.keep_last = 0;
  const int64_t rows_per_step = 3 * 2;

  // Uninterrupted to 6.
  cfg.checkpoint.dir = (root / "straight").string();
  const torch::Tensor straight = train_with_checkpoints(cfg).params;
  // Stopped at 4 (saves 2 and 4), resumed to 6 (saves 6).
  cfg.checkpoint.dir = (root / "resumed").string();
  {
    auto first = cfg;
    first.training.max_steps = 4;
    train_with_checkpoints(first);
  }
  const auto resumed = testing::resume_to_end(
      cfg, 4, std::make_unique<LmSource>(3, 16, rows_of(true), 4 * rows_per_step),
      [](Trainer& t) { EXPECT_EQ(t.step(), 4); });
  EXPECT_TRUE(torch::equal(resumed, straight)) << "resumed run differs from the uninterrupted one";
  auto latest = open_resume(cfg, nlohmann::json());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step(), 6);
  fs::remove_all(root);
}

// The state save() writes is the trainer's (read back typed), and restore() refuses a state
// that is unreadable or whose layout points outside the saved buffers (exit 5, naming what).
TEST(ResumeOnDeviceTest, SavedStateIsTheTrainersAndADamagedStateIsRefused) {
  const auto root = fs::temp_directory_path() / ("dnallm-state-test-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto cfg = tiny("bert");
  cfg.training.max_steps = 2;
  cfg.checkpoint.save_steps = 2;
  cfg.checkpoint.dir = root.string();
  const auto entries = train_with_checkpoints(cfg).entries;
  const auto state = checkpoint::read_train_state(*open_resume(cfg, nlohmann::json()));
  EXPECT_EQ(state.step, 2);
  EXPECT_EQ(state.adam_steps, 2);
  EXPECT_EQ(state.config_hash, fmt::format("{:016x}", model_config_hash(cfg)));
  EXPECT_EQ(state.micro_batch_size, cfg.training.micro_batch_size);
  ASSERT_TRUE(state.rng && state.config);
  EXPECT_EQ(state.rng->scheme, kRngScheme);
  ASSERT_EQ(state.layout.size(), entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ(state.layout[i],
              (checkpoint::LayoutEntry{entries[i].name, entries[i].offset, entries[i].shape}));
  }

  const auto manifest = root / checkpoint::step_dir_name(2) / checkpoint::kManifestName;
  nlohmann::json original;
  std::ifstream(manifest) >> original;
  auto restore_with = [&](const std::function<void(nlohmann::json&)>& damage) -> std::string {
    auto j = original;
    damage(j["state"]);
    std::ofstream(manifest) << j.dump(1);
    Trainer t(cfg, build_model(cfg, 9), std::make_unique<LmSource>(3, 16, rows_of(true)), nullptr,
              nullptr, testing::quiet_options(false));
    try {
      restore(t, checkpoint::CheckpointReader::open(root));
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kCheckpointCorrupt) << e.what();
      return e.what();
    }
    return "restored";
  };
  EXPECT_EQ(restore_with([](nlohmann::json&) {}), "restored");
  auto msg = restore_with([](nlohmann::json& s) { s.erase("adam_steps"); });
  EXPECT_NE(msg.find("state.adam_steps is missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find(manifest.string()), std::string::npos) << msg;
  msg = restore_with([](nlohmann::json& s) { s["layout"][0]["offset"] = 1 << 30; });
  EXPECT_NE(msg.find("outside the"), std::string::npos) << msg;
  EXPECT_NE(msg.find(original["state"]["layout"][0]["name"].get<std::string>()), std::string::npos)
      << msg;
  fs::remove_all(root);
}

}  // namespace
}  // namespace dnallm::train
