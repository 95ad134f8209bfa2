#include "core/dtype.hpp"

#include "core/error.hpp"

namespace dnallm {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat64:
      return "fp64";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kInt64:
      return "int64";
    case DType::kInt32:
      return "int32";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32" || name == "float") return DType::kFloat32;
  if (name == "fp64" || name == "float64" || name == "double") return DType::kFloat64;
  if (name == "fp16" || name == "float16" || name == "half") return DType::kFloat16;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "int64") return DType::kInt64;
  if (name == "int32") return DType::kInt32;
  if (name == "uint8") return DType::kUInt8;
  if (name == "int8") return DType::kInt8;
  fail(ExitCode::kUsage,
       "unknown dtype '{}'; use fp32, fp64, fp16, bf16, int64, int32, uint8 or int8", name);
}

}  // namespace dnallm
