#include "worker/models/transformer/heads.hpp"

#include "worker/models/transformer/context_attention.hpp"
#include "worker/parallel/context_parallel.hpp"

namespace dnallm::models {

using torch::Tensor;

Tensor pool_hidden(const Tensor& hidden, const ForwardInputs& in, bool mean_pooling,
                   const AttentionContext* context, const Tensor& context_positions) {
  if (context != nullptr) {
    // Note [Context-parallel pooling]: the masked mean, or [CLS] (global position 0, on context
    // rank 0 in both layouts), summed over the group.
    auto& group = *context->group;
    return mean_pooling ? parallel::context_mean_pool(hidden, in.attention_mask, group)
                        : parallel::context_token_pool(
                              hidden, context_positions,
                              torch::zeros({hidden.size(0)}, in.input_ids.options()), group);
  }
  if (mean_pooling) {
    auto mask = in.attention_mask.defined()
                    ? in.attention_mask.to(hidden.dtype()).unsqueeze(-1)
                    : torch::ones({hidden.size(0), hidden.size(1), 1}, hidden.options());
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0);
  }
  return hidden.select(1, 0);
}

void add_cross_entropy(const Tensor& logits, const Tensor& labels, int64_t label_count,
                       ModelOutput& out) {
  out.loss_sum = torch::nn::functional::cross_entropy(
      logits.to(torch::kFloat32), labels,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  out.loss_count = label_count >= 0 ? label_count : labels.ne(-100).sum().item<int64_t>();
}

void add_sequence_head_output(const Tensor& logits, const ForwardInputs& in, Task task,
                              ModelOutput& out) {
  if (task == Task::kRegression) {
    out.logits = logits.squeeze(-1);
    if (in.targets.defined()) {
      out.loss_sum = (out.logits.to(torch::kFloat32) - in.targets.to(torch::kFloat32)).pow(2).sum();
      out.loss_count = in.targets.numel();
    }
  } else {
    out.logits = logits;
    if (in.labels.defined()) add_cross_entropy(logits, in.labels, in.label_count, out);
  }
}

}  // namespace dnallm::models
