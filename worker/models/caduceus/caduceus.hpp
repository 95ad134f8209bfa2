// Caduceus (kuleshov-group/caduceus-{ph,ps}_seqlen-131k_d_model-*_n_layer-*): bidirectional
// Mamba with reverse-complement parameter sharing, without mamba-ssm. Note [Caduceus]:
//   mamba      xz = in_proj(x); x = silu(causal depthwise conv1d(x)); dt, B, C = x_proj(x);
//              delta = softplus(dt_proj.weight dt + dt_proj.bias); A = -exp(A_log);
//              h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t; y_t = C_t h_t + D u_t;
//              out_proj(y * silu(z))      (the selective scan in fp32: selective_scan, mamba.hpp)
//   bimamba    mamba_fwd(x) + flip(mamba_rev(flip(x))), the two sharing in_proj and out_proj
//   block      residual = x + residual; x = mixer(norm(residual))   (norm: RMSNorm or LayerNorm)
//   RCPS (-PS) the stream holds 2 d_model channels: the forward half and the reverse complement
//              of the other (flip over sequence and channels); embedding, every norm and mixer
//              and the LM head apply the same weights to both halves (Zhou et al. 2022), so the
//              output on the reverse complement of a sequence is the RC-permuted output.
//   fused      Note [Caduceus fused add+norm]: with fused_add_norm, RCPSMambaBlock normalises the
//              two halves swapped (modeling_rcps.py passes the second half, unflipped, where
//              the unfused RCPSAddNormWrapper passes the first, and the first half flipped where
//              it passes the flipped second), and its residual comes out swapped the same way:
//              every block computes the unfused add+norm of the half-swapped stream and
//              residual. The final norm_f is the same in both paths.
// Heads: masked LM (lm_head, tied to the embedding in the published models; the RCPS head adds
// the complement-permuted logits of the second half) and sequence classification (score, mean
// pooling over every position; RCPS: the two halves' logits averaged).
// Parameter names map one to one onto the Hugging Face ones (caduceus.backbone...): hf_names in
// caduceus.cpp, used by import and export alike.
#pragma once

#include <torch/torch.h>

#include <cmath>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "worker/models/block_hooks.hpp"
#include "worker/models/caduceus/caduceus_options.hpp"
#include "worker/models/caduceus/mamba.hpp"
#include "worker/models/family_io.hpp"
#include "worker/models/lora_linear.hpp"

namespace dnallm::models::caduceus {

struct MambaContext;  // worker/models/caduceus/mamba_context.hpp

class CaduceusLMImpl : public torch::nn::Module {
 public:
  explicit CaduceusLMImpl(CaduceusOptions options);
  // Final hidden states [B, L, d_model] (RCPS: [B, L, 2 d_model]).
  torch::Tensor hidden(const torch::Tensor& input_ids);
  // Masked LM: logits [B, L, vocab]; classifier: [B, num_labels].
  torch::Tensor forward(const torch::Tensor& input_ids);
  const CaduceusOptions& options() const { return options_; }

  torch::nn::Embedding word_embeddings{nullptr};
  std::vector<Mamba> fwd, rev;
  std::vector<torch::Tensor> norm_weight, norm_bias;  // per layer; bias undefined for RMSNorm
  torch::Tensor norm_f_weight, norm_f_bias;
  // lm_head [vocab, d] or score [labels, d]; undefined when options().tied_head(): head() is
  // then the embedding's weight (Note [Caduceus tied head]).
  torch::Tensor head_weight;
  const torch::Tensor& head() const {
    return options_.tied_head() ? word_embeddings->weight : head_weight;
  }
  torch::Tensor complement;                 // int64 [vocab] (RCPS)
  std::shared_ptr<BlockHooks> block_hooks;  // Note [Block hooks]: around mixer i (null: none)
  // Note [Caduceus activation checkpointing]: in training with gradients, each mixer's
  // activations are recomputed in backward rather than kept.
  bool gradient_checkpointing = false;

