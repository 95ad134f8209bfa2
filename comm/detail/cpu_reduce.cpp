#include "comm/detail/cpu_reduce.hpp"

#include <algorithm>
#include <cstdint>

#include "comm/half.hpp"
#include "core/error.hpp"

namespace dnallm::comm::detail {

namespace {

template <typename T>
void reduce_typed(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  if (op == ReduceOp::kMax) {
    for (size_t i = 0; i < n; ++i) o[i] = std::max(x[i], y[i]);
  } else {
    for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(x[i] + y[i]);
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void reduce_half(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<uint16_t*>(out);
  auto* x = static_cast<const uint16_t*>(a);
  auto* y = static_cast<const uint16_t*>(b);
  if (op == ReduceOp::kMax) {
    for (size_t i = 0; i < n; ++i) o[i] = FromFloat(std::max(ToFloat(x[i]), ToFloat(y[i])));
  } else {
    for (size_t i = 0; i < n; ++i) o[i] = FromFloat(ToFloat(x[i]) + ToFloat(y[i]));
  }
}

template <typename T>
void divide_typed(void* buf, size_t n, int d) {
  auto* p = static_cast<T*>(buf);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(d));
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void divide_half(void* buf, size_t n, int d) {
  auto* p = static_cast<uint16_t*>(buf);
  for (size_t i = 0; i < n; ++i) p[i] = FromFloat(ToFloat(p[i]) / static_cast<float>(d));
}

}  // namespace

void reduce_elements(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  switch (dtype) {
    case DType::kFloat32:
      return reduce_typed<float>(op, out, a, b, n);
    case DType::kFloat64:
      return reduce_typed<double>(op, out, a, b, n);
    case DType::kInt64:
      return reduce_typed<int64_t>(op, out, a, b, n);
    case DType::kInt32:
      return reduce_typed<int32_t>(op, out, a, b, n);
    case DType::kUInt8:
      return reduce_typed<uint8_t>(op, out, a, b, n);
    case DType::kInt8:
      return reduce_typed<int8_t>(op, out, a, b, n);
    case DType::kFloat16:
      return reduce_half<fp16_to_float, float_to_fp16>(op, out, a, b, n);
    case DType::kBFloat16:
      return reduce_half<bf16_to_float, float_to_bf16>(op, out, a, b, n);
  }
  fail(ExitCode::kFailure, "reduce_elements: unknown dtype {}", static_cast<int>(dtype));
}

void divide_elements(DType dtype, void* buf, size_t n, int d) {
  switch (dtype) {
    case DType::kFloat32:
      return divide_typed<float>(buf, n, d);
    case DType::kFloat64:
      return divide_typed<double>(buf, n, d);
    case DType::kInt64:
      return divide_typed<int64_t>(buf, n, d);
    case DType::kInt32:
      return divide_typed<int32_t>(buf, n, d);
    case DType::kUInt8:
      return divide_typed<uint8_t>(buf, n, d);
    case DType::kInt8:
      return divide_typed<int8_t>(buf, n, d);
    case DType::kFloat16:
      return divide_half<fp16_to_float, float_to_fp16>(buf, n, d);
    case DType::kBFloat16:
      return divide_half<bf16_to_float, float_to_bf16>(buf, n, d);
  }
  fail(ExitCode::kFailure, "divide_elements: unknown dtype {}", static_cast<int>(dtype));
}

}  // namespace dnallm::comm::detail
