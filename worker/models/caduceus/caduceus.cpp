#include "worker/models/caduceus/caduceus.hpp"

#include <cmath>

#include "core/error.hpp"
#include "worker/models/caduceus/mamba_context.hpp"
#include "worker/models/fp32_region.hpp"
#include "worker/models/recompute_autocast.hpp"
#include "worker/parallel/context_parallel.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models::caduceus {

using torch::Tensor;

namespace {

// Reverse complement of an RCPS stream half: flip over the sequence and the channels.
Tensor rc(const Tensor& x) { return x.flip({-2, -1}); }

}  // namespace

CaduceusLMImpl::CaduceusLMImpl(CaduceusOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  word_embeddings =
      register_module("word_embeddings", torch::nn::Embedding(o.vocab_size, o.d_model));
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const auto n = std::to_string(i);
    fwd.push_back(register_module("mamba_fwd_" + n, Mamba(o, nullptr)));
    if (o.bidirectional)
      rev.push_back(register_module("mamba_rev_" + n, Mamba(o, fwd.back().get())));
    norm_weight.push_back(register_parameter("norm_weight_" + n, torch::ones({o.d_model})));
    norm_bias.push_back(
        o.rms_norm ? Tensor() : register_parameter("norm_bias_" + n, torch::zeros({o.d_model})));
    // Note [Streamed build]: layer i's unit as CaduceusModelImpl::blocks() lists it (LayerUnit:
    // both directions; the norms are the root's).
    torch::nn::Module unit;
    unit.register_module("mamba_fwd", fwd.back().ptr());
    if (o.bidirectional) unit.register_module("mamba_rev", rev.back().ptr());
    block_built(size_t(i), "", unit);
  }
  norm_f_weight = register_parameter("norm_f_weight", torch::ones({o.d_model}));
  if (!o.rms_norm) norm_f_bias = register_parameter("norm_f_bias", torch::zeros({o.d_model}));
  if (!o.tied_head()) {  // Note [Caduceus tied head]
    head_weight = register_parameter(
        "head_weight",
        torch::randn({o.classifier ? o.num_labels : o.vocab_size, o.d_model}) * 0.02);
  }
  complement = register_buffer("complement", complement_table(o));
}

Tensor complement_table(const CaduceusOptions& o) {
  std::vector<int64_t> map = o.complement;
  for (int64_t i = int64_t(map.size()); i < o.vocab_size; ++i) map.push_back(i);
  return torch::tensor(map, torch::kLong);
}

Tensor CaduceusLMImpl::norm(const Tensor& x, const Tensor& w, const Tensor& b) const {
  if (!options_.rms_norm) {
    return torch::layer_norm(x, {options_.d_model}, w, b, options_.norm_eps);
  }
  auto rstd = torch::rsqrt(x.to(torch::kFloat32).square().mean(-1, true) + options_.norm_eps);
  return (x.to(torch::kFloat32) * rstd * w).to(x.scalar_type());
}

Tensor CaduceusLMImpl::mixer(size_t layer, const Tensor& x) {
  // `flipped`: h holds the sequence in reverse order; under context parallelism its shards are
  // then on the ranks in reverse order (Note [Mamba context parallelism]).
  auto mamba = [&](Mamba& m, const Tensor& h, bool flipped) {
    if (!context) return m->forward(h);
    return mamba_context_parallel(*m, h, flipped ? context->reversed_group() : *context->group,
                                  context->kernel);
  };
  auto bimamba = [&](const Tensor& h, bool flipped) {
    auto out = mamba(fwd[layer], h, flipped);
    if (options_.bidirectional) out = out + mamba(rev[layer], h.flip({1}), !flipped).flip({1});
    return out;
  };
  if (!options_.rcps) return bimamba(x, false);
  const int64_t d = options_.d_model;
  return torch::cat({bimamba(x.slice(-1, 0, d), false), rc(bimamba(rc(x.slice(-1, d)), true))}, -1);
}

