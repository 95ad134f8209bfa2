// DNABERT-2 (zhihan1996/DNABERT-2-117M): its auto_map and fused tensors (Note [DNABERT-2 import]).
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/transformer/hf_import_detail.hpp"

namespace dnallm::models {

using nlohmann::json;
using namespace detail;  // hf_import_detail.hpp

namespace detail {

// Note [DNABERT-2 import]: DNABERT-2 (zhihan1996/DNABERT-2-117M, MosaicBERT) says model_type
// "bert" but runs its own code (auto_map -> bert_layers.py): ALiBi instead of positions, a
// fused Wqkv (rows: all heads' queries, then keys, then values), a GLU feed-forward
// gated_layers [2 x intermediate, hidden] without bias whose first half goes through exact
// GELU and multiplies the second half, then wo; post-LN blocks; token-type embeddings (row 0
// added); MLM head decoder tied to the word embeddings with its own bias. It is recognised by
// its auto_map (every entry one of those classes, optionally "<repo>--" prefixed), never by
// model_type alone; a tensor of another layout is then refused by name. The reference code is
// not run here: its config keys that change nothing we compute (alibi_starting_size: our
// biases extend to any length; max_position_embeddings: only its token-type buffer) are read
// and checked.
// One DNABERT-2 auto_map target ("<repo>--" prefix allowed): "" when `value` is none of its
// classes, else the class without the prefix.
std::string dnabert2_target(const json& value) {
  static const std::set<std::string> known = {
      "configuration_bert.BertConfig", "bert_layers.BertModel", "bert_layers.BertForMaskedLM",
      "bert_layers.BertForSequenceClassification"};
  if (!value.is_string()) return "";
  std::string ref = value.get<std::string>();
  if (const auto sep = ref.find("--"); sep != std::string::npos) ref = ref.substr(sep + 2);
  return known.count(ref) ? ref : "";
}

bool is_dnabert2_auto_map(const json& auto_map) {
  if (!auto_map.is_object() || auto_map.empty()) return false;
  bool has_config = false;
  for (const auto& [key, value] : auto_map.items()) {
    const std::string ref = dnabert2_target(value);
    if (ref.empty()) return false;
    has_config = has_config || ref == "configuration_bert.BertConfig";
  }
  return has_config;
}

// DNABERT-2's fused tensors (Note [DNABERT-2 import]): Wqkv [3 x hidden, hidden] and its bias
// split into query, key and value (row blocks in that order); gated_layers [2 x ffn, hidden]
// into the gate (first half, through GELU) and the up projection (second half). Returns false
// for any other tensor.
bool split_dnabert2_fused(const std::string& weights_path, const std::string& hf_name,
                          const Shape& t, HfCheckpoint& h) {
  const ModelOptions& o = h.options;
  auto ends = [&](const std::string& s) {
    return hf_name.size() >= s.size() &&
           hf_name.compare(hf_name.size() - s.size(), s.size(), s) == 0;
  };
  const std::string layer = hf_name.substr(0, hf_name.find(".attention.") < hf_name.find(".mlp.")
                                                  ? hf_name.find(".attention.")
                                                  : hf_name.find(".mlp."));
  if (ends(".attention.self.Wqkv.weight") || ends(".attention.self.Wqkv.bias")) {
    const bool is_weight = ends(".weight");
    DNALLM_CHECK(t.size() == (is_weight ? 2u : 1u) && t[0] == 3 * o.hidden &&
                     (!is_weight || t[1] == o.hidden),
                 ExitCode::kUsage, "{}: {} has shape {} but config.json implies {}x{}",
                 weights_path, hf_name, shape_text(t), 3 * o.hidden, o.hidden);
    const char* names[] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) {
      add_row_block(h, layer + ".attention.self." + names[i] + (is_weight ? ".weight" : ".bias"),
                    hf_name, t, i, 3);
    }
    return true;
  }
  if (ends(".mlp.gated_layers.weight")) {
    DNALLM_CHECK(t.size() == 2 && t[0] == 2 * o.ffn && t[1] == o.hidden, ExitCode::kUsage,
                 "{}: {} has shape {} but config.json implies {}x{}", weights_path, hf_name,
                 shape_text(t), 2 * o.ffn, o.hidden);
    add_row_block(h, layer + ".intermediate.gate.weight", hf_name, t, 0, 2);
    add_row_block(h, layer + ".intermediate.dense.weight", hf_name, t, 1, 2);
    return true;
  }
  return false;
}

}  // namespace detail

}  // namespace dnallm::models
