// One table of parameter names per Hugging Face family, read both ways: export (ours ->
// theirs) and import (theirs -> ours) agree on every name transformers uses, and each is the
// other's inverse. Torch-free; the fixtures' round trips (hf_import_test) check the tensors.
#include "worker/models/transformer/hf_names.hpp"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace dnallm::models::hf_names {
namespace {

using Pairs = std::vector<std::pair<std::string, std::string>>;  // (ours, theirs)

void expect_both_ways(const std::string& model_type, const Pairs& pairs) {
  const auto& r = rules(model_type);
  for (const auto& [ours, theirs] : pairs) {
    EXPECT_EQ(translate(ours, r, true), theirs) << model_type << ": " << ours;
    EXPECT_EQ(translate(theirs, r, false), ours) << model_type << ": " << theirs;
  }
}

TEST(HfNamesTest, Esm) {
  expect_both_ways(
      "esm",
      {
          {"bert.embeddings.word_embeddings.weight", "esm.embeddings.word_embeddings.weight"},
          {"bert.encoder.final_layer_norm.weight", "esm.encoder.emb_layer_norm_after.weight"},
          {"bert.encoder.layer.0.attention.self.query.weight",
           "esm.encoder.layer.0.attention.self.query.weight"},
          {"bert.encoder.layer.0.attention.output.LayerNorm.weight",
           "esm.encoder.layer.0.attention.LayerNorm.weight"},
          {"bert.encoder.layer.11.output.LayerNorm.bias", "esm.encoder.layer.11.LayerNorm.bias"},
          {"bert.encoder.layer.2.output.dense.weight", "esm.encoder.layer.2.output.dense.weight"},
          {"cls.predictions.transform.dense.weight", "lm_head.dense.weight"},
          {"cls.predictions.transform.LayerNorm.bias", "lm_head.layer_norm.bias"},
          {"cls.predictions.bias", "lm_head.bias"},
          {"cls.predictions.decoder.weight", "lm_head.decoder.weight"},
          {"bert.pooler.dense.weight", "classifier.dense.weight"},
          {"classifier.bias", "classifier.out_proj.bias"},
      });
  // ESM checkpoints with an embedding LayerNorm spell it in lower case.
  EXPECT_EQ(translate("esm.embeddings.layer_norm.weight", rules("esm"), false),
            "bert.embeddings.LayerNorm.weight");
}

TEST(HfNamesTest, RobertaPreLayerNorm) {
  expect_both_ways(
      "roberta-prelayernorm",
      {
          {"bert.embeddings.LayerNorm.weight", "roberta_prelayernorm.embeddings.LayerNorm.weight"},
          {"bert.encoder.final_layer_norm.bias", "roberta_prelayernorm.LayerNorm.bias"},
          {"bert.encoder.layer.1.attention.output.LayerNorm.weight",
           "roberta_prelayernorm.encoder.layer.1.attention.LayerNorm.weight"},
          {"bert.encoder.layer.1.output.LayerNorm.weight",
           "roberta_prelayernorm.encoder.layer.1.intermediate.LayerNorm.weight"},
          {"bert.encoder.layer.1.intermediate.dense.weight",
           "roberta_prelayernorm.encoder.layer.1.intermediate.dense.weight"},
          {"cls.predictions.transform.LayerNorm.weight", "lm_head.layer_norm.weight"},
          {"bert.pooler.dense.bias", "classifier.dense.bias"},
          {"classifier.weight", "classifier.out_proj.weight"},
      });
}

TEST(HfNamesTest, CausalFamilies) {
  expect_both_ways(
      "gpt_neox",
      {
          {"gpt.embeddings.word_embeddings.weight", "gpt_neox.embed_in.weight"},
          {"gpt.encoder.final_layer_norm.bias", "gpt_neox.final_layer_norm.bias"},
          {"gpt.encoder.layer.0.attention.output.LayerNorm.weight",
           "gpt_neox.layers.0.input_layernorm.weight"},
          {"gpt.encoder.layer.0.output.LayerNorm.weight",
           "gpt_neox.layers.0.post_attention_layernorm.weight"},
          {"gpt.encoder.layer.0.attention.output.dense.weight",
           "gpt_neox.layers.0.attention.dense.weight"},
          {"gpt.encoder.layer.0.output.dense.bias", "gpt_neox.layers.0.mlp.dense_4h_to_h.bias"},
          {"lm_head.weight", "embed_out.weight"},
      });
  expect_both_ways(
      "llama",
      {
          {"gpt.encoder.final_layer_norm.weight", "model.norm.weight"},
          {"gpt.encoder.layer.3.attention.self.key.weight",
           "model.layers.3.self_attn.k_proj.weight"},
          {"gpt.encoder.layer.3.attention.output.dense.weight",
           "model.layers.3.self_attn.o_proj.weight"},
          {"gpt.encoder.layer.3.intermediate.gate.weight", "model.layers.3.mlp.gate_proj.weight"},
          {"gpt.encoder.layer.3.output.dense.weight", "model.layers.3.mlp.down_proj.weight"},
          {"gpt.encoder.layer.3.output.LayerNorm.weight",
           "model.layers.3.post_attention_layernorm.weight"},
      });
}

TEST(HfNamesTest, BertNamesAreOurs) {
  const std::string name = "bert.encoder.layer.0.attention.output.LayerNorm.weight";
  EXPECT_EQ(translate(name, rules("bert"), true), name);
  EXPECT_EQ(translate(name, rules("bert"), false), name);
}

TEST(HfNamesTest, ARuleNeverRewritesWhatAnEarlierRuleWrote) {
  // (".output.LayerNorm." <- ".LayerNorm.") must not fire inside the ".attention.output.
  // LayerNorm." that the rule before it wrote.
  EXPECT_EQ(translate("x.attention.LayerNorm.y",
                      {{".attention.output.LayerNorm.", ".attention.LayerNorm."},
                       {".output.LayerNorm.", ".LayerNorm."}},
                      false),
            "x.attention.output.LayerNorm.y");
}

}  // namespace
}  // namespace dnallm::models::hf_names
