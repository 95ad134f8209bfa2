// HyenaDNA behind the model interface (Note [Model interface]): a causal LM (next-token
// pre-training, our [CLS] bases framing) or a sequence classifier on the last real token, as
// a training run, dnallm-infer and dnallm-eval use any family. Parameter names are the hub's
// (hyena.backbone...), so our model directory and the Hugging Face one share them.
//
#pragma once

#include <string>
#include <vector>

#include "worker/models/family_io.hpp"
#include "worker/models/hub_model.hpp"
#include "worker/models/hyena/hyena.hpp"
#include "worker/models/language_model.hpp"
#include "worker/models/registry.hpp"

namespace dnallm::models::hyena {

class HyenaModelImpl : public HubModelImpl<HyenaLM, HyenaOptions> {
 public:
  explicit HyenaModelImpl(HyenaLM lm);

  ModelOutput forward(const ForwardInputs& inputs) override;
  torch::Tensor encode(const ForwardInputs& inputs) override;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() const override;
  void set_activation_checkpointing(bool on) override;
  // Note [HyenaDNA context parallelism]; spec().shift_labels is false while it is on (the
  // data path shifts labels on the whole sequence, Note [Data x context mesh]).
  void set_context_parallel(std::shared_ptr<ContextParallel> cp) override;
  // Parameters' 6/4 a token plus the long convolutions: three real FFTs of 2L points a channel
  // and layer (about 2.5 x 2L log2(2L) FLOPs each), forward and twice in backward.
  double flops_per_token(int64_t seq_len) const override;
  std::vector<std::pair<std::string, torch::Tensor>> named_weights() const override;
  nlohmann::ordered_json export_config() const override;
  // Note [Hyena LoRA targets]: adapters on each block's Hyena operator in_proj and out_proj
  // and its MLP fc1 and fc2 (lora.target_modules: "in_proj", "out_proj", "fc1", "fc2"; Note
  // [Family LoRA targets]): every dense linear of a block, the names PEFT users give for
  // HyenaDNA. The implicit filter's small MLP, the short filter, the norms and the embedding
  // stay frozen; the classification head (`score`) trains in full. A chunked block (Note [Hyena
  // chunked block]) folds in_proj's adapter into the rows it takes (LoRA dropout then unused).
  void enable_lora(int64_t r = 0) override;
  void merge_lora() override;
};
TORCH_MODULE(HyenaModel);

ModelFamily hyena_family();

}  // namespace dnallm::models::hyena
