// Reading a downloaded Hugging Face model directory (hf_import.cpp, and the families with a
// module of their own: HyenaDNA, Caduceus): Note [Untrusted files] (core/untrusted_file.hpp)
// for its JSON files, bounded integer keys, safetensors only, finite tensors. Each refusal is
// one line naming the file and key.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models {

// A JSON file of a model or adapter directory; `holds` says what such a directory holds.
// Note [Untrusted files]: a regular file of bounded size, strict JSON (no key twice), an object.
inline nlohmann::json read_directory_json(const std::string& path, const char* holds) {
  std::error_code ec;
  DNALLM_CHECK(
      std::filesystem::symlink_status(path, ec).type() != std::filesystem::file_type::not_found,
      ExitCode::kUsage, "{} not found: {}", path, holds);
  auto c = parse_json_strict(
      read_bounded_file(path, kMaxConfigFileBytes, ExitCode::kUsage, "configuration file"), path,
      ExitCode::kUsage);
  DNALLM_CHECK(c.is_object(), ExitCode::kUsage, "{} is not a JSON object: {}", path, holds);
  return c;
}

// Whether `c` is an object whose "model_type" is the string `model_type`.
inline bool has_model_type(const nlohmann::json& c, const std::string& model_type) {
  return c.is_object() && c.contains("model_type") && c["model_type"].is_string() &&
         c["model_type"].get<std::string>() == model_type;
}

// <dir>/config.json (read_directory_json) whose model_type is `model_type`; else Error(kUsage).
inline nlohmann::json read_family_config(const std::string& dir, const std::string& model_type,
                                         const std::string& family) {
  const std::string path = dir + "/config.json";
  auto c = read_directory_json(path, "a model directory holds config.json");
  DNALLM_CHECK(has_model_type(c, model_type), ExitCode::kUsage,
               "{}: not a {} config (model_type is not \"{}\")", path, family, model_type);
  return c;
}

// `c[key]` as true or false, or `fallback` when absent or null; else Error(kUsage) (a
// downloaded config.json is untrusted: a wrong type is a refusal naming the key, not an
// internal error).
inline bool family_bool(const nlohmann::json& c, const std::string& key, bool fallback,
                        const std::string& where) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  DNALLM_CHECK(c[key].is_boolean(), ExitCode::kUsage, "{}: \"{}\" = {} is not true or false", where,
               key, clip_for_message(c[key].dump()));
  return c[key].get<bool>();
}

// `c[key]` as a string, or `fallback` when absent or null; else Error(kUsage).
inline std::string family_string(const nlohmann::json& c, const std::string& key,
                                 const std::string& fallback, const std::string& where) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  DNALLM_CHECK(c[key].is_string(), ExitCode::kUsage, "{}: \"{}\" = {} is not a string", where, key,
               clip_for_message(c[key].dump()));
  return c[key].get<std::string>();
}

// `c[key]` as an integer in [lo, hi], or `fallback` when absent or null; else Error(kUsage).
inline int64_t family_int(const nlohmann::json& c, const std::string& key, int64_t fallback,
                          int64_t lo, int64_t hi, const std::string& where,
                          const std::string& family) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  DNALLM_CHECK(c[key].is_number_integer(), ExitCode::kUsage, "{}: \"{}\" = {} is not an integer",
               where, key, clip_for_message(c[key].dump()));
  const int64_t v = c[key].get<int64_t>();
  DNALLM_CHECK(v >= lo && v <= hi, ExitCode::kUsage,
               "{}: \"{}\" = {} is outside [{}, {}]: the file is damaged or not a {} config", where,
               key, v, lo, hi, family);
  return v;
}

// <dir>/model.safetensors, which must exist: a pickle (pytorch_model.bin) is code, never read.
inline std::string family_weights(const std::string& dir, const std::string& family) {
  const std::string path = dir + "/model.safetensors";
  std::error_code ec;
  DNALLM_CHECK(
      std::filesystem::exists(path, ec), ExitCode::kUsage,
      "{} not found{}: {} directories are read from safetensors only (a pickle is code); "
      "convert it with transformers' save_pretrained(safe_serialization=True)",
      path,
      std::filesystem::exists(dir + "/pytorch_model.bin", ec) ? " (pytorch_model.bin is)" : "",
      family);
  return path;
}

// One tensor of `reader` as fp32; NaN or infinite values are a damaged file (exit 5).
inline torch::Tensor read_finite_tensor(checkpoint::SafetensorsReader& reader,
                                        const checkpoint::SafetensorsEntry& e,
                                        const std::string& path, const std::string& name) {
  auto t = torch::empty(e.spec.shape, torch::TensorOptions().dtype(torch_dtype(e.spec.dtype)));
  reader.read(e, t.data_ptr());
  DNALLM_CHECK(!t.is_floating_point() || t.numel() == 0 || torch::isfinite(t).all().item<bool>(),
               ExitCode::kCheckpointCorrupt,
               "{}: tensor {} holds NaN or infinite values: the file is damaged; re-download it",
               path, clip_for_message(name));
  return t.to(torch::kFloat32);
}

}  // namespace dnallm::models
