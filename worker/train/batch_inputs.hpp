// From a host batch (worker/data/batch.hpp) to the model's inputs on its device: the tensors, the
// facts known on the host (Note [Host-known batch facts]) and the masked-LM selection. Used by
// the trainer, evaluation and dnallm-eval.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "worker/data/batch.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::train {

// Tensors of a batch on `device`.
models::ForwardInputs to_inputs(const data::Batch& batch, const models::LanguageModel& model,
                                const torch::Device& device);

// The labels a batch scores (rows for a regressor; label tokens otherwise).
int64_t label_count(const data::Batch& b, models::Task task);
// The real (unpadded) tokens of a batch.
int64_t real_tokens(const data::Batch& b);

}  // namespace dnallm::train
