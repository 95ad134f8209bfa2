// HyenaDNA (LongSafari/hyenadna-*-seqlen-hf, HazyResearch/hyena-dna): a decoder of Hyena
// blocks, the long-context DNA family. Note [Hyena]:
//   block      r = x + mixer(LN1(x)); y = r + fc2(gelu_tanh(fc1(LN2(r))))   (fp32 residual)
//   mixer      u = in_proj(x) [B, 3d, L]; u = short_filter(u)[..., :L] (depthwise, kernel 3,
//              padding 2: causal); x0, x1, v = split(u); v = long_conv(v * x1, k) ; out_proj(v *
//              x0)
//   long_conv  y = irfft(rfft(u, 2L) * rfft(k, 2L) / 2L, 2L, norm "forward")[..., :L] + u * D,
//              in fp32: memory O(B d L), no L x L anything
//   filter k   z = [t, cos(-f w), sin(-f w)] (t = i / (max_seq_len - 1), w = 2 pi i /
//              max_seq_len, f = linspace(1e-4, bands - 1, bands), bands = (emb_dim - 1) / 2)
//              through Linear(emb_dim, order), Sin, [Linear(order, order), Sin] x inner,
//              Linear(order, d, no bias), one Sin frequency shared by every Sin of a layer; then
//              the window k * (exp(-t |deltas|) + 0.05).
// The positional features z and t are regenerated from the config, not read: in a published
// checkpoint they are most of the bytes (192 of 218 MB for large-1m). z is a parameter of the
// reference (learning rate 1e-5), so an import compares the stored z with the regenerated one
// and keeps the stored tensor of a layer only where they differ (Note [Hyena positional
// features]).
// Heads: causal LM (lm_head, untied, vocabulary padded to pad_vocab_size_multiple) and
// sequence classification (score, no bias) on the token before the first [PAD] (the last token
// with left padding or none), as the reference pools.
// Parameter names are the Hugging Face ones (hyena.backbone...), so export is the identity.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "worker/models/block_hooks.hpp"
#include "worker/models/context_shard.hpp"
#include "worker/models/family_io.hpp"
#include "worker/models/lora_linear.hpp"

namespace dnallm::models::hyena {

// Note [Hyena chunked block]: how a checkpointed block works through a long sequence. A block's
// activations are O(L) per channel (in_proj's 3d, the MLP's d_inner, the FFT's 2L complex
// buffers), about 13 KB a token for the hyenadna-large shape on top of the checkpoints, so at
// 1M tokens the recompute of one block would not fit beside the model. Chunked, the block keeps
// only [B, d, L] fp32 buffers: the forward holds the long convolution's input (in place its
// output) and the block's output; the backward holds the incoming gradient (turned into the
// input's gradient in place when nothing else sees it) and the convolution's output (in place its
// gradient). Everything else exists for one piece at a time:
//   1. w = x1 * v over position chunks (LN1, in_proj's x1 and v rows, the causal short filter
//      from two positions back), then y = long_conv(w, k) over channel groups in place; the
//      filter k of a group from the filter MLP's last hidden layer [L, order] and the window.
//   2. forward: over position chunks, r = out_proj(y * x0) + x, out = r + MLP(LN2(r)), x0
//      recomputed from x (in_proj's x0 rows).
//   backward (each step an autograd graph of one piece, its parameter gradients accumulating):
//   3. over position chunks: 2 from saved y and x, backward from the output's gradient: dy (in
//      place of y), dx (in place of the output's gradient, two halo positions added to the chunk
//      before).
//   4. over channel groups: w of the group recomputed (1, those channels only), the long
//      convolution's backward: dw in place of dy, the filter's and D's gradients.
//   5. over position chunks: 1 from x, backward from dw into dx.
//   6. over position chunks: the filter MLP's backward from the gradient of its last hidden
//      layer.
// Equal to the plain block up to float rounding (summation order of the chunks; tested at 1e-5).
struct HyenaChunking {
  int64_t positions = 0;  // position-wise parts this many positions at a time (0: all)
  int64_t channels = 0;   // the FFT long convolution this many channels at a time (0: all)
  bool enabled() const { return positions > 0 || channels > 0; }
};

// The published checkpoints' vocabulary (config.json's vocab_size, before padding):
// CharacterTokenizer's seven special tokens and A C G T N (Note [Character vocabularies]).
inline constexpr int64_t kHubVocabSize = 12;

struct HyenaOptions {
  int64_t vocab_size = kHubVocabSize;  // before padding (config.json vocab_size)
  int64_t pad_vocab_size_multiple = 8;
  int64_t d_model = 256;
  int64_t d_inner = 1024;
  int64_t n_layer = 8;
  int64_t max_seq_len = 1024;
  int64_t emb_dim = 5;
  int64_t filter_order = 64;
  int64_t num_inner_mlps = 2;
  double activation_freq = 10.0;
  double layer_norm_eps = 1e-5;  // ln_f; the blocks' norms use 1e-5 as the reference does
  int64_t pad_token_id = 4;
  // The config.json it was imported from (export writes it back, auto_map and all); null for a
  // model built in code.
  nlohmann::json hf_config;
  bool classifier = false;  // HyenaDNAForSequenceClassification
  int64_t num_labels = 2;
  bool gradient_checkpointing = false;
  // Note [Hyena chunked block]: with gradient_checkpointing (and in a forward without
  // gradients), each block in pieces; off by default (the plain block, bit-identical gradients).
  HyenaChunking chunking;

