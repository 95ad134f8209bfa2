// What the model-level context-parallel tests compare (context_mesh_test, context_pooling_test,
// attention_ and mamba_context_parallel_test): one forward and backward of a model through the
// trainer's inputs, every parameter's gradient, and the tiny transformer, HyenaDNA and Caduceus
// they build.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

#include "worker/data/batch.hpp"
#include "worker/models/caduceus/caduceus.hpp"
#include "worker/models/hyena/hyena.hpp"
#include "worker/models/language_model.hpp"
#include "worker/models/transformer/transformer.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::parallel::context_test {

struct RunResult {
  torch::Tensor
      logits;  // language models: [B, T, V] (whole) or [B, T / C, V]; classifiers [B, labels]
  double loss_sum = 0;
  int64_t loss_count = 0;
  std::map<std::string, torch::Tensor> grads;  // every parameter's (zeros where it has none)
};

// The gradient of every parameter of `m`, by name (zeros where it has none).
inline std::map<std::string, torch::Tensor> gradients(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out[p.key()] =
        p.value().grad().defined() ? p.value().grad().clone() : torch::zeros_like(p.value());
  }
  return out;
}

// `labels_only`: the logits at the labelled positions only, as the trainer asks
// (ForwardInputs::logits_for_labels_only).
inline RunResult forward_backward(models::LanguageModel& model, const data::Batch& batch,
                                  bool labels_only = false) {
  auto in = train::to_inputs(batch, model, torch::kCPU);
  in.logits_for_labels_only = labels_only;
  auto out = model->forward(in);
  out.loss_sum.backward();
  RunResult r;
  r.logits = out.logits.detach();
  r.loss_sum = out.loss_sum.item<double>();
  r.loss_count = out.loss_count;
  r.grads = gradients(*model);
  return r;
}

// A Caduceus of 2 layers, d_model 8, over our 16-id character vocabulary.
inline models::caduceus::CaduceusOptions tiny_caduceus(bool rcps, bool bidirectional) {
  models::caduceus::CaduceusOptions o;
  o.vocab_size = 16;
  o.d_model = 8;
  o.n_layer = 2;
  o.d_state = 4;
  o.d_conv = 4;
  o.expand = 2;
  o.dt_rank = 2;
  o.rcps = rcps;
  o.bidirectional = bidirectional;
  if (rcps) {  // A<->T, C<->G at our ids 5..8; everything else maps to itself
    o.complement = {0, 1, 2, 3, 4, 8, 7, 6, 5, 9, 10, 11, 12, 13, 14, 15};
  }
  return o;
}

// A HyenaDNA of 2 layers, d_model 8, up to 64 positions.
inline models::hyena::HyenaOptions tiny_hyena() {
  models::hyena::HyenaOptions o;
  o.vocab_size = 12;
  o.d_model = 8;
  o.d_inner = 16;
  o.n_layer = 2;
  o.max_seq_len = 64;
  o.emb_dim = 5;
  o.filter_order = 8;
  o.num_inner_mlps = 1;
  return o;
}

// A transformer of 2 layers, hidden 16, 4 heads, up to 64 positions.
inline models::ModelOptions tiny_transformer(models::Arch arch) {
  models::ModelOptions o;
  o.arch = arch;
  o.vocab_size = 12;
  o.hidden = 16;
  o.layers = 2;
  o.heads = 4;
  o.ffn = 32;
  o.max_seq_length = 64;
  return o;
}

}  // namespace dnallm::parallel::context_test
