// What the task heads compute on the final hidden states: the sequence summary a classifier or
// regressor reads (Note [Context-parallel pooling]) and the losses. The heads' parameters are
// the model's (TransformerLMImpl: cls.predictions.*, lm_head, <root>.pooler, classifier), under
// Hugging Face names (transformer.hpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "worker/models/language_model.hpp"

namespace dnallm::models {

struct AttentionContext;  // context_attention.hpp

// The summary [B, hidden] of `hidden` [B, T, hidden]: the mean over in.attention_mask's real
// tokens (`mean_pooling`) or the first ([CLS]) token. Under context parallelism (`context` not
// null; `context_positions`: this rank's global positions) the same over the whole sequence,
// summed over the context group (a collective).
torch::Tensor pool_hidden(const torch::Tensor& hidden, const ForwardInputs& in, bool mean_pooling,
                          const AttentionContext* context, const torch::Tensor& context_positions);

// Cross-entropy of `logits` [N, C] against `labels` [N] (-100: not scored), summed in fp32, into
// out.loss_sum, and the count of scored labels into out.loss_count (`label_count` when the host
// knows it: >= 0).
void add_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels,
                       int64_t label_count, ModelOutput& out);

// A classifier's or regressor's output from its logits [B, num_labels]: a regressor's squeezed
// to [B] with the summed squared error against in.targets, a classifier's with the
// cross-entropy against in.labels (when given).
void add_sequence_head_output(const torch::Tensor& logits, const ForwardInputs& in, Task task,
                              ModelOutput& out);

}  // namespace dnallm::models
