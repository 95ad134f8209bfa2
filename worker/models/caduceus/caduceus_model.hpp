// Caduceus behind the model interface (Note [Model interface]): a masked LM (our [CLS] bases
// [SEP] framing and masking) or a sequence classifier (mean over positions), with
// reverse-complement parameter sharing for model.arch = "caduceus-ps" (RCPS: the complement map
// comes from our tokenizer's bases) and without for "caduceus" (Caduceus-Ph: bidirectional
// Mamba; RC averaging is then the caller's, e.g. data.reverse_complement). Published
// checkpoints (model.init_from) are read in our token order (Note [Character vocabularies]) and
// exported back in theirs (final/hf).
#pragma once

#include <string>
#include <vector>

#include "worker/models/caduceus/caduceus.hpp"
#include "worker/models/family_io.hpp"
#include "worker/models/hub_model.hpp"
#include "worker/models/language_model.hpp"
#include "worker/models/registry.hpp"

namespace dnallm::models::caduceus {

class CaduceusModelImpl : public HubModelImpl<CaduceusLM, CaduceusOptions> {
 public:
  // `vocab_size`: our tokenizer's (the embedding may hold padding rows beyond it).
  CaduceusModelImpl(CaduceusLM lm, int64_t vocab_size);

  ModelOutput forward(const ForwardInputs& inputs) override;
  torch::Tensor encode(const ForwardInputs& inputs) override;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() const override;
  void set_activation_checkpointing(bool on) override;
  // Note [Mamba context parallelism]: contiguous shards (spec().context_layout); a classifier
  // (mean over the whole sequence) refuses (exit 2). Collective over cp->group (a split).
  void set_context_parallel(std::shared_ptr<ContextParallel> cp) override;
  // Parameters' 6/4 a token plus the selective scans: about 9 FLOPs a state element of each
  // inner channel, per direction (and strand, with RCPS), forward and twice in backward.
  double flops_per_token(int64_t seq_len) const override;
  std::vector<std::pair<std::string, torch::Tensor>> named_weights() const override;
  nlohmann::ordered_json export_config() const override;
  // Note [Caduceus LoRA targets]: adapters on the Mamba in_proj and out_proj of every layer
  // (lora.target_modules: "in_proj", "out_proj"; Note [Family LoRA targets]). BiMamba's reverse
  // direction uses the forward's projections and RCPS applies them to both strands, so each
  // tied linear is one module with one adapter, which every use applies. x_proj and dt_proj
  // stay frozen: dt_proj is itself rank dt_rank (d_model / 16) and x_proj is (dt_rank +
  // 2 d_state) x d_inner, under a tenth of in_proj; adapters of rank r on them would save
  // little against training them, and PEFT users of Mamba target in_proj / out_proj the same way.
  // Everything else is frozen but the classification head (`score`).
  void enable_lora(int64_t r = 0) override;
  void merge_lora() override;
};
TORCH_MODULE(CaduceusModel);

ModelFamily caduceus_family();

}  // namespace dnallm::models::caduceus
