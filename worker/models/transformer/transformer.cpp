#include "worker/models/transformer/transformer.hpp"

#include <torch/version.h>

#include <cmath>
#include <limits>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/transformer/context_attention.hpp"
#include "worker/models/transformer/heads.hpp"
#include "worker/models/transformer/layers.hpp"
#include "worker/parallel/context_parallel.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models {
namespace {

using torch::Tensor;

// Note [Embedding backward without a sync]: CUDA's embedding backward (sort + unique of the
// ids) reads the number of unique ids back to the host: a synchronisation in every step.
// index_select's backward is an index_add_ (atomics, no read-back). On CPU the embedding
// op is kept: its results stay bit-identical to earlier releases.
Tensor embed(torch::nn::Embedding& table, const Tensor& ids) {
  if (ids.device().is_cpu()) return table(ids);
  auto sizes = ids.sizes().vec();
  sizes.push_back(table->weight.size(1));
  return table->weight.index_select(0, ids.reshape({-1})).view(sizes);
}

}  // namespace

using detail::holder;
using detail::norm;
using detail::rms_norm;

// ---------------------------------------------------------------------------------------------
// Model

TransformerLMImpl::TransformerLMImpl(ModelOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  auto root = holder(*this, root_name());
  auto emb = holder(*root, "embeddings");
  word_embeddings =
      emb->register_module("word_embeddings", torch::nn::Embedding(o.vocab_size, o.hidden));
  if (!o.rotary && !o.alibi) {
    position_embeddings = emb->register_module("position_embeddings",
                                               torch::nn::Embedding(o.max_seq_length, o.hidden));
  }
  if (o.type_vocab_size > 0) {
    token_type_ = holder(*emb, "token_type_embeddings")
                      ->register_parameter("weight", torch::zeros({o.type_vocab_size, o.hidden}));
  }
  if (o.embedding_layer_norm) {
    embedding_norm = emb->register_module(
        "LayerNorm",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden}).eps(o.layer_norm_eps)));
  }
  auto encoder = holder(*root, "encoder");
  auto layer = holder(*encoder, "layer");
  for (int64_t i = 0; i < o.layers; ++i) {
    blocks_.push_back(layer->register_module(std::to_string(i), Block(o)));
    // Note [Streamed build]
    block_built(size_t(i), root_name() + ".encoder.layer." + std::to_string(i) + ".",
                *blocks_.back());
  }
  if (o.rms_norm) {
    rms_final_ =
        holder(*encoder, "final_layer_norm")->register_parameter("weight", torch::ones({o.hidden}));
  } else if (!o.post_layer_norm) {
    final_norm = encoder->register_module(
        "final_layer_norm",
        torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden}).eps(o.layer_norm_eps)));
  }

  if (o.task == Task::kPretrain) {
    if (o.arch == Arch::kBert) {
      auto cls = holder(*this, "cls");
      auto pred = holder(*cls, "predictions");
      auto transform = holder(*pred, "transform");
      mlm_dense = transform->register_module("dense", LoraLinear(o.hidden, o.hidden));
      mlm_norm = transform->register_module(
          "LayerNorm",
          torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden}).eps(o.layer_norm_eps)));
      lm_bias_ = pred->register_parameter("bias", torch::zeros({o.vocab_size}));
      if (!o.tie_embeddings) {
        auto decoder = holder(*pred, "decoder");
        lm_weight_ = decoder->register_parameter("weight", torch::empty({o.vocab_size, o.hidden}));
      }
    } else if (!o.tie_embeddings) {
      auto head = holder(*this, "lm_head");
      lm_weight_ = head->register_parameter("weight", torch::empty({o.vocab_size, o.hidden}));
    }
  } else {
    pooler = holder(*root, "pooler")->register_module("dense", LoraLinear(o.hidden, o.hidden));
    classifier = register_module("classifier", LoraLinear(o.hidden, o.num_labels));
  }

  torch::NoGradGuard no_grad;
  word_embeddings->weight.normal_(0.0, 0.02);
  if (position_embeddings) position_embeddings->weight.normal_(0.0, 0.02);
  if (lm_weight_.defined()) lm_weight_.normal_(0.0, 0.02);
  update_spec();
  if (o.lora_r > 0) enable_lora();
}

