// ESM (Nucleotide Transformer v1) and the Nucleotide Transformer v2 remote code (Note [Remote
// code]): its auto_map, its gated intermediate.dense and the stored rotary table.

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/transformer/hf_import_detail.hpp"

namespace dnallm::models {

using nlohmann::json;
using torch::Tensor;
using namespace detail;  // hf_import_detail.hpp

namespace detail {

// Note [Remote code]: auto_map names a repository's own Python classes (trust_remote_code),
// which are never run here. Accepted are only the targets whose code was read and whose function
// this import computes: the Nucleotide Transformer v2 / AgroNT repositories' (InstaDeepAI on the
// Hugging Face hub) esm_config.EsmConfig and modeling_esm.EsmFor*: transformers' ESM (model_type
// "esm") with a SwiGLU feed-forward, intermediate.dense [2 x intermediate_size, hidden] giving
// silu(first half) * second half, biases only with add_bias_fnn, and an
// embeddings.position_embeddings table that rotary models carry without reading it.
const std::map<std::string, std::string>& nt_v2_auto_map() {
  static const std::map<std::string, std::string> targets = {
      {"AutoConfig", "esm_config.EsmConfig"},
      {"AutoModelForMaskedLM", "modeling_esm.EsmForMaskedLM"},
      {"AutoModelForSequenceClassification", "modeling_esm.EsmForSequenceClassification"},
      {"AutoModelForTokenClassification", "modeling_esm.EsmForTokenClassification"}};
  return targets;
}

// True for a config.json of the Nucleotide Transformer v2 remote code (checked by read_auto_map).
bool nt_v2_remote_code(const json& c) {
  return c.contains("auto_map") && c["auto_map"].is_object() &&
         c["auto_map"].value("AutoConfig", json()) == "esm_config.EsmConfig";
}

// Nucleotide Transformer v2's intermediate.dense [2 x ffn, hidden] (Note [Remote code]): the
// first half is the SiLU-gated one (our intermediate.gate), the second our intermediate.dense.
void split_gated_dense(const std::string& weights_path, const std::string& hf_name, const Shape& t,
                       HfCheckpoint& h) {
  const int64_t f = h.options.ffn;
  DNALLM_CHECK(!t.empty() && t[0] == 2 * f, ExitCode::kUsage,
               "{}: {} has shape {} but config.json implies {} rows (2 x intermediate_size)",
               weights_path, hf_name, shape_text(t), 2 * f);
  std::string dense = rename(h.model_type, hf_name), gate = dense;
  const std::string part = ".intermediate.dense.";
  gate.replace(gate.find(part), part.size(), ".intermediate.gate.");
  add_row_block(h, gate, hf_name, t, 0, 2);
  add_row_block(h, dense, hf_name, t, 1, 2);
}

// A stored rotary frequency table must be the base-10000 one this import computes.
void check_rotary_table(const std::string& weights_path, const std::string& hf_name,
                        const Tensor& t, const ModelOptions& o) {
  const int64_t hd = o.hidden / o.heads;
  auto expected = torch::pow(10000.0, -torch::arange(0, hd, 2, torch::kFloat64) / double(hd));
  DNALLM_CHECK(o.rotary && t.numel() == expected.numel() &&
                   torch::allclose(t.to(torch::kFloat64).flatten(), expected, 1e-6, 0),
               ExitCode::kUsage,
               "{}: {} is not the base-10000 rotary frequency table this import computes",
               weights_path, hf_name);
}

}  // namespace detail

}  // namespace dnallm::models
