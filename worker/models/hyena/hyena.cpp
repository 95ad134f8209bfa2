#include "worker/models/hyena/hyena.hpp"

#include <cmath>

#include "core/error.hpp"
#include "worker/models/fp32_region.hpp"
#include "worker/models/hyena/hyena_mixer.hpp"
#include "worker/models/recompute_autocast.hpp"
#include "worker/parallel/context_parallel.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models::hyena {

using torch::Tensor;

// A named, empty module: Hugging Face's dotted names as LibTorch's nested modules.
std::shared_ptr<torch::nn::Module> scope(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

std::pair<Tensor, Tensor> positional_features(const HyenaOptions& o, int64_t length,
                                              const torch::Device& device) {
  DNALLM_CHECK(length <= o.max_seq_len, ExitCode::kUsage,
               "a sequence of {} tokens is longer than the model's max_seq_len ({})", length,
               o.max_seq_len);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  // The reference's own sequence of operations (fp32), so that z is bit-identical to the one
  // its checkpoints were made with: t, w from linspaces over max_seq_len, f over the bands.
  auto t = torch::linspace(0, 1, o.max_seq_len, f32).slice(0, 0, length).unsqueeze(-1);
  auto t_rescaled =
      torch::linspace(0, double(o.max_seq_len - 1), o.max_seq_len, f32).slice(0, 0, length);
  auto w = (t_rescaled * (2 * M_PI) / double(o.max_seq_len)).unsqueeze(-1);  // [L, 1]
  const int64_t bands = (o.emb_dim - 1) / 2;
  auto f = torch::linspace(1e-4, double(bands - 1), bands, f32).unsqueeze(0);  // [1, bands]
  auto fw = (-f) * w;
  auto z = torch::cat({t, torch::cos(fw), torch::sin(fw)}, -1);
  return {z.to(device), t.to(device)};
}

Tensor fft_long_conv(const Tensor& u_in, const Tensor& k_in, const Tensor& bias_in) {
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  const auto type = fp32_or_double(u_in.scalar_type());
  const auto u = u_in.to(type), k = k_in.to(type), bias = bias_in.to(type);
  Tensor y;
  {
    RECORD_FUNCTION("dnallm::hyena::fft_long_conv", std::vector<c10::IValue>({u, k}));
    const int64_t L = u.size(-1);
    const int64_t n = 2 * L;
    auto k_f = torch::fft::rfft(k, n) / double(n);
    auto u_f = torch::fft::rfft(u, n);
    y = torch::fft::irfft(u_f * k_f, n, -1, "forward").slice(-1, 0, L) + u * bias.unsqueeze(-1);
  }
  return y.to(u_in.scalar_type());
}

HyenaFilterImpl::HyenaFilterImpl(const HyenaOptions& o) {
  const int64_t order = o.filter_order;
  auto implicit = scope(*this, "implicit_filter");
  mlp.push_back(implicit->register_module("0", torch::nn::Linear(o.emb_dim, order)));
  for (int64_t i = 0; i < o.num_inner_mlps; ++i) {
    mlp.push_back(
        implicit->register_module(std::to_string(2 * i + 2), torch::nn::Linear(order, order)));
  }
  mlp.push_back(implicit->register_module(
      std::to_string(2 * o.num_inner_mlps + 2),
      torch::nn::Linear(torch::nn::LinearOptions(order, o.d_model).bias(false))));
  freq =
      scope(*implicit, "1")
          ->register_parameter("freq", torch::full({1, order}, o.activation_freq, torch::kFloat32));
  bias = register_parameter("bias", torch::randn({o.d_model}));
  // The reference's window: decays from log(1e-2) / 1.5 to log(1e-2) / 0.3 over the channels.
  const double max_decay = std::log(1e-2) / 0.3, min_decay = std::log(1e-2) / 1.5;
  deltas = scope(*this, "modulation")
               ->register_buffer("deltas",
                                 torch::linspace(min_decay, max_decay, o.d_model, torch::kFloat32)
                                     .view({1, 1, o.d_model}));
}

Tensor HyenaFilterImpl::hidden(const Tensor& z_in, int64_t first) {
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  const auto z = stored_z.defined() ? stored_z.slice(0, first, first + z_in.size(0)) : z_in;
  RECORD_FUNCTION("dnallm::hyena::filter", std::vector<c10::IValue>({z}));
  auto h = z;
  for (size_t i = 0; i + 1 < mlp.size(); ++i) h = torch::sin(freq * mlp[i]->forward(h));
  return h;
}

Tensor HyenaFilterImpl::channels(const Tensor& hidden, const Tensor& t, int64_t first,
                                 int64_t last) {
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  RECORD_FUNCTION("dnallm::hyena::filter", std::vector<c10::IValue>({hidden, t}));
  auto k = torch::nn::functional::linear(hidden, mlp.back()->weight.slice(0, first, last));
  auto decay =
      torch::exp(-t * deltas.view({1, -1}).slice(1, first, last).abs());  // [L, last - first]
  return (k * (decay + 0.05)).transpose(0, 1);
}

Tensor HyenaFilterImpl::filter(const Tensor& z_in, const Tensor& t) {
  Fp32Region fp32;  // Note [fp32 regions under autocast]
  RECORD_FUNCTION("dnallm::hyena::filter", std::vector<c10::IValue>({z_in, t}));
  auto h = mlp.back()->forward(hidden(z_in));                // [L, d]
  auto decay = torch::exp(-t * deltas.view({1, -1}).abs());  // [L, d]
  return h * (decay + 0.05);
}

HyenaOperatorImpl::HyenaOperatorImpl(const HyenaOptions& o) : d_(o.d_model) {
  in_proj = register_module("in_proj", LoraLinear(torch::nn::Linear(d_, 3 * d_)));
  out_proj = register_module("out_proj", LoraLinear(torch::nn::Linear(d_, d_)));
  short_filter = register_module(
      "short_filter",
      torch::nn::Conv1d(torch::nn::Conv1dOptions(3 * d_, 3 * d_, 3).padding(2).groups(3 * d_)));
  filter_fn = register_module("filter_fn", HyenaFilter(o));
}

Tensor HyenaOperatorImpl::forward(const Tensor& x, const Tensor& z, const Tensor& t) {
  if (context && context->group != nullptr) {  // Note [HyenaDNA context parallelism]
    auto& group = *context->group;
    auto u = in_proj->forward(x);  // [B, L / C, 3d]
    // The two positions before the shard, then a conv without padding: the causal conv's
    // outputs at this rank's positions.
    const int64_t no_padding = 0;
    auto uc = torch::conv1d(parallel::causal_halo(u, 2, group).transpose(1, 2),
                            short_filter->weight, short_filter->bias, 1, no_padding, 1, 3 * d_);
    auto parts = uc.split(d_, 1);  // [B, d, L / C] each
    // The filter at this rank's positions, every channel [d, L / C], then by the same
    // all-to-all as the activations this rank's channels at every position [d / C, L].
    const int64_t local = x.size(1), first = group.rank() * local;
    auto k_local = filter_fn->channels(filter_fn->hidden(z.narrow(0, first, local), first),
                                       t.narrow(0, first, local), 0, d_);
    auto k = parallel::sequence_to_channels(k_local.transpose(0, 1).unsqueeze(0), group)
                 .squeeze(0)
                 .transpose(0, 1);
    const auto block = parallel::channel_block(d_, group.world_size(), group.rank());
    auto v = context_parallel_long_conv((parts[2] * parts[1]).transpose(1, 2), k,
                                        filter_fn->bias.slice(0, block.first, block.last),
                                        group);  // [B, L / C, d]
    return out_proj->forward(v * parts[0].transpose(1, 2));
  }
  const int64_t L = x.size(1);
  auto u = in_proj->forward(x);           // [B, L, 3d]
  if (fused_mixer_applies(u) && fused) {  // Note [Hyena fused mixer]
    Fp32Region fp32;                      // Note [fp32 regions under autocast]
    return out_proj->forward(fused_mixer(u, short_filter->weight, short_filter->bias,
                                         filter_fn->filter(z, t), filter_fn->bias));
  }
  // Padding 2 on both sides, the first L outputs kept: each position sees itself and the two
  // before it (causal).
  auto uc = short_filter->forward(u.transpose(1, 2)).slice(-1, 0, L);  // [B, 3d, L]
  auto parts = uc.split(d_, 1);
  auto k = filter_fn->filter(z, t).transpose(0, 1);
  auto v = fft_long_conv(parts[2] * parts[1], k, filter_fn->bias);
  return out_proj->forward((v * parts[0]).transpose(1, 2));
}

HyenaBlockImpl::HyenaBlockImpl(const HyenaOptions& o) {
  mixer = register_module("mixer", HyenaOperator(o));
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  auto mlp = scope(*this, "mlp");
  fc1 = mlp->register_module("fc1", LoraLinear(torch::nn::Linear(o.d_model, o.d_inner)));
  fc2 = mlp->register_module("fc2", LoraLinear(torch::nn::Linear(o.d_inner, o.d_model)));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
}

Tensor HyenaBlockImpl::forward(const Tensor& x, const Tensor& z, const Tensor& t) {
  auto residual = x.to(torch::kFloat32);
  residual = mixer->forward(norm1->forward(residual), z, t) + residual;
  auto h = fc2->forward(torch::gelu(fc1->forward(norm2->forward(residual)), "tanh"));
  return h + residual;
}

// ---------------------------------------------------------------------------------------------
// Note [Hyena chunked block]

namespace {

// Calls f(first, last) for [0, n) in pieces of `step` (0: one piece).
template <typename F>
void for_pieces(int64_t n, int64_t step, F&& f) {
  if (step <= 0) step = n;
  for (int64_t first = 0; first < n; first += step) f(first, std::min(n, first + step));
}

// Channels `rows` of u = short_filter(in_proj(LN1(x))) at positions [skip, n) of `xs` [B, n, d]
// (fp32): [B, rows, n - skip]. `xs` holds the chunk and the (up to) two positions before it,
// which the causal short filter reads: skip 2, or fewer at the start of the sequence.
Tensor short_filtered(HyenaBlockImpl& b, const Tensor& xs, const Tensor& rows, int64_t skip) {
  auto& op = *b.mixer;
  // The adapter, where in_proj has one, folded into the rows (Note [LoRA linear]).
  auto u = torch::nn::functional::linear(b.norm1->forward(xs),
                                         op.in_proj->effective_weight().index_select(0, rows),
                                         op.in_proj->bias.index_select(0, rows))
               .transpose(1, 2);
  auto c = torch::conv1d(u, op.short_filter->weight.index_select(0, rows),
                         op.short_filter->bias.index_select(0, rows), 1, 2, 1, rows.size(0));
  return c.slice(-1, skip, xs.size(1));
}

// w = v * x1 of channels [first, last) over the whole sequence [B, last - first, L], one position
// chunk at a time (no gradients).
Tensor long_conv_input(HyenaBlockImpl& b, const Tensor& x, int64_t first, int64_t last,
                       int64_t positions) {
  torch::NoGradGuard no_grad;
  const int64_t L = x.size(1), d = x.size(2), n = last - first;
  const auto i64 = torch::TensorOptions().dtype(torch::kLong).device(x.device());
  const auto rows = torch::cat(
      {torch::arange(d + first, d + last, i64), torch::arange(2 * d + first, 2 * d + last, i64)});
  auto w = torch::empty({x.size(0), n, L}, x.options());
  for_pieces(L, positions, [&](int64_t s, int64_t e) {
    const int64_t lo = std::max<int64_t>(0, s - 2);
    const auto c = short_filtered(b, x.slice(1, lo, e), rows, s - lo);
    w.slice(2, s, e).copy_(c.slice(1, n, 2 * n) * c.slice(1, 0, n));
  });
  return w;
}

// Steps 1 of Note [Hyena chunked block]: y = long_conv(w, k) [B, d, L], in w's buffer.
Tensor long_conv_output(HyenaBlockImpl& b, const Tensor& x, const Tensor& z, const Tensor& t,
                        const HyenaChunking& chunking) {
  torch::NoGradGuard no_grad;
  const int64_t d = x.size(2);
  auto y = long_conv_input(b, x, 0, d, chunking.positions);
  auto& f = *b.mixer->filter_fn;
  const auto h = f.hidden(z);
  for_pieces(d, chunking.channels, [&](int64_t g0, int64_t g1) {
    auto wg = y.slice(1, g0, g1);
    wg.copy_(fft_long_conv(wg, f.channels(h, t, g0, g1), f.bias.slice(0, g0, g1)));
  });
  return y;
}

// The block after the long convolution for one chunk: x [B, c, d], y and x0 [B, d, c].
Tensor block_tail(HyenaBlockImpl& b, const Tensor& x, const Tensor& y, const Tensor& x0) {
  auto residual = b.mixer->out_proj->forward((y * x0).transpose(1, 2)) + x;
  auto h = b.fc2->forward(torch::gelu(b.fc1->forward(b.norm2->forward(residual)), "tanh"));
  return h + residual;
}

// Note [Hyena chunked block], step 4: the fewest channels whose w one pass recomputes.
inline constexpr int64_t kRecomputeChannels = 32;

// Whether the gradient a chunked checkpoint's backward receives may be overwritten: no other
// tensor, view or node's buffer refers to it. LibTorch's custom-function node passes its list of
// incoming gradients to backward by value and keeps its own copy (CppNode::apply), hence two
// references; a third (the same gradient queued for another node) rules it out.
bool overwritable_gradient(const Tensor& t) {
  return t.defined() && t.use_count() <= 2 && !t.is_view() && t.storage().use_count() == 1 &&
         t.is_contiguous() && t.scalar_type() == torch::kFloat32;
}

}  // namespace

Tensor HyenaBlockImpl::forward_chunked(const Tensor& x_in, const Tensor& z, const Tensor& t,
                                       const HyenaChunking& chunking) {
  torch::NoGradGuard no_grad;
  const auto x = x_in.to(torch::kFloat32);
  const int64_t L = x.size(1), d = x.size(2);
  const auto y = long_conv_output(*this, x, z, t, chunking);
  auto out = torch::empty_like(x);
  const auto x0_rows =
      torch::arange(0, d, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
  for_pieces(L, chunking.positions, [&](int64_t s, int64_t e) {
    const int64_t lo = std::max<int64_t>(0, s - 2);
    const auto x0 = short_filtered(*this, x.slice(1, lo, e), x0_rows, s - lo);
    out.slice(1, s, e).copy_(block_tail(*this, x.slice(1, s, e), y.slice(2, s, e), x0));
  });
  return out;
}

Tensor HyenaBlockImpl::backward_chunked(const Tensor& x_in, const Tensor& z, const Tensor& t,
                                        Tensor grad, const HyenaChunking& chunking) {
  const auto x = x_in.detach().to(torch::kFloat32);
  const int64_t L = x.size(1), d = x.size(2);
  const auto i64 = torch::TensorOptions().dtype(torch::kLong).device(x.device());
  // dx: the output's gradient, turned into the input's chunk by chunk (in place when ours alone).
  Tensor dx = overwritable_gradient(grad) && grad.sizes() == x.sizes()
                  ? std::move(grad)
                  : grad.to(torch::kFloat32).contiguous().clone();
  auto y = long_conv_output(*this, x, z, t, chunking);  // step 1; dy, then dw, in place
  // Step 3.
  const auto x0_rows = torch::arange(0, d, i64);
  for_pieces(L, chunking.positions, [&](int64_t s, int64_t e) {
    const int64_t lo = std::max<int64_t>(0, s - 2);
    auto xc = x.slice(1, lo, e).detach().requires_grad_(true);
    auto yc = y.slice(2, s, e).detach().requires_grad_(true);
    Tensor out;
    {
      torch::AutoGradMode grad_mode(true);
      const auto x0 = short_filtered(*this, xc, x0_rows, s - lo);
      out = block_tail(*this, xc.slice(1, s - lo), yc, x0);
    }
    torch::autograd::backward({out}, {dx.slice(1, s, e)});
    torch::NoGradGuard no_grad;
    const auto gx = xc.grad();
    dx.slice(1, s, e).copy_(gx.slice(1, s - lo));
    if (s > lo) dx.slice(1, lo, s).add_(gx.slice(1, 0, s - lo));
    y.slice(2, s, e).copy_(yc.grad());
  });
  // Step 4.
  auto& f = *mixer->filter_fn;
  Tensor hidden;
  {
    torch::NoGradGuard no_grad;
    hidden = f.hidden(z).detach().requires_grad_(true);
  }
  // w is recomputed for at least kRecomputeChannels channels at a time (each pass runs LN1 and
  // in_proj over every position), its long convolution `channels` at a time.
  const int64_t group = chunking.channels > 0 ? chunking.channels : d;
  for_pieces(d, std::max(group, kRecomputeChannels), [&](int64_t b0, int64_t b1) {
    const auto wb = long_conv_input(*this, x, b0, b1, chunking.positions);
    for_pieces(b1 - b0, group, [&](int64_t o0, int64_t o1) {
      const int64_t g0 = b0 + o0, g1 = b0 + o1;
      auto w = wb.slice(1, o0, o1).detach().requires_grad_(true);
      Tensor yg;
      {
        torch::AutoGradMode grad_mode(true);
        yg = fft_long_conv(w, f.channels(hidden, t, g0, g1), f.bias.slice(0, g0, g1));
      }
      torch::autograd::backward({yg}, {y.slice(1, g0, g1)});
      torch::NoGradGuard no_grad;
      y.slice(1, g0, g1).copy_(w.grad());
    });
  });
  // Step 5.
  const auto rows = torch::arange(d, 3 * d, i64);
  for_pieces(L, chunking.positions, [&](int64_t s, int64_t e) {
    const int64_t lo = std::max<int64_t>(0, s - 2);
    auto xc = x.slice(1, lo, e).detach().requires_grad_(true);
    Tensor w;
    {
      torch::AutoGradMode grad_mode(true);
      const auto c = short_filtered(*this, xc, rows, s - lo);
      w = c.slice(1, d, 2 * d) * c.slice(1, 0, d);
    }
    torch::autograd::backward({w}, {y.slice(2, s, e)});
    torch::NoGradGuard no_grad;
    dx.slice(1, lo, e).add_(xc.grad());
  });
  y = Tensor();
  // Step 6.
  const auto dh = hidden.grad();
  hidden = Tensor();
  for_pieces(L, chunking.positions, [&](int64_t s, int64_t e) {
    Tensor h;
    {
      torch::AutoGradMode grad_mode(true);
      h = f.hidden(z.slice(0, s, e), s);
    }
    if (!h.requires_grad()) return;  // a frozen filter MLP (LoRA): no gradient to accumulate
    torch::autograd::backward({h}, {dh.slice(0, s, e)});
  });
  return dx.to(x_in.scalar_type());
}

HyenaLMImpl::HyenaLMImpl(HyenaOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  auto backbone = scope(*scope(*this, "hyena"), "backbone");
  word_embeddings =
      scope(*backbone, "embeddings")
          ->register_module("word_embeddings", torch::nn::Embedding(o.padded_vocab(), o.d_model));
  auto layers = scope(*backbone, "layers");
  for (int64_t i = 0; i < o.n_layer; ++i) {
    blocks.push_back(layers->register_module(std::to_string(i), HyenaBlock(o)));
    block_built(size_t(i), "hyena.backbone.layers." + std::to_string(i) + ".",
                *blocks.back());  // Note [Streamed build]
  }
  ln_f = backbone->register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model}).eps(o.layer_norm_eps)));
  const int64_t out = o.classifier ? o.num_labels : o.padded_vocab();
  head = register_module(o.classifier ? "score" : "lm_head",
                         torch::nn::Linear(torch::nn::LinearOptions(o.d_model, out).bias(false)));
}

