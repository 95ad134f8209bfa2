// Parameter names of the Hugging Face families in both directions: hf_import.cpp reads them
// (theirs -> ours), hf_export.cpp writes them (ours -> theirs), from one table of (our
// fragment, their fragment) per model type. translate() applies the rules in the table's
// order, each at most once to a name, at the first occurrence of its fragment that does not
// overlap text an earlier rule wrote (so ".output.LayerNorm." never matches inside the
// ".attention.output.LayerNorm." a rule just wrote). A fragment that contains another comes
// first. "bert" names are ours unchanged. Torch-free.
#pragma once

#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace dnallm::models::hf_names {

using Rule = std::pair<const char*, const char*>;  // (ours, theirs)

// An encoder family's rules: its own, then the masked-LM and classification heads that ESM
// and RoBERTa share, then its root prefix (last: the rules before it match ours "bert.").
inline std::vector<Rule> encoder_rules(std::vector<Rule> own, Rule root) {
  static const Rule heads[] = {
      {"cls.predictions.transform.dense.", "lm_head.dense."},
      {"cls.predictions.transform.LayerNorm.", "lm_head.layer_norm."},
      {"cls.predictions.decoder.", "lm_head.decoder."},
      {"cls.predictions.bias", "lm_head.bias"},
      {"bert.pooler.dense.", "classifier.dense."},
      {"classifier.", "classifier.out_proj."},
  };
  own.insert(own.end(), std::begin(heads), std::end(heads));
  own.push_back(root);
  return own;
}

// `model_type` as in config.json: "bert", "esm", "roberta-prelayernorm", "gpt_neox", "llama";
// "dnabert2" for a "bert" config whose auto_map is DNABERT-2's remote code.
inline const std::vector<Rule>& rules(const std::string& model_type) {
  static const std::vector<Rule> esm = encoder_rules(
      {
          {"bert.encoder.final_layer_norm.", "esm.encoder.emb_layer_norm_after."},
          {"embeddings.LayerNorm.", "embeddings.layer_norm."},  // no leading dot: "esm." ends in it
          {".attention.output.LayerNorm.", ".attention.LayerNorm."},
          {".output.LayerNorm.", ".LayerNorm."},
      },
      {"bert.", "esm."});
  static const std::vector<Rule> roberta_pre_ln = encoder_rules(
      {
          {"bert.encoder.final_layer_norm.", "roberta_prelayernorm.LayerNorm."},
          {".attention.output.LayerNorm.", ".attention.LayerNorm."},
          {".output.LayerNorm.", ".intermediate.LayerNorm."},
      },
      {"bert.", "roberta_prelayernorm."});
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
  // DNABERT-2 (MosaicBERT remote code; fused Wqkv and gated_layers are split/joined by
  // hf_import/hf_export). The first two rules keep the attention output's names from matching
  // the feed-forward's.
  static const std::vector<Rule> dnabert2 = {
      {".attention.output.dense.", ".attention.output.dense."},
      {".attention.output.LayerNorm.", ".attention.output.LayerNorm."},
      {".output.dense.", ".mlp.wo."},
      {".output.LayerNorm.", ".mlp.layernorm."},
      {"cls.predictions.bias", "cls.predictions.decoder.bias"},
  };
  static const std::vector<Rule> bert = {};
  if (model_type == "dnabert2") return dnabert2;
  if (model_type == "esm") return esm;
  if (model_type == "roberta-prelayernorm") return roberta_pre_ln;
  if (model_type == "llama") return llama;
  if (model_type == "gpt_neox") return gpt_neox;
  return bert;
}

// `name` in the other naming: theirs from ours (`to_theirs`) or ours from theirs.
inline std::string translate(std::string name, const std::vector<Rule>& rules, bool to_theirs) {
  std::vector<std::pair<size_t, size_t>> written;  // [begin, end) spans rules wrote
  auto overlaps = [&](size_t b, size_t e) {
    for (const auto& [wb, we] : written) {
      if (b < we && wb < e) return true;
    }
    return false;
  };
  for (const auto& [ours, theirs] : rules) {
    const std::string from = to_theirs ? ours : theirs;
    const std::string to = to_theirs ? theirs : ours;
    size_t pos = name.find(from);
    while (pos != std::string::npos && overlaps(pos, pos + from.size())) {
      pos = name.find(from, pos + 1);
    }
    if (pos == std::string::npos) continue;
    name.replace(pos, from.size(), to);
    const size_t grown = to.size() - from.size();  // modular: shifts the later spans either way
    for (auto& [wb, we] : written) {
      if (wb > pos) wb += grown, we += grown;
    }
    written.emplace_back(pos, pos + to.size());
  }
  return name;
}

}  // namespace dnallm::models::hf_names
