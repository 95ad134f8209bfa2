#include "core/dtype.hpp"

#include "core/error.hpp"

namespace dnallm {
namespace {

// The one table of dtype names: ours (configuration, logs, checkpoint manifests), the
// safetensors header's, and the aliases parse_dtype() accepts.
struct DTypeNames {
  DType type;
  const char* name;
  const char* safetensors;
  const char* aliases[2];
};

constexpr DTypeNames kDTypeNames[] = {
    {DType::kFloat32, "fp32", "F32", {"float32", "float"}},
    {DType::kFloat64, "fp64", "F64", {"float64", "double"}},
    {DType::kFloat16, "fp16", "F16", {"float16", "half"}},
    {DType::kBFloat16, "bf16", "BF16", {"bfloat16", nullptr}},
    {DType::kInt64, "int64", "I64", {nullptr, nullptr}},
    {DType::kInt32, "int32", "I32", {nullptr, nullptr}},
    {DType::kUInt8, "uint8", "U8", {nullptr, nullptr}},
    {DType::kInt8, "int8", "I8", {nullptr, nullptr}},
};

const DTypeNames* names_of(DType t) {
  for (const auto& n : kDTypeNames) {
    if (n.type == t) return &n;
  }
  return nullptr;
}

}  // namespace

const char* dtype_name(DType t) {
  const auto* n = names_of(t);
  return n != nullptr ? n->name : "?";
}

DType parse_dtype(const std::string& name) {
  for (const auto& n : kDTypeNames) {
    if (name == n.name) return n.type;
    for (const char* alias : n.aliases) {
      if (alias != nullptr && name == alias) return n.type;
    }
  }
  fail(ExitCode::kUsage,
       "unknown dtype '{}'; use fp32, fp64, fp16, bf16, int64, int32, uint8 or int8", name);
}

const char* safetensors_dtype_name(DType t) {
  const auto* n = names_of(t);
  return n != nullptr ? n->safetensors : "?";
}

std::optional<DType> dtype_from_safetensors_name(const std::string& name) {
  for (const auto& n : kDTypeNames) {
    if (name == n.safetensors) return n.type;
  }
  return std::nullopt;
}

}  // namespace dnallm