void TransformerLMImpl::update_spec() {
  const auto& o = options_;
  spec_.family = "transformer";
  spec_.arch = o.arch;
  spec_.task = o.task;
  spec_.vocab_size = o.vocab_size;
  spec_.hidden_size = o.hidden;
  spec_.max_seq_length = o.max_seq_length;
  spec_.extends_past_max_length = o.rotary || o.alibi;
  spec_.num_labels = o.num_labels;
  spec_.pad_id = o.pad_id;
  spec_.shift_labels = o.shift_labels && !context_view_;  // the data path shifts under CP
  spec_.context_layout = o.arch == Arch::kGpt ? ContextLayout::kZigZag : ContextLayout::kContiguous;
  spec_.lora_r = o.lora_r;
  spec_.lora_alpha = o.lora_alpha;
  spec_.reserved_positions = reserved_positions(o);
}

// The trainer's context mesh (Note [Data x context mesh]) hands over one ContextParallel and
// updates its length and positions in place per batch; the attention context is built from it
// when the length changes (refresh_context, in encode: a collective over the group, which every
// rank of it reaches with the same length), or at once where positions are already given.
void TransformerLMImpl::set_context_parallel(std::shared_ptr<ContextParallel> cp) {
  context_view_ = cp != nullptr && cp->group != nullptr ? cp : nullptr;
  context_.reset();
  context_length_ = -1;
  if (context_view_) {
    parallel::refuse_context_parallel_regression(options_.task == Task::kRegression,
                                                 context_view_->group->world_size());
  }
  if (context_view_ && !context_view_->positions.defined()) {
    for (auto& block : blocks_) block->context = nullptr;
    update_spec();
    return;
  }
  build_context(context_view_);
}

void TransformerLMImpl::refresh_context() {
  if (context_view_ && context_length_ != context_view_->full_length) build_context(context_view_);
}

void TransformerLMImpl::build_context(const std::shared_ptr<ContextParallel>& cp) {
  const auto& o = options_;
  std::shared_ptr<AttentionContext> context;
  if (cp != nullptr && cp->group != nullptr) {
    context_length_ = cp->full_length;
    auto& group = *cp->group;
    const int world = group.world_size();
    DNALLM_CHECK(o.position_padding_idx < 0, ExitCode::kUsage,
                 "parallel.context_parallel = {}: RoBERTa-numbered positions count the real "
                 "tokens before each one, which a context shard does not see; set "
                 "parallel.context_parallel = 1 for this model",
                 world);
    const auto positions =
        cp->positions.defined() ? cp->positions.to(torch::kCPU, torch::kLong) : torch::Tensor();
    DNALLM_CHECK(
        positions.defined() && positions.dim() == 1 && cp->full_length % world == 0 &&
            positions.numel() == cp->full_length / world && positions.min().item<int64_t>() >= 0 &&
            positions.max().item<int64_t>() < cp->full_length,
        ExitCode::kUsage, "context parallelism: rank {} needs {} / {} positions of [0, {}), got {}",
        group.rank(), cp->full_length, world, cp->full_length,
        positions.defined() ? positions.numel() : 0);
    DNALLM_CHECK(cp->full_length <= spec_.usable_positions() || o.rotary || o.alibi,
                 ExitCode::kBadData, "sequence of {} tokens exceeds the model's {} positions",
                 cp->full_length, spec_.usable_positions());
    context = std::make_shared<AttentionContext>();
    context->group = &group;
    context->query_positions.assign(positions.data_ptr<int64_t>(),
                                    positions.data_ptr<int64_t>() + positions.numel());
    const auto keys = gather_context_rows(positions.view({1, -1}), group).reshape({-1});
    context->key_positions.assign(keys.data_ptr<int64_t>(),
                                  keys.data_ptr<int64_t>() + keys.numel());
    context->causal = o.arch == Arch::kGpt;
    if (o.alibi) context->alibi_slopes = alibi_slopes(o.heads);
    context_positions_ = positions;
  } else {
    context_positions_ = torch::Tensor();
  }
  context_ = context;
  for (auto& block : blocks_) block->context = context;
  update_spec();
}

std::vector<std::shared_ptr<torch::nn::Module>> TransformerLMImpl::blocks() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& block : blocks_) out.push_back(block.ptr());
  return out;
}