namespace {

// Note [Activation checkpointing] (transformer.hpp) for a Hyena block: the forward runs without
// keeping activations (an autograd Function's forward runs under no_grad) and the backward
// reruns the block under grad mode from its saved input. A Hyena block has no dropout and no
// randomness, so the gradients are bit-identical to those without checkpointing.
struct HyenaCheckpoint : public torch::autograd::Function<HyenaCheckpoint> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor x, Tensor z, Tensor t,
                        int64_t block_address) {
    ctx->save_for_backward({x, z, t});
    ctx->saved_data["block"] = block_address;
    save_autocast_state(ctx);  // Note [Recompute under the forward's autocast]
    return reinterpret_cast<HyenaBlockImpl*>(block_address)->forward(x, z, t);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    auto* block = reinterpret_cast<HyenaBlockImpl*>(ctx->saved_data["block"].toInt());
    auto x = saved[0].detach().requires_grad_(true);
    Tensor out;
    {
      torch::AutoGradMode grad_mode(true);
      RecomputeAutocast autocast(ctx);
      out = block->forward(x, saved[1], saved[2]);
    }
    torch::autograd::backward({out}, {grad_out[0]});
    return {x.grad(), Tensor(), Tensor(), Tensor()};
  }
};

// The same with Note [Hyena chunked block]: the forward and the backward's recompute in pieces.
struct HyenaChunkedCheckpoint : public torch::autograd::Function<HyenaChunkedCheckpoint> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor x, Tensor z, Tensor t,
                        int64_t block_address, int64_t positions, int64_t channels) {
    ctx->save_for_backward({x, z, t});
    ctx->saved_data["block"] = block_address;
    ctx->saved_data["positions"] = positions;
    ctx->saved_data["channels"] = channels;
    return reinterpret_cast<HyenaBlockImpl*>(block_address)
        ->forward_chunked(x, z, t, HyenaChunking{positions, channels});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    auto* block = reinterpret_cast<HyenaBlockImpl*>(ctx->saved_data["block"].toInt());
    const HyenaChunking chunking{ctx->saved_data["positions"].toInt(),
                                 ctx->saved_data["channels"].toInt()};
    auto dx =
        block->backward_chunked(saved[0], saved[1], saved[2], std::move(grad_out[0]), chunking);
    return {dx, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

void HyenaLMImpl::set_context_parallel(std::shared_ptr<ContextParallel> cp) {
  if (cp != nullptr) {
    const int c = cp->group != nullptr ? cp->group->world_size() : 1;
    DNALLM_CHECK(!options_.chunking.enabled(), ExitCode::kUsage,
                 "parallel.context_parallel = {} with model.chunk_positions / "
                 "model.chunk_channels: the chunked Hyena block has no context-parallel form yet "
                 "(a context shard is already 1/{} of the sequence): set both to 0",
                 c, c);
    DNALLM_CHECK(options_.d_model % c == 0, ExitCode::kUsage,
                 "parallel.context_parallel = {} does not divide HyenaDNA's width model.hidden = "
                 "{} (the long convolution runs on channel shards): choose a degree that divides "
                 "it",
                 c, options_.d_model);
  }
  if (cp != nullptr && cp->group == nullptr) cp = nullptr;
  context_ = cp;
  for (auto& block : blocks) block->mixer->context = cp;
}

Tensor HyenaLMImpl::hidden(const Tensor& input_ids) {
  // Under context parallelism the filter covers the whole sequence, not the shard.
  const int64_t length = context_ ? context_->full_length : input_ids.size(1);
  DNALLM_CHECK(!context_ || length == input_ids.size(1) * context_->group->world_size(),
               ExitCode::kFailure,
               "internal: a context shard of {} positions of a {}-position sequence at {} ranks",
               input_ids.size(1), length, context_->group->world_size());
  const auto [z, t] = positional_features(options_, length, input_ids.device());
  auto h = word_embeddings->forward(input_ids);
  const bool checkpoint =
      options_.gradient_checkpointing && is_training() && torch::GradMode::is_enabled();
  const auto& chunking = options_.chunking;
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto& block = blocks[i];
    h = run_block(block_hooks.get(), i, [&] {  // Note [Block hooks]
      if (checkpoint) {
        auto input = h.requires_grad() ? h : h.detach().requires_grad_(true);
        const auto address = reinterpret_cast<int64_t>(block.get());
        return chunking.enabled() ? HyenaChunkedCheckpoint::apply(
                                        input, z, t, address, chunking.positions, chunking.channels)
                                  : HyenaCheckpoint::apply(input, z, t, address);
      }
      if (chunking.enabled() && !torch::GradMode::is_enabled()) {
        return block->forward_chunked(h, z, t, chunking);
      }
      return block->forward(h, z, t);
    });
  }
  return ln_f->forward(h);
}

Tensor HyenaLMImpl::forward(const Tensor& input_ids) {
  if (options_.classifier && context_) {
    // Note [Context-parallel pooling]: the position below found over the whole sequence (the
    // first [PAD] of every rank's positions, none: L), its hidden state from the rank holding
    // it, then the head. The mesh pads at the end, which moves only the wrap of a row that
    // begins with [PAD] (our data path pads on the right) to the padded sequence's last position.
    auto& group = *context_->group;
    const int64_t L = context_->full_length, local = input_ids.size(1);
    const auto positions =
        context_->positions.defined()
            ? context_->positions.to(input_ids.device())
            : torch::arange(group.rank() * local, (group.rank() + 1) * local, input_ids.options());
    const auto first_pad = parallel::context_first_position(input_ids.eq(options_.pad_token_id),
                                                            positions, /*none=*/L, group);
    const auto index = (first_pad - 1 + L).remainder(L);
    return head->forward(parallel::context_token_pool(hidden(input_ids), positions, index, group));
  }
  auto logits = head->forward(hidden(input_ids));
  if (!options_.classifier) return logits.to(torch::kFloat32);
  // The reference pools at (index of the first [PAD]) - 1, wrapping: the last token with left
  // padding or none, the last real token with right padding.
  const int64_t L = input_ids.size(1);
  auto first_pad = input_ids.eq(options_.pad_token_id).to(torch::kLong).argmax(-1);
  auto index = (first_pad - 1 + L).remainder(L);
  auto rows = torch::arange(input_ids.size(0), input_ids.options());
  return logits.index({rows, index});
}

std::vector<std::pair<std::string, Tensor>> HyenaLMImpl::named_weights() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& p : named_parameters()) {
    if (!is_lora_parameter(p.key())) out.emplace_back(p.key(), p.value());
  }
  for (const auto& b : named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

}  // namespace dnallm::models::hyena
