// gpt_neox (Pythia) and llama: Llama's config keys, the rotary settings (Note [Rotary config])
// and GPT-NeoX's fused query_key_value.
#include <cstring>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/transformer/hf_import_detail.hpp"

namespace dnallm::models {

using nlohmann::json;
using namespace detail;  // hf_import_detail.hpp

namespace detail {

// Llama: multi-head or grouped-query attention (num_key_value_heads, checked with the other
// sizes by check_model_shape) and the standard MLP.
void check_llama_config(const json& c, const std::string& path) {
  const auto heads = c.value("num_attention_heads", int64_t{0});
  if (c.contains("head_dim") && !c["head_dim"].is_null() && heads > 0) {
    DNALLM_CHECK(c["head_dim"] == c.value("hidden_size", int64_t{0}) / heads, ExitCode::kUsage,
                 "{}: head_dim = {} is not supported: supported is hidden_size / "
                 "num_attention_heads",
                 path, c["head_dim"].dump());
  }
  expect_value(c, path, "mlp_bias", false, "supported is false");
  expect_value(c, path, "pretraining_tp", 1, "supported is 1");
}

// Note [Rotary config]: where a config.json says the rotary base and the rotating share of
// each head (Note [Rotary variants] in positions.cpp), read as transformers reads them. Several
// keys say the same thing, written by different transformers versions:
//   base:     rope_parameters.rope_theta (transformers 5), rope_theta (Llama), rotary_emb_base
//             (GPT-NeoX);
//   fraction: rope_parameters.partial_rotary_factor (5), rotary_pct (GPT-NeoX),
//             partial_rotary_factor.
// transformers 5 reads, for gpt_neox, rope_parameters first, else rotary_emb_base (10000) and
// rotary_pct (0.25: GPTNeoXConfig's default, as in transformers 4); for llama rope_parameters,
// else rope_theta (10000), and the whole head (its rotary ignores partial_rotary_factor);
// ESM's rotary is base 10000 over the whole head whatever the file says. Every such key present
// must agree with the value read: a file whose keys disagree would compute differently under
// another transformers version, and one asking a model type for what its code ignores (ESM with
// rope_theta 500000, Llama with a partial rotary) was not made by that code: both are refused.

RotaryConfig read_rotary_config(const json& c, const std::string& path,
                                const std::string& model_type) {
  DNALLM_CHECK(c.value("rope_scaling", json()).is_null(), ExitCode::kUsage,
               "{}: rope_scaling = {} is not supported (unscaled rotary only)", path,
               clip_for_message(c["rope_scaling"].dump()));
  json rp = c.value("rope_parameters", json());
  DNALLM_CHECK(rp.is_null() || rp.is_object(), ExitCode::kUsage,
               "{}: rope_parameters = {} is not supported: supported is an object with "
               "rope_theta, partial_rotary_factor and rope_type",
               path, clip_for_message(rp.dump()));
  if (rp.is_null()) rp = json::object();
  for (const auto& [key, value] : rp.items()) {
    DNALLM_CHECK(key == "rope_theta" || key == "rope_type" || key == "partial_rotary_factor",
                 ExitCode::kUsage,
                 "{}: rope_parameters.{} is not supported: supported are rope_theta, "
                 "partial_rotary_factor and rope_type = \"default\"",
                 path, clip_for_message(key));
  }
  const std::string rope_type = rp.value("rope_type", std::string("default"));
  DNALLM_CHECK(rope_type == "default", ExitCode::kUsage,
               "{}: rope_parameters.rope_type = \"{}\" is not supported: supported is "
               "\"default\"",
               path, clip_for_message(rope_type));
  const bool neox = model_type == "gpt_neox", llama = model_type == "llama";
  // One setting's keys in the order transformers looks at them, each with whether this model
  // type's code reads it: the value is the first present key that is read (else `fallback`),
  // and every present key must equal it.
  struct Key {
    const char* name;  // "rope_parameters.<key>" or a top-level key
    bool read;
  };
  auto agreed = [&](const std::vector<Key>& keys, double fallback, const char* what) {
    std::vector<std::pair<std::string, double>> found;
    std::optional<double> value;
    for (const auto& k : keys) {
      const std::string name = k.name;
      const bool nested = name.rfind("rope_parameters.", 0) == 0;
      const std::string key = nested ? name.substr(std::strlen("rope_parameters.")) : name;
      const json& holder = nested ? rp : c;
      if (!holder.contains(key) || holder[key].is_null()) continue;
      DNALLM_CHECK(holder[key].is_number(), ExitCode::kUsage, "{}: {} = {} is not a number", path,
                   name, clip_for_message(holder[key].dump()));
      found.emplace_back(name, holder[key].get<double>());
      if (k.read && !value) value = found.back().second;
    }
    for (const auto& [name, v] : found) {
      DNALLM_CHECK(v == value.value_or(fallback), ExitCode::kUsage,
                   "{}: {} = {} is not supported: {} reads {} = {} (keys that disagree compute "
                   "differently under other transformers versions, and a value the model "
                   "type's code ignores was not made by it: make them equal)",
                   path, name, v, model_type, what, value.value_or(fallback));
    }
    return value.value_or(fallback);
  };
  RotaryConfig r;
  r.theta = agreed({{"rope_parameters.rope_theta", neox || llama},
                    {"rotary_emb_base", neox},
                    {"rope_theta", llama}},
                   10000.0, "the rotary base");
  // GPTNeoXConfig's default rotary_pct is 0.25 (transformers 4 and 5).
  r.fraction = agreed({{"rope_parameters.partial_rotary_factor", neox},
                       {"rotary_pct", neox},
                       {"partial_rotary_factor", false}},
                      neox ? 0.25 : 1.0, "the rotating share of each head");
  return r;
}

// gpt_neox's fused query_key_value, per head rows [head][q|k|v][head_dim]: split into our
// query, key and value tensors.
void split_fused_qkv(const std::string& weights_path, const std::string& hf_name,
                     const Shape& shape, HfCheckpoint& h) {
  const ModelOptions& o = h.options;
  const bool is_weight =
      hf_name.size() > 7 && hf_name.compare(hf_name.size() - 7, 7, ".weight") == 0;
  DNALLM_CHECK(shape.size() == (is_weight ? 2u : 1u) && shape[0] == 3 * o.hidden &&
                   (!is_weight || shape[1] == o.hidden),
               ExitCode::kUsage, "{}: {} has shape {} but config.json implies {}x{}", weights_path,
               hf_name, shape_text(shape), 3 * o.hidden, o.hidden);
  const std::string prefix = rename(h.model_type, hf_name.substr(0, hf_name.find(".attention.")));
  const char* parts[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    HfTensorSource source{hf_name, i, 3, /*per_head_qkv=*/true,
                          is_weight ? Shape{o.hidden, o.hidden} : Shape{o.hidden}};
    h.tensors[prefix + ".attention.self." + parts[i] + (is_weight ? ".weight" : ".bias")] = source;
  }
}

}  // namespace detail

}  // namespace dnallm::models
