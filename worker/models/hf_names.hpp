// Parameter names of the causal families in both directions (hf_import.cpp reads them,
// hf_export.cpp writes them): one table of (our fragment, their fragment) per model type, in
// the order export applies them (a fragment that contains another comes first); each rule
// applies at most once to a name. Torch-free.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace dnallm::models::hf_names {

using Rule = std::pair<const char*, const char*>;  // (ours, theirs)

inline const std::vector<Rule>& causal_rules(const std::string& model_type) {
  static const std::vector<Rule> llama = {
      {"gpt.embeddings.word_embeddings.", "model.embed_tokens."},
      {"gpt.encoder.final_layer_norm.", "model.norm."},
      {"gpt.encoder.layer.", "model.layers."},
      {".attention.output.LayerNorm.", ".input_layernorm."},
      {".output.LayerNorm.", ".post_attention_layernorm."},
      {".attention.self.query.", ".self_attn.q_proj."},
      {".attention.self.key.", ".self_attn.k_proj."},
      {".attention.self.value.", ".self_attn.v_proj."},
      {".attention.output.dense.", ".self_attn.o_proj."},
      {".intermediate.dense.", ".mlp.up_proj."},
      {".intermediate.gate.", ".mlp.gate_proj."},
      {".output.dense.", ".mlp.down_proj."},
  };
  static const std::vector<Rule> gpt_neox = {
      {"gpt.embeddings.word_embeddings.", "gpt_neox.embed_in."},
      {"gpt.encoder.final_layer_norm.", "gpt_neox.final_layer_norm."},
      {"gpt.encoder.layer.", "gpt_neox.layers."},
      {".attention.output.LayerNorm.", ".input_layernorm."},
      {".output.LayerNorm.", ".post_attention_layernorm."},
      {".attention.output.dense.", ".attention.dense."},
      {".intermediate.dense.", ".mlp.dense_h_to_4h."},
      {".output.dense.", ".mlp.dense_4h_to_h."},
      {"lm_head.", "embed_out."},
  };
  return model_type == "llama" ? llama : gpt_neox;
}

// `name` in the other naming: theirs from ours (`to_theirs`) or ours from theirs.
inline std::string translate(std::string name, const std::vector<Rule>& rules, bool to_theirs) {
  for (const auto& [ours, theirs] : rules) {
    const std::string from = to_theirs ? ours : theirs;
    const std::string to = to_theirs ? theirs : ours;
    const auto pos = name.find(from);
    if (pos != std::string::npos) name.replace(pos, from.size(), to);
  }
  return name;
}

}  // namespace dnallm::models::hf_names