void TransformerLMImpl::set_activation_checkpointing(bool on) {
  options_.gradient_checkpointing = on;
}

double TransformerLMImpl::flops_per_token(int64_t seq_len) const {
  return parameter_flops_per_token(*this) +
         12.0 * double(options_.layers) * double(options_.hidden) * double(seq_len);
}

nlohmann::ordered_json TransformerLMImpl::export_config() const {
  return models::export_config(options_);
}

void TransformerLMImpl::enable_lora(int64_t r) {
  if (r > 0) options_.lora_r = r;
  update_spec();
  for (auto& p : parameters()) p.set_requires_grad(false);
  for (auto& block : blocks_) enable_block_lora(*block, options_);
  // Task heads are new for a fine-tune: they train in full (PEFT's modules_to_save).
  if (pooler) {
    for (auto& p : pooler->parameters()) p.set_requires_grad(true);
    for (auto& p : classifier->parameters()) p.set_requires_grad(true);
  }
}

void TransformerLMImpl::merge_lora() {
  for (auto& block : blocks_) {
    for (auto* lin : {&block->query, &block->key, &block->value, &block->attn_out, &block->ffn_in,
                      &block->ffn_out}) {
      (*lin)->merge_lora();
    }
  }
}

Tensor TransformerLMImpl::encode(const ForwardInputs& in, std::vector<LayerCache>* cache,
                                 int64_t past_len) {
  const auto& o = options_;
  refresh_context();
  const auto& ids = in.input_ids;
  DNALLM_CHECK(ids.dim() == 2, ExitCode::kFailure, "input_ids must be [batch, seq]");
  const int64_t b = ids.size(0), t = ids.size(1);
  DNALLM_CHECK(past_len + t <= spec_.usable_positions() || o.rotary || o.alibi, ExitCode::kBadData,
               "sequence of {} tokens exceeds the model's {} positions", past_len + t,
               spec_.usable_positions());
  auto device = ids.device();
  auto x = embed(word_embeddings, ids);
  if (position_embeddings && o.position_padding_idx >= 0) {
    DNALLM_CHECK(past_len == 0, ExitCode::kFailure, "RoBERTa positions are not cached");
    auto real = ids.ne(o.position_padding_idx).to(torch::kInt64);
    x = x + embed(position_embeddings, real.cumsum(1) * real + o.position_padding_idx);
  } else if (position_embeddings) {
    auto pos = context_ ? context_positions_.to(device)
                        : torch::arange(past_len, past_len + t, ids.options());
    x = x + embed(position_embeddings, pos).unsqueeze(0);
  }
  if (token_type_.defined()) x = x + token_type_[0];  // every token is of type 0
  if (o.mask_embeddings && in.attention_mask.defined() && in.attention_mask.size(1) == t) {
    x = x * in.attention_mask.unsqueeze(-1).to(x.dtype());
  }
  if (embedding_norm) x = norm(embedding_norm, x);
  const double p = is_training() ? o.dropout : 0.0;
  if (p > 0) x = torch::dropout(x, p, true);

  if (context_) {
    DNALLM_CHECK(cache == nullptr && past_len == 0 && t == context_positions_.numel(),
                 ExitCode::kUsage,
                 "context parallelism: the model holds {} positions a sequence on this rank, the "
                 "batch {} (and no key/value cache)",
                 context_positions_.numel(), t);
  }
  Tensor cos, sin;
  if (o.rotary) {
    std::tie(cos, sin) = rope_tables(past_len, t, rotary_dims(o), o.rope_theta, device,
                                     context_ ? context_positions_ : Tensor());
  }

  // Note [Attention context parallelism]: the blocks build their masks per key block from the
  // gathered padding mask and segments; none is built here.
  const ForwardInputs no_masks;
  const ForwardInputs& masked = context_ ? no_masks : in;
  if (context_) {
    auto& group = *context_->group;
    context_->key_ok =
        in.attention_mask.defined()
            ? gather_context_rows(in.attention_mask.to(torch::kInt64), group).to(torch::kBool)
            : Tensor();
    context_->query_segments = in.segment_ids;
    context_->key_segments = in.segment_ids.defined()
                                 ? gather_context_rows(in.segment_ids.to(torch::kInt64), group)
                                 : Tensor();
  }
  // Build the additive mask (Note [Attention masks]).
  const bool causal = o.arch == Arch::kGpt;
  const AttentionBias mask = attention_bias(masked, b, t, past_len, causal && !context_,
                                            o.alibi && !context_ ? o.heads : 0, device);
  const Tensor& bias = mask.bias;
  // A single cached decode step (t == 1) attends to everything before it: no mask needed.
  const bool kernel_causal = causal && !bias.defined() && !(past_len > 0 && t == 1);
  // Note [Padding-free feed-forward]: DNABERT-2's reference runs its feed-forward on the real
  // tokens only; so do ALiBi models here, on the CPU (finding the rows reads the mask back,
  // a synchronisation on a GPU). The padding rows' outputs are not part of the function:
  // they are keys masked out of every attention and positions no loss or pooling reads.
  Tensor ffn_rows;
  if (o.alibi && mask.padded_batch && device.is_cpu() && cache == nullptr && past_len == 0 &&
      in.attention_mask.size(1) == t) {
    ffn_rows = in.attention_mask.reshape({-1}).nonzero().squeeze(1);
  }

  for (size_t i = 0; i < blocks_.size(); ++i) {
    LayerCache* layer_cache = cache != nullptr ? &(*cache)[i] : nullptr;
    // Note [Block hooks]: block i's parameters are used inside this call only.
    x = run_block(hooks_.get(), i, [&] {
      if (i + 1 == blocks_.size() && in.scored_positions.defined()) {
        return blocks_[i]->forward_selected(x, bias, cos, sin, in.scored_positions);
      }
      if (o.gradient_checkpointing && is_training() && torch::GradMode::is_enabled() &&
          layer_cache == nullptr) {
        return checkpointed_block(blocks_[i], x, bias, kernel_causal, cos, sin);
      }
      return blocks_[i]->forward(x, bias, kernel_causal, layer_cache, cos, sin, ffn_rows);
    });
  }
  if (rms_final_.defined()) return rms_norm(rms_final_, x, o.layer_norm_eps);
  return final_norm ? norm(final_norm, x) : x;
}

