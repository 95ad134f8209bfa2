// The helpers every module shares from core/: dtype names (ours and safetensors'), signal
// names, the worker-diagnosis exit codes, and the steady-clock seconds.
#include <gtest/gtest.h>

#include <csignal>
#include <thread>

#include "core/clock.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/signals.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm {
namespace {

using dnallm::testing::expect_error;

constexpr DType kAll[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                          DType::kInt64,   DType::kInt32,   DType::kUInt8,   DType::kInt8};

TEST(SharedHelpersTest, DtypeNamesRoundTripBothWays) {
  for (DType t : kAll) {
    EXPECT_EQ(parse_dtype(dtype_name(t)), t) << dtype_name(t);
    EXPECT_EQ(dtype_from_safetensors_name(safetensors_dtype_name(t)), t) << dtype_name(t);
  }
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bf16");
  EXPECT_STREQ(safetensors_dtype_name(DType::kBFloat16), "BF16");
  EXPECT_STREQ(safetensors_dtype_name(DType::kUInt8), "U8");
  EXPECT_EQ(parse_dtype("float32"), DType::kFloat32);
  EXPECT_EQ(parse_dtype("half"), DType::kFloat16);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("double"), DType::kFloat64);
  EXPECT_FALSE(dtype_from_safetensors_name("BOOL").has_value());
  expect_error([&] { parse_dtype("fp8"); }, ExitCode::kUsage);
}

TEST(SharedHelpersTest, SignalNames) {
  EXPECT_EQ(signal_name(SIGKILL), "SIGKILL");
  EXPECT_EQ(signal_name(SIGTERM), "SIGTERM");
  EXPECT_EQ(signal_name(SIGUSR1), "SIGUSR1");
  EXPECT_EQ(signal_name(SIGSEGV), "SIGSEGV");
  EXPECT_EQ(signal_name(200), "signal 200");
}

TEST(SharedHelpersTest, OnlyUsageBadDataAndCorruptCheckpointAreTheWorkersDiagnosis) {
  for (int code = 0; code < 256; ++code) {
    EXPECT_EQ(is_worker_diagnosis(code), code == 2 || code == 3 || code == 5) << code;
  }
}

TEST(SharedHelpersTest, SecondsSinceCountsForward) {
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_GE(seconds_since(t0), 0.02);
}

}  // namespace
}  // namespace dnallm