  int64_t padded_vocab() const {
    const int64_t m = pad_vocab_size_multiple;
    return (vocab_size + m - 1) / m * m;
  }
};

// Reads and validates a Hugging Face config.json of model_type "hyenadna" (`where` names it in
// errors): every size positive and bounded, hyena_order 2 and short_filter_order 3 (the only
// ones the published models use; others exit 2 naming the key).
HyenaOptions options_from_hf_config(const nlohmann::json& config, const std::string& where);

// The positional features of the first `length` positions: z [length, emb_dim], t [length, 1].
std::pair<torch::Tensor, torch::Tensor> positional_features(const HyenaOptions& o, int64_t length,
                                                            const torch::Device& device);

// u [B, D, L] convolved with k [D, L] by FFT of size 2L in fp32, plus u * bias[D].
torch::Tensor fft_long_conv(const torch::Tensor& u, const torch::Tensor& k,
                            const torch::Tensor& bias);

// The Hyena long convolution of a sequence shard, context-parallel (hyena_context.cpp; Note
// [Hyena context parallelism] in worker/parallel/context_parallel.hpp): u [B, L / C, D] -> [B, L /
// C, D], equal to fft_long_conv(u_whole.transpose(1, 2), k, bias).transpose(1, 2) restricted to
// this rank's positions. k is the filter [D, L] and bias its D term [D], both whole (only rows
// channel_block(D, C, rank) are read, so only they get gradients: summed over the group they are
// the whole gradient), or already this rank's rows ([D / C, L] and [D / C]: compute only those,
// e.g. with HyenaFilterImpl::channels).
torch::Tensor context_parallel_long_conv(const torch::Tensor& u, const torch::Tensor& k,
                                         const torch::Tensor& bias, comm::Communicator& group);

class HyenaFilterImpl : public torch::nn::Module {
 public:
  explicit HyenaFilterImpl(const HyenaOptions& o);
  // The filter [L, d_model] (position-major) for positional features z [L, emb_dim], t [L, 1].
  torch::Tensor filter(const torch::Tensor& z, const torch::Tensor& t);
  // The same in two steps (Note [Hyena chunked block]): the MLP up to its last Linear [L, order],
  // then channels [first, last) of the filter [last - first, L] from it.
  torch::Tensor hidden(const torch::Tensor& z, int64_t first = 0);  // z of positions first...
  torch::Tensor channels(const torch::Tensor& hidden, const torch::Tensor& t, int64_t first,
                         int64_t last);

  std::vector<torch::nn::Linear> mlp;  // emb_dim -> order, order -> order x inner, order -> d
  torch::Tensor freq, bias, deltas;
  torch::Tensor stored_z;  // Note [Hyena positional features]: defined when it differs
};
TORCH_MODULE(HyenaFilter);

// Note [HyenaDNA context parallelism]: with `context` set, x is this rank's contiguous
// positions [B, L / C, d] of sequences of context->full_length L (z and t of all L positions),
// and the operator runs Note [Hyena context parallelism] (worker/parallel/context_parallel.hpp):
// in_proj and everything after the long convolution position-wise on the shard, the short
// filter after causal_halo (the previous rank's last two positions), the long convolution by
// context_parallel_long_conv on channel shards. The implicit filter is sharded the same way:
// each rank runs the filter MLP and window on its own positions ([L / C, d]: the MLP's hidden
// layer of every position on every rank would cost L x filter_order floats a rank whatever C
// is), and the all-to-all that shards the activations gives it its channels' rows [d / C, L].
// Every tensor a rank holds is then 1/C of the sequence's; in backward the all-to-all returns
// each filter row's gradient to the positions that made it.
class HyenaOperatorImpl : public torch::nn::Module {
 public:
  explicit HyenaOperatorImpl(const HyenaOptions& o);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& z, const torch::Tensor& t);