Tensor TransformerLMImpl::lm_logits(const Tensor& hidden) {
  const auto& weight = lm_weight_.defined() ? lm_weight_ : word_embeddings->weight;
  if (options_.arch == Arch::kBert) {
    auto h = norm(mlm_norm, torch::gelu(mlm_dense(hidden)));
    return torch::linear(h, weight, lm_bias_);
  }
  return torch::linear(hidden, weight);
}

ModelOutput TransformerLMImpl::forward(const ForwardInputs& in) {
  const auto& o = options_;
  refresh_context();  // before the scored-positions choice below, which context parallelism skips
  ModelOutput out;
  // See Note [Scored positions only]: a masked LM that only needs the scored positions runs
  // the last block for those queries alone (exact; ~85% of the last block's work is skipped
  // at 15% masking).
  Tensor selected_valid, selected_labels;
  Tensor hidden;
  const bool mlm_selected = o.task == Task::kPretrain && o.arch == Arch::kBert && !context_ &&
                            in.logits_for_labels_only && in.labels.defined() &&
                            !in.segment_ids.defined() && in.labels.dim() == 2;
  if (mlm_selected && in.mlm_positions.defined() && in.mlm_selected.defined()) {
    // The same selection as below, with the positions and picks computed on the host (Note
    // [Host-known batch facts]): index_select of the row-major picks equals the boolean index.
    ForwardInputs sub = in;
    sub.scored_positions = in.mlm_positions;
    auto h = encode(sub);  // [B, M, hidden]
    hidden = h.reshape({-1, o.hidden}).index_select(0, in.mlm_selected);
    selected_labels =
        in.labels.gather(1, in.mlm_positions).reshape({-1}).index_select(0, in.mlm_selected);
    selected_valid = in.mlm_selected;
  } else if (mlm_selected) {
    auto scored = in.labels.ne(-100);
    const int64_t t = in.labels.size(1);
    auto ar = torch::arange(t, in.labels.options());
    // Scored positions first (ascending), then the others: the first count[b] are the picks.
    auto order = torch::where(scored, ar, ar + t).argsort(int64_t{1});
    const int64_t m = std::max<int64_t>(1, scored.sum(1).max().item<int64_t>());
    auto positions = order.narrow(1, 0, m).contiguous();
    selected_valid = ar.narrow(0, 0, m).unsqueeze(0) < scored.sum(1, true);
    selected_labels = in.labels.gather(1, positions);
    ForwardInputs sub = in;
    sub.scored_positions = positions;
    auto h = encode(sub);  // [B, M, hidden]
    hidden = h.index({selected_valid});
    selected_labels = selected_labels.index({selected_valid});
  } else {
    hidden = encode(in);
  }
  if (o.task == Task::kPretrain) {
    Tensor labels = selected_valid.defined() ? selected_labels : in.labels;
    if (labels.defined() && o.arch == Arch::kGpt && spec_.shift_labels) {
      // Position i predicts token i + 1; the last position has no target.
      hidden = hidden.narrow(1, 0, hidden.size(1) - 1);
      labels = labels.narrow(1, 1, labels.size(1) - 1);
    }
    if (labels.defined()) {
      auto flat_labels = labels.reshape({-1});
      auto flat_hidden = hidden.reshape({-1, o.hidden});
      if (!selected_valid.defined() && in.logits_for_labels_only) {
        auto idx =
            in.label_index.defined() ? in.label_index : flat_labels.ne(-100).nonzero().squeeze(1);
        flat_hidden = flat_hidden.index_select(0, idx);
        flat_labels = flat_labels.index_select(0, idx);
      }
      auto logits = lm_logits(flat_hidden);
      add_cross_entropy(logits, flat_labels, in.label_count, out);
      out.logits =
          in.logits_for_labels_only ? logits : logits.view({hidden.size(0), hidden.size(1), -1});
    } else {
      out.logits = lm_logits(hidden);
    }
    return out;
  }
  Tensor pooled = pool_hidden(hidden, in, o.mean_pooling, context_.get(), context_positions_);
  pooled = torch::tanh(pooler(pooled));
  if (is_training() && o.dropout > 0) pooled = torch::dropout(pooled, o.dropout, true);
  add_sequence_head_output(classifier(pooled), in, o.task, out);
  return out;
}

