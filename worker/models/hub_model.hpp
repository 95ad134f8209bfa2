// What the families whose model is one module in its hub's layout (HyenaDNA's HyenaLM,
// Caduceus' CaduceusLM) share behind the model interface (Note [Model interface]): the wrapped
// module (its children are the model's, under the hub's names), the spec the family fills in,
// the LoRA options the family sets, and what an import keeps for the export back to the hub's
// layout (Note [Character vocabularies] in family_io.hpp).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "worker/models/hf_directory.hpp"
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

  // The start of a family's enable_lora(r) (Note [Family LoRA targets]): `r` > 0 replaces
  // lora.r, an empty lora.targets becomes the family's `all`, and every parameter is frozen.
  // Returns whether lora.targets names a module; the family then puts the adapters on.
  std::function<bool(const char*)> start_lora(int64_t r, const std::vector<std::string>& all,
                                              const char* family) {
    if (r > 0) lora.r = r;
    DNALLM_CHECK(lora.r > 0, ExitCode::kFailure, "internal: {} enable_lora without a rank", family);
    if (lora.targets.empty()) lora.targets = all;
    for (auto& p : this->parameters()) p.set_requires_grad(false);
    return [this](const char* name) {
      return std::find(lora.targets.begin(), lora.targets.end(), name) != lora.targets.end();
    };
  }
  // The end: the adapters' rank and alpha in the spec.
  void finish_lora() {
    spec_.lora_r = lora.r;
    spec_.lora_alpha = lora.alpha;
  }

  LM lm_;
  ModelSpec spec_;
};

// `model` as the family's wrapper `Impl`; an internal error (exit 1) if it is another family's.
template <class Impl>
Impl& hub_model_of(LanguageModel& model, const char* family) {
  auto* m = dynamic_cast<Impl*>(model.get());
  DNALLM_CHECK(m != nullptr, ExitCode::kFailure, "internal: not a {} model", family);
  return *m;
}

// The task head that our own export of such a family (config.json `c`, at `where`) says it has:
// sets `o.classifier` and `o.num_labels`; exit 2 for a regression head, which neither family
// has. `family` names it in messages.
template <class Options>
void read_exported_task(const nlohmann::json& c, const std::string& where, const char* family,
                        Options& o) {
  const Task task = task_from_name(family_string(c, "task", "pretrain", where), where);
  DNALLM_CHECK(task != Task::kRegression, ExitCode::kUsage, "{}: a {} model has no regression head",
               where, family);
  o.classifier = task == Task::kClassification;
  if (o.classifier) {
    o.num_labels = family_int(c, "num_labels", 2, 1, int64_t{1} << 16, where, family);
  }
}

}  // namespace dnallm::models