namespace {

// Note [Caduceus activation checkpointing]: Note [Activation checkpointing] (transformer.hpp)
// for a Caduceus mixer, the unit blocks() lists and the block hooks surround: the forward runs
// without keeping activations (an autograd Function's forward runs under no_grad), the backward
// reruns the mixer under grad mode from its saved input (the hooks have gathered its parameters
// again by then: Note [Block hooks]) and back-propagates through it, the parameters' gradients
// accumulating as usual. The mixer has no dropout and no randomness, and its recompute is the
// same graph, so the gradients are bit-identical to those without checkpointing. The norms stay
// outside (their parameters are the model's, not the block's).
struct CaduceusCheckpoint : public torch::autograd::Function<CaduceusCheckpoint> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor x, int64_t model_address,
                        int64_t layer) {
    ctx->save_for_backward({x});
    ctx->saved_data["model"] = model_address;
    ctx->saved_data["layer"] = layer;
    save_autocast_state(ctx);  // Note [Recompute under the forward's autocast]
    return reinterpret_cast<CaduceusLMImpl*>(model_address)->mixer(static_cast<size_t>(layer), x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* model = reinterpret_cast<CaduceusLMImpl*>(ctx->saved_data["model"].toInt());
    const auto layer = static_cast<size_t>(ctx->saved_data["layer"].toInt());
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    Tensor out;
    {
      torch::AutoGradMode grad_mode(true);
      RecomputeAutocast autocast(ctx);
      out = model->mixer(layer, x);
    }
    torch::autograd::backward({out}, {grad_out[0]});
    return {x.grad(), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor CaduceusLMImpl::hidden(const Tensor& input_ids) {
  const auto& o = options_;
  const int64_t d = o.d_model;
  Tensor h;
  if (o.rcps) {  // the RC strand's embedding, flipped back over sequence and channels
    const auto rc_ids = complement.index({input_ids.flip({-1})});
    h = torch::cat({word_embeddings->forward(input_ids), rc(word_embeddings->forward(rc_ids))}, -1);
  } else {
    h = word_embeddings->forward(input_ids);
  }
  Tensor residual;
  // Note [Caduceus fused add+norm]: the RCPS block's fused path swaps the halves first.
  const auto swap_halves = [&](const Tensor& x) {
    return torch::cat({x.slice(-1, d), x.slice(-1, 0, d)}, -1);
  };
  auto add_norm = [&](const Tensor& w, const Tensor& b, bool block) {
    if (!o.rcps) {
      residual = residual.defined() ? h + residual : h;
      return norm(residual, w, b);
    }
    if (block && o.fused_add_norm) {
      h = swap_halves(h);
      if (residual.defined()) residual = swap_halves(residual);
    }
    const auto hf = h.slice(-1, 0, d), hr = rc(h.slice(-1, d));
    const auto rf = residual.defined() ? hf + residual.slice(-1, 0, d) : hf;
    const auto rr = residual.defined() ? hr + rc(residual.slice(-1, d)) : hr;
    residual = torch::cat({rf, rc(rr)}, -1);
    return torch::cat({norm(rf, w, b), rc(norm(rr, w, b))}, -1);
  };
  const bool checkpoint = gradient_checkpointing && is_training() && torch::GradMode::is_enabled();
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const auto normed = add_norm(norm_weight[i], norm_bias[i], /*block=*/true);
    h = run_block(block_hooks.get(), static_cast<size_t>(i), [&] {  // Note [Block hooks]
      if (!checkpoint) return mixer(static_cast<size_t>(i), normed);
      // An input that needs no gradient (a frozen base under LoRA) still must reach the
      // Function's backward, where the block's parameters get theirs.
      auto input = normed.requires_grad() ? normed : normed.detach().requires_grad_(true);
      return CaduceusCheckpoint::apply(input, reinterpret_cast<int64_t>(this), i);
    });
  }
  return add_norm(norm_f_weight, norm_f_bias, /*block=*/false);
}

Tensor CaduceusLMImpl::forward(const Tensor& input_ids) {
  const auto& o = options_;
  const int64_t d = o.d_model;
  auto h = hidden(input_ids);
  const Tensor& w = head();  // Note [Caduceus tied head]
  if (!o.classifier) {
    if (!o.rcps) return torch::nn::functional::linear(h, w);
    return torch::nn::functional::linear(h.slice(-1, 0, d), w) +
           torch::nn::functional::linear(h.slice(-1, d).flip({-1}), w.index({complement}));
  }
  if (context) {
    // Note [Context-parallel pooling]: the mean over every position of the whole sequence
    // (the padding the mesh adds included, as the reference includes a batch's padding), both
    // RCPS halves in one sum; the RC half's channels flipped back after the mean.
    const auto pooled = parallel::context_mean_pool(h, torch::Tensor(), *context->group);
    if (!o.rcps) return torch::nn::functional::linear(pooled, w);
    return (torch::nn::functional::linear(pooled.slice(-1, 0, d), w) +
            torch::nn::functional::linear(pooled.slice(-1, d).flip({-1}), w)) /
           2;
  }
  if (!o.rcps) return torch::nn::functional::linear(h.mean(1), w);
  // RCPS: the forward half and the RC half (flipped back) pooled apart, their logits averaged.
  const auto pf = h.slice(-1, 0, d).mean(1), pr = h.slice(-1, d).flip({1, 2}).mean(1);
  return (torch::nn::functional::linear(pf, w) + torch::nn::functional::linear(pr, w)) / 2;
}

}  // namespace dnallm::models::caduceus