Tensor TransformerLMImpl::generate(const Tensor& prompt, const GenerateOptions& g) {
  DNALLM_CHECK(options_.arch == Arch::kGpt && options_.task == Task::kPretrain, ExitCode::kUsage,
               "generation needs a causal LM (model.arch = \"gpt\", task = \"pretrain\")");
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(g.seed);
  Tensor suppress;
  if (!g.suppress_ids.empty()) {
    for (int64_t id : g.suppress_ids) {
      DNALLM_CHECK(id >= 0 && id < options_.vocab_size, ExitCode::kFailure,
                   "generate: suppressed token id {} is outside the vocabulary ({})", id,
                   options_.vocab_size);
    }
    DNALLM_CHECK(static_cast<int64_t>(g.suppress_ids.size()) < options_.vocab_size,
                 ExitCode::kUsage, "generate: every token of the vocabulary is suppressed");
    suppress = torch::tensor(g.suppress_ids, torch::kInt64);
  }
  auto tokens = prompt;
  std::vector<LayerCache> cache(blocks_.size());
  Tensor next_input = prompt;
  int64_t past = 0;
  for (int64_t step = 0; step < g.max_new_tokens; ++step) {
    Tensor hidden;
    ForwardInputs in;
    if (g.use_cache) {
      in.input_ids = next_input;
      hidden = encode(in, &cache, past);
      past += next_input.size(1);
    } else {
      in.input_ids = tokens;
      hidden = encode(in);
    }
    auto logits = lm_logits(hidden.select(1, hidden.size(1) - 1)).to(torch::kFloat32).cpu();
    if (suppress.defined())
      logits.index_fill_(-1, suppress, -std::numeric_limits<float>::infinity());
    Tensor next = sample_next_token(logits, g, gen).to(tokens.device());
    tokens = torch::cat({tokens, next}, 1);
    next_input = next;
  }
  return tokens;
}

std::vector<std::pair<std::string, Tensor>> TransformerLMImpl::named_weights() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& item : named_parameters()) {
    const auto& name = item.key();
    if (name.size() > 7 &&
        (name.rfind(".lora_A") == name.size() - 7 || name.rfind(".lora_B") == name.size() - 7)) {
      continue;
    }
    out.emplace_back(name, item.value());
  }
  return out;
}

}  // namespace dnallm::models
