// Shared helpers for checkpoint tests: a temporary directory and deterministic data.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoint/types.hpp"
#include "core/error.hpp"

namespace dnallm::checkpoint::testing {

// Every dtype a checkpoint stores.
inline constexpr DType kAllDTypes[] = {DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                                       DType::kBFloat16, DType::kInt64,   DType::kInt32,
                                       DType::kUInt8,    DType::kInt8};

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            (std::string("dnallm_ckpt_") + (info ? info->name() : "x") + "_" +
             std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Bytes of `n` elements of `dtype`: small-magnitude normals for floating types (like
// trained weights), uniform integers otherwise.
inline std::vector<uint8_t> make_data(DType dtype, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<uint8_t> out(n * dtype_size(dtype));
  for (size_t i = 0; i < n; ++i) {
    uint8_t* p = out.data() + i * dtype_size(dtype);
    const float f = normal(rng);
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(p, &f, 4);
        break;
      case DType::kFloat64: {
        double d = f;
        std::memcpy(p, &d, 8);
        break;
      }
      case DType::kFloat16:
      case DType::kBFloat16: {  // top 16 bits of the fp32 pattern: a valid bf16
        uint32_t u;
        std::memcpy(&u, &f, 4);
        uint16_t h = static_cast<uint16_t>(u >> 16);
        std::memcpy(p, &h, 2);
        break;
      }
      default: {
        uint64_t v = rng();
        std::memcpy(p, &v, dtype_size(dtype));
      }
    }
  }
  return out;
}

inline TensorSpec spec(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  TensorSpec s;
  s.name = name;
  s.dtype = dtype;
  s.shape = std::move(shape);
  return s;
}

// Runs `f`, expects an Error with exit code `want`, returns its message ("" and a failure
// when nothing is thrown).
inline std::string error_of(const std::function<void()>& f, ExitCode want) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), want) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

// Flips one byte of a file at `offset` (from the start; negative: from the end).
void flip_byte(const std::filesystem::path& path, int64_t offset);

}  // namespace dnallm::checkpoint::testing
