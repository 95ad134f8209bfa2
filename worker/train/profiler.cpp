#include "worker/train/profiler.hpp"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include <spdlog/spdlog.h>

#include "core/error.hpp"

namespace dnallm::train {
namespace {

namespace tp = torch::profiler::impl;
namespace ap = torch::autograd::profiler;

std::set<tp::ActivityType> activities(bool cuda) {
  std::set<tp::ActivityType> out{tp::ActivityType::CPU};
  if (cuda) out.insert(tp::ActivityType::CUDA);
  return out;
}

tp::ProfilerConfig kineto_config() {
  return tp::ProfilerConfig(tp::ProfilerState::KINETO, /*report_input_shapes=*/true);
}

}  // namespace

ProfileRange parse_profile_range(const std::string& text, const std::string& option) {
  ProfileRange r;
  const auto colon = text.find(':');
  bool ok = colon != std::string::npos;
  try {
    if (ok) {
      size_t used = 0;
      r.first = std::stoll(text.substr(0, colon), &used);
      ok = used == colon;
      const std::string tail = text.substr(colon + 1);
      r.last = std::stoll(tail, &used);
      ok = ok && used == tail.size();
    }
  } catch (const std::exception&) {
    ok = false;
  }
  DNALLM_CHECK(ok && r.first >= 1 && r.last >= r.first, ExitCode::kUsage,
               "{} \"{}\": give the optimizer steps to trace as START:END with 1 <= START <= END "
               "(e.g. {} 10:12)",
               option, text, option);
  return r;
}

bool kineto_available() {
  const auto probe = std::filesystem::temp_directory_path() /
                     ("dnallm-kineto-probe-" + std::to_string(::getpid()) + ".json");
  bool ok = false;
  try {
    const auto config = kineto_config();
    const auto acts = activities(false);
    ap::prepareProfiler(config, acts);
    ap::enableProfiler(config, acts);
    auto result = ap::disableProfiler();
    result->save(probe.string());  // throws without Kineto (USE_KINETO=0)
    ok = std::filesystem::exists(probe);
  } catch (const std::exception&) {
    ok = false;
  }
  std::error_code ec;
  std::filesystem::remove(probe, ec);
  return ok;
}

StepProfiler::StepProfiler(ProfileRange range, std::string path)
    : range_(range), path_(std::move(path)) {
  DNALLM_CHECK(kineto_available(), ExitCode::kUsage,
               "--profile needs LibTorch's Kineto profiler, which this LibTorch was built "
               "without (Debian's libtorch has none): build dnallm-train against a LibTorch "
               "with Kineto (pip's torch, scripts/build.sh --cuda) or drop --profile");
  const auto parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
}

StepProfiler::~StepProfiler() {
  if (!running_) return;
  try {
    ap::disableProfiler();
  } catch (...) {
  }
}

void StepProfiler::before_step(int64_t step, const c10::Device& device) {
  if (step != range_.first || running_ || written_) return;
  const auto config = kineto_config();
  const auto acts = activities(device.is_cuda());
  ap::prepareProfiler(config, acts);
  ap::enableProfiler(config, acts);
  running_ = true;
  spdlog::info("profiling steps {}..{}", range_.first, range_.last);
}

void StepProfiler::after_step(int64_t step) {
  if (!running_ || step < range_.last) return;
  running_ = false;
  auto result = ap::disableProfiler();
  result->save(path_);
  written_ = true;
  spdlog::info(
      "wrote the trace of steps {}..{} to {} (open it in https://ui.perfetto.dev or "
      "chrome://tracing)",
      range_.first, range_.last, path_);
}

}  // namespace dnallm::train
