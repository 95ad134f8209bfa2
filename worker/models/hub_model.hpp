// What the families whose model is one module in its hub's layout (HyenaDNA's HyenaLM,
// Caduceus' CaduceusLM) share behind the model interface (Note [Model interface]): the wrapped
// module (its children are the model's, under the hub's names), the spec the family fills in,
// the LoRA options the family sets, and what an import keeps for the export back to the hub's
// layout (Note [Character vocabularies] in family_io.hpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "worker/models/language_model.hpp"
#include "worker/models/lora_linear.hpp"

namespace dnallm::models {

template <class LM, class Options>
class HubModelImpl : public LanguageModelImpl {
 public:
  const ModelSpec& spec() const override { return spec_; }
  void set_block_hooks(std::shared_ptr<BlockHooks> hooks) override {
    lm_->block_hooks = std::move(hooks);
  }

  LM& lm() { return lm_; }

  LoraOptions lora;  // set by the family before enable_lora()

  // Set by an import with a vocabulary map (Note [Character vocabularies] in family_io.hpp):
  // what hf_export needs to write the hub's layout back in its token order.
  std::vector<int64_t> vocab_map;
  Options source_options;
  torch::Tensor source_embedding, source_head;

 protected:
  explicit HubModelImpl(LM lm) : lm_(std::move(lm)) {}

  LM lm_;
  ModelSpec spec_;
};

}  // namespace dnallm::models
