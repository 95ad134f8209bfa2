// Between the .cpp files of the Hugging Face import (hf_import.hpp), not for other callers:
//   hf_import.cpp            the weights file, our names and shapes, read_hf_checkpoint
//   hf_import_config.cpp     config.json: the keys understood (Note [Nothing silently ignored])
//   hf_import_dnabert2.cpp   DNABERT-2 (Note [DNABERT-2 import])
//   hf_import_esm.cpp        ESM and the Nucleotide Transformer v2 remote code (Note [Remote code])
//   hf_import_causal.cpp     gpt_neox and llama (Note [Rotary config], fused query_key_value)
//   hf_finetune.cpp          PEFT adapters and fine-tuning from a Hugging Face directory
// bert (DNABERT-1) and roberta-prelayernorm need nothing of their own beyond the options
// (hf_import_config.cpp) and their names (hf_names.hpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "worker/models/transformer/hf_import.hpp"

namespace dnallm::models::detail {

using Shape = std::vector<int64_t>;

// hf_import_config.cpp
extern const char* const kSupported;  // what the import supports, for messages
void expect_value(const nlohmann::json& c, const std::string& path, const char* key,
                  const nlohmann::json& wanted, const char* what);
void read_model_class(const nlohmann::json& c, const std::string& path, HfCheckpoint& h);
void check_config(const nlohmann::json& c, const std::string& path, const std::string& model_type);
void set_arch_and_task(const nlohmann::json& c, const std::string& path, const HfCheckpoint& h,
                       ModelOptions& o);
void set_common_options(const nlohmann::json& c, const std::string& path, ModelOptions& o);
void set_model_type_options(const nlohmann::json& c, const std::string& path,
                            const std::string& model_type, ModelOptions& o);

// hf_import.cpp
std::string rename(const std::string& model_type, std::string name);
std::string shape_text(const Shape& s);
void add_row_block(HfCheckpoint& h, const std::string& ours, const std::string& hf_name,
                   const Shape& shape, int64_t part, int64_t parts);

// hf_import_dnabert2.cpp
std::string dnabert2_target(const nlohmann::json& value);
bool is_dnabert2_auto_map(const nlohmann::json& auto_map);
bool split_dnabert2_fused(const std::string& weights_path, const std::string& hf_name,
                          const Shape& t, HfCheckpoint& h);

// hf_import_esm.cpp
const std::map<std::string, std::string>& nt_v2_auto_map();
bool nt_v2_remote_code(const nlohmann::json& c);
void split_gated_dense(const std::string& weights_path, const std::string& hf_name, const Shape& t,
                       HfCheckpoint& h);
void check_rotary_table(const std::string& weights_path, const std::string& hf_name,
                        const torch::Tensor& t, const ModelOptions& o);

// hf_import_causal.cpp
void check_llama_config(const nlohmann::json& c, const std::string& path);
// The rotary base and rotating share a config.json says (Note [Rotary config]).
struct RotaryConfig {
  double theta = 10000.0;
  double fraction = 1.0;
};
RotaryConfig read_rotary_config(const nlohmann::json& c, const std::string& path,
                                const std::string& model_type);
void split_fused_qkv(const std::string& weights_path, const std::string& hf_name,
                     const Shape& shape, HfCheckpoint& h);

}  // namespace dnallm::models::detail
