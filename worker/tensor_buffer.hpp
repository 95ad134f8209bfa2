// The one mapping between our element types (core/dtype.hpp) and LibTorch's ScalarType, and
// typed buffer views of tensors: how worker/ hands tensors to comm/ and checkpoint/, which
// never see LibTorch.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>

#include "core/dtype.hpp"

namespace dnallm {

namespace detail {
struct TorchDType {
  DType dtype;
  torch::ScalarType scalar;
};
inline constexpr TorchDType kTorchDTypes[] = {
    {DType::kFloat32, torch::kFloat32}, {DType::kFloat64, torch::kFloat64},
    {DType::kFloat16, torch::kFloat16}, {DType::kBFloat16, torch::kBFloat16},
    {DType::kInt64, torch::kInt64},     {DType::kInt32, torch::kInt32},
    {DType::kUInt8, torch::kUInt8},     {DType::kInt8, torch::kInt8},
};
}  // namespace detail

// Every DType has a ScalarType.
inline torch::ScalarType torch_dtype(DType t) {
  for (const auto& m : detail::kTorchDTypes) {
    if (m.dtype == t) return m.scalar;
  }
  return torch::kUInt8;  // unreachable: the table covers every DType
}

// The DType of a ScalarType; nullopt for those we do not carry (bool, complex, ...).
inline std::optional<DType> dtype_of(torch::ScalarType t) {
  for (const auto& m : detail::kTorchDTypes) {
    if (m.scalar == t) return m.dtype;
  }
  return std::nullopt;
}

// `count` elements of `dtype` from element `begin` of `t` (contiguous; no copy, no ownership).
inline BufferView buffer_view(const torch::Tensor& t, int64_t begin, int64_t count, DType dtype) {
  BufferView v;
  v.data = static_cast<char*>(t.data_ptr()) + begin * static_cast<int64_t>(dtype_size(dtype));
  v.count = static_cast<size_t>(count);
  v.dtype = dtype;
  if (t.is_cuda()) v.device = Device{DeviceType::kCUDA, static_cast<int>(t.get_device())};
  return v;
}

}  // namespace dnallm
