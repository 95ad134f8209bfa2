// Caduceus's options (Note [Caduceus] in caduceus.hpp): the model's shape and what config.json
// says, shared by the Mamba mixer (mamba.hpp) and the model (caduceus.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

namespace dnallm::models::caduceus {

struct CaduceusOptions {
  int64_t vocab_size = 16;  // padded to pad_vocab_size_multiple
  int64_t d_model = 256;
  int64_t n_layer = 16;
  int64_t d_state = 16;
  int64_t d_conv = 4;
  int64_t expand = 2;
  int64_t dt_rank = 16;
  bool rms_norm = true;
  double norm_eps = 1e-5;
  bool rcps = false;
  // config.json's fused_add_norm (true in the published configs, and CaduceusConfig's default):
  // Note [Caduceus fused add+norm]. Only RCPS computes differently with it; the tensor names of
  // its norms lose ".submodule". (Options built here, not read from a config, stay unfused.)
  bool fused_add_norm = false;
  bool bidirectional = true;
  std::vector<int64_t> complement;  // token id -> its complement's id (RCPS)
  bool classifier = false;
  int64_t num_labels = 2;
  // Note [Caduceus tied head]: an RCPS masked LM's lm_head IS the word-embedding matrix, as the
  // hub code ties it on load whatever the config says (CaduceusForMaskedLM.tie_weights ->
  // RCPSLMHead.set_weight; the Caduceus-PS fixture's reference logits use the embedding). Not
  // RCPS, the hub code defers to transformers, and transformers 5 ties nothing there (the
  // Caduceus-Ph fixture's lm_head is its own), so Caduceus-Ph keeps a separate head unless its
  // config.json says tie_word_embeddings = true; our exports write the key, so that
  // transformers 4 (which ties when it is absent) computes the same. false for RCPS: a
  // Caduceus-PS trained before the tie, resumed or loaded with the head_weight it has.
  bool tie_head = false;
  nlohmann::json hf_config;  // the imported config.json (export writes it back)

  // Whether lm_head is the embedding (a masked LM with tie_head).
  bool tied_head() const { return !classifier && tie_head; }

  int64_t d_inner() const { return expand * d_model; }
};

}  // namespace dnallm::models::caduceus