  // Layer `layer`'s mixer (BiMamba; RCPS: on both strands) on its normed input [B, L, width].
  torch::Tensor mixer(size_t layer, const torch::Tensor& x);
  // Note [Mamba context parallelism]: inputs are sequence shards, mixers run over these groups
  // (null: off).
  std::shared_ptr<MambaContext> context;

 private:
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) const;
  CaduceusOptions options_;
};
TORCH_MODULE(CaduceusLM);

// Note [Caduceus PEFT names]: the hub layout's module names for our LoRA target `ours`
// ("mamba_fwd_<i>.in_proj" or ".out_proj", Note [Caduceus LoRA targets]), under which
// adapter_model.safetensors holds its adapter, so that PEFT applies it to the hub model (final/hf):
// caduceus.backbone.layers.<i>.mixer[.submodule].mamba_fwd.<linear>, and with BiMamba also
// mamba_rev's, whose own Linear in the hub code holds the tied weight (PEFT gives each module
// an adapter; both carry ours, so the hub model computes what ours does). {ours} for any other
// name.
std::vector<std::string> hf_module_names(const CaduceusOptions& o, const std::string& ours);

// A config.json of Caduceus' layout (d_model, n_layer, vocab_size, ssm_cfg, rms_norm, rcps,
// fused_add_norm, bidirectional, complement_map, ...) as options; a value we do not compute is
// exit 2.
CaduceusOptions options_from_hf_config(const nlohmann::json& config, const std::string& where);

// config.json's tie_word_embeddings, `fallback` where it has none; not a boolean is exit 2.
bool tie_word_embeddings(const nlohmann::json& config, bool fallback, const std::string& where);

// A Hugging Face Caduceus directory (config.json of model_type "caduceus", model.safetensors).
// A missing or unexpected tensor, a shape that disagrees with config.json: exit 2 naming it.
CaduceusLM load_hf_caduceus(const std::string& dir);

// The hub's config.json for `o` (what export_hf_caduceus writes for a model built in code).
nlohmann::json hf_config_of(const CaduceusOptions& o);

// Writes `model` to `dir` in kuleshov-group's layout, so their hub code loads it: config.json
// (the imported one, or one built from the options; the hub code's auto_map added when it has
// none), model.safetensors (every tensor under the name load_hf_caduceus reads it from, the RCPS
// complement_map buffers, and Note [Caduceus tied projections]) and, when `tokenizer_from` names
// a directory holding one, its tokenizer_config.json and special_tokens_map.json.
// Note [Caduceus tied projections]: BiMamba's mamba_rev uses mamba_fwd's in_proj and out_proj.
// Files written by safetensors' save_model hold such a tensor once (the fixtures do), and the hub
// code under transformers 5 then leaves mamba_rev's copy uninitialised (its logits are NaN), so
// the export writes them under both names; the import reads mamba_fwd's. The RCPS masked LM's
// lm_head.lm_head.weight, tied to the embedding in the hub code (its tie_weights sets it), is
// written as ours holds it (exports stream, so what a file holds cannot depend on values).
void export_hf_caduceus(CaduceusLM& model, const std::string& dir,
                        const std::string& tokenizer_from = "");
// export_hf_caduceus's model.safetensors as an export computes it (Note [Exports unit by unit]
// in family_io.hpp): each tensor of `model` read through `weight` (LiveWeights: LoRA merged; a
// vocabulary map's scatter), the RCPS complement_map buffers from `complement`.
std::vector<ExportedTensor> hf_tensors(CaduceusLM& model, const torch::Tensor& complement,
                                       const WeightReader& weight);
// The config.json export_hf_caduceus writes for `o` (with the hub code's auto_map).
nlohmann::json hf_export_config(const CaduceusOptions& o);
// RCPS's complement table for `o`: complement_map, then the identity up to vocab_size.
torch::Tensor complement_table(const CaduceusOptions& o);

}  // namespace dnallm::models::caduceus