  LoraLinear in_proj{nullptr}, out_proj{nullptr};  // LoRA targets (Note [Hyena LoRA targets])
  torch::nn::Conv1d short_filter{nullptr};  // depthwise: Conv1d(3d, 3d, 3, padding 2, groups 3d)
  HyenaFilter filter_fn{nullptr};
  // Note [Hyena fused mixer] on the CPU (false: the plain form everywhere, as on other devices;
  // tests compare the two).
  bool fused = true;
  std::shared_ptr<ContextParallel> context;  // Note [HyenaDNA context parallelism] (null: off)

 private:
  int64_t d_;
};
TORCH_MODULE(HyenaOperator);

class HyenaBlockImpl : public torch::nn::Module {
 public:
  explicit HyenaBlockImpl(const HyenaOptions& o);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& z, const torch::Tensor& t);
  // Note [Hyena chunked block]: the forward in pieces (gradients not recorded), and the backward
  // of forward(x, z, t) given the output's gradient `grad` [B, L, d]: returns the gradient of x
  // and accumulates the parameters' gradients. `grad` may be overwritten when nothing else holds
  // it.
  torch::Tensor forward_chunked(const torch::Tensor& x, const torch::Tensor& z,
                                const torch::Tensor& t, const HyenaChunking& chunking);
  torch::Tensor backward_chunked(const torch::Tensor& x, const torch::Tensor& z,
                                 const torch::Tensor& t, torch::Tensor grad,
                                 const HyenaChunking& chunking);

  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  HyenaOperator mixer{nullptr};
  LoraLinear fc1{nullptr}, fc2{nullptr};  // LoRA targets (Note [Hyena LoRA targets])
};
TORCH_MODULE(HyenaBlock);

class HyenaLMImpl : public torch::nn::Module {
 public:
  explicit HyenaLMImpl(HyenaOptions options);
  // Final hidden states [B, L, d] (after ln_f).
  torch::Tensor hidden(const torch::Tensor& input_ids);
  // Causal LM: logits [B, L, padded vocab]; classifier: [B, num_labels].
  torch::Tensor forward(const torch::Tensor& input_ids);
  // Every tensor of the Hugging Face layout by name (z and t excluded: regenerated; LoRA
  // adapters excluded).
  std::vector<std::pair<std::string, torch::Tensor>> named_weights() const;
  const HyenaOptions& options() const { return options_; }
  void set_gradient_checkpointing(bool on) { options_.gradient_checkpointing = on; }
  // Note [HyenaDNA context parallelism]: every block's operator runs context-parallel from now
  // on (null: off), and the classifier pools over the group (Note [Context-parallel pooling]).
  // Error(kUsage) for what has no context-parallel form yet (the chunked block) and for a
  // d_model the group does not divide.
  void set_context_parallel(std::shared_ptr<ContextParallel> cp);
  const std::shared_ptr<ContextParallel>& context_parallel() const { return context_; }

  torch::nn::Embedding word_embeddings{nullptr};
  std::vector<HyenaBlock> blocks;
  std::shared_ptr<BlockHooks> block_hooks;  // Note [Block hooks] (null: none)
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};  // lm_head or score

 private:
  HyenaOptions options_;
  std::shared_ptr<ContextParallel> context_;
};
TORCH_MODULE(HyenaLM);

// A Hugging Face HyenaDNA directory (config.json, model.safetensors) as downloaded. A missing
// or unexpected tensor, a shape that disagrees with config.json: exit 2 naming it.
HyenaLM load_hf_hyena(const std::string& dir);

// The hub's config.json for `o` (what export_hf_hyena writes for a model built in code).
nlohmann::json hf_config_of(const HyenaOptions& o);

// Writes `model` to `dir` in the layout it was imported from, so LongSafari's hub code loads it:
// config.json (the imported one, or one built from the options), model.safetensors (every
// weight under its hub name; each layer's pos_emb.z (the stored one where it was kept, else
// regenerated) and pos_emb.t, since the hub code reads them; the shared Sin frequency once, as
// the published files hold it) and, when `tokenizer_from` names a directory holding one, its
// tokenizer_config.json and special_tokens_map.json.
void export_hf_hyena(HyenaLM& model, const std::string& dir,
                     const std::string& tokenizer_from = "");
// export_hf_hyena's model.safetensors as an export computes it (Note [Exports unit by unit] in
// family_io.hpp): each tensor of `model` read through `weight` (LiveWeights: LoRA merged; a
// vocabulary map's scatter), the positional features from `model`'s options.
std::vector<ExportedTensor> hf_tensors(HyenaLM& model, const WeightReader& weight);

}  // namespace dnallm::models::hyena
