// Element types and typed buffer views shared by comm/ and checkpoint/, which never see
// LibTorch: worker/train/ adapts tensors to these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace dnallm {

enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt64 = 4,
  kInt32 = 5,
  kUInt8 = 6,
  kInt8 = 7,
};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kUInt8:
    case DType::kInt8:
      return 1;
  }
  return 0;
}

constexpr bool dtype_is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

// "fp32", "fp64", "fp16", "bf16", "int64", "int32", "uint8", "int8".
const char* dtype_name(DType t);
// Inverse of dtype_name; also accepts "float32", "float", "float64", "double", "float16",
// "half", "bfloat16". Throws Error(kUsage).
DType parse_dtype(const std::string& name);
// The safetensors header's names: "F32", "F64", "F16", "BF16", "I64", "I32", "U8", "I8".
const char* safetensors_dtype_name(DType t);
// Inverse of safetensors_dtype_name; nullopt for a name we do not support (e.g. "BOOL").
std::optional<DType> dtype_from_safetensors_name(const std::string& name);
// The element types as LibTorch's ScalarType: worker/tensor_buffer.hpp (worker/ only).

enum class DeviceType : uint8_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool is_cuda() const { return type == DeviceType::kCUDA; }
};

// A typed view of memory owned elsewhere: `count` elements of `dtype` at `data`.
struct BufferView {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  Device device{};
  size_t bytes() const { return count * dtype_size(dtype); }
};

}  // namespace dnallm
