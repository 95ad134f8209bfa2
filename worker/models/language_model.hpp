// Note [Model interface]: what the trainer, evaluation, inference, MFU and export know of a
// model. Every family (the transformer with its BERT/ESM/RoBERTa/GPT-NeoX/Llama/DNABERT-2
// variants, HyenaDNA, Caduceus) implements LanguageModelImpl; everything outside
// worker/models/<family>/ holds a LanguageModel and asks the registry
// (worker/models/registry.hpp) to build, import, load and export one. As torchtitan's
// TrainSpec, the family owns its backbone, its heads and the loss of each objective; the
// caller only frames batches (ForwardInputs) and reads the summed loss back (ModelOutput).
//
// A family must keep its parameter names stable (checkpoints and exports use them) and
// independent of activation checkpointing; blocks() lists the repeated units in execution
// order, for activation checkpointing and, later, per-block sharding.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "worker/models/block_hooks.hpp"
#include "worker/models/context_shard.hpp"

namespace dnallm::models {

// How a model reads a sequence, which also fixes the batch framing the data pipeline uses:
// kBert: bidirectional, [CLS] tokens [SEP], masked-LM pre-training; kGpt: causal, [CLS] tokens,
// next-token pre-training.
enum class Arch { kBert, kGpt };
enum class Task { kPretrain, kClassification, kRegression };

struct ForwardInputs {
  torch::Tensor input_ids;       // [B, T] int64
  torch::Tensor attention_mask;  // [B, T] 1 real, 0 pad; may be undefined
  torch::Tensor segment_ids;     // [B, T] packed documents (1, 2, ..; 0 pad); may be undefined
  torch::Tensor labels;          // LM: [B, T] with -100 ignored; classification: [B]; optional
  torch::Tensor targets;         // regression: [B] float; optional
  // LM with labels: compute the output head only at scored positions (logits [N, vocab]).
  bool logits_for_labels_only = false;
  // Internal (set by forward()): run the last block for these positions [B, M] only.
  torch::Tensor scored_positions;
  // Note [Host-known batch facts]: what the host knows when it builds a batch, so that
  // forward() reads nothing back from the device (no host synchronisation inside a step).
  // All optional: unset, forward() computes them on the device and reads them back.
  std::optional<bool> padded;  // any attention_mask == 0 (false: SDPA gets no mask at all)
  int64_t label_count = -1;    // labels != -100 (after the causal shift); -1: unknown
  // Flat indices of the scored labels in the layout forward() flattens them to: [B*T], or
  // [B*(T-1)] for a shifted causal LM. Replaces a nonzero() on the device. int64 [N].
  torch::Tensor label_index;
  // Masked LM with logits_for_labels_only (Note [Scored positions only]): per row the
  // scored positions ascending, then the others ascending, the first M of them [B, M] (M >= the
  // largest scored count of a row); and the flat indices into [B*M] of the scored ones [N].
  torch::Tensor mlm_positions;
  torch::Tensor mlm_selected;
};

struct ModelOutput {
  torch::Tensor logits;    // LM [B, T, vocab]; classification [B, num_labels]; regression [B]
  torch::Tensor loss_sum;  // SUM of per-token (per-row) losses, fp32 scalar; undefined w/o labels
  int64_t loss_count = 0;  // tokens (rows) that contributed to loss_sum
};

struct GenerateOptions {
  int64_t max_new_tokens = 16;
  double temperature = 1.0;  // <= 0: greedy
  int64_t top_k = 0;         // 0: whole vocabulary
  bool greedy = true;
  uint64_t seed = 0;
  bool use_cache = true;  // false: recompute the whole prefix each token (tests)
  // Token ids never generated (their logits are -inf), e.g. the special tokens, which decode
  // to no base.
  std::vector<int64_t> suppress_ids;
};

// The facts every model states about itself; the rest of its configuration is its family's.
struct ModelSpec {
  std::string family;  // registry key: "transformer", "hyena", "caduceus"
  Arch arch = Arch::kBert;
  Task task = Task::kPretrain;
  int64_t vocab_size = 0;      // rows of the input embedding (our tokenizer's ids)
  int64_t hidden_size = 0;     // width of encode()'s hidden states
  int64_t max_seq_length = 0;  // longest input in tokens, framing included
  // true: inputs longer than max_seq_length compute (rotary, ALiBi, long convolutions);
  // max_seq_length is then the training length, not a limit.
  bool extends_past_max_length = false;
  int64_t num_labels = 2;
  int64_t pad_id = 0;
  // Causal LM: labels are the input ids, shifted inside the model (HF convention) when true.
  bool shift_labels = true;
  int64_t lora_r = 0;  // > 0: LoRA adapters train, the base is frozen
  double lora_alpha = 0;
  // Positions a family reserves at the start of its position table (RoBERTa's padding_idx + 1),
  // which shorten the longest input: see usable_positions().
  int64_t reserved_positions = 0;
  // Under context parallelism (set_context_parallel): the positions each rank holds.
  ContextLayout context_layout = ContextLayout::kContiguous;
  // The family reads its parameters in fp32 even under bf16 autocast (HyenaDNA's fused mixer
  // and fp32 regions): ZeRO-3 gathers its units in fp32 (Note [Fully sharded mixed precision]).
  bool fp32_parameters = false;
  // false: padding changes what the real positions compute (Caduceus' bidirectional scan has
  // no attention mask), so inference batches only rows of one length.
  bool masks_padding = true;

  // Reads a sequence left to right (Arch::kGpt): next-token pre-training, framed [CLS] tokens,
  // scored by its likelihood; else bidirectional (Arch::kBert): masked LM, [CLS] tokens [SEP].
  bool causal() const { return arch == Arch::kGpt; }
  // A causal LM whose labels are its input ids, shifted inside the model (shift_labels).
  bool shifts_labels() const { return causal() && shift_labels; }
  // The longest input in tokens, framing included, that the position table holds:
  // max_seq_length less the reserved positions (RoBERTa numbers the real tokens from
  // padding_idx + 1, so max_position_embeddings 66 with pad id 0 holds 65 tokens). Every cut
  // of an input to the model's positions (embed, predict, generate, variants, mutagenesis,
  // dnallm-eval) asks this, never max_seq_length (issue 57: embed cut to 66 and crashed).
  int64_t usable_positions() const { return max_seq_length - reserved_positions; }
};

class LanguageModelImpl : public torch::nn::Module {
 public:
  ~LanguageModelImpl() override = default;

  virtual const ModelSpec& spec() const = 0;

  // Logits, and the summed loss where `inputs` has labels (targets for regression).
  virtual ModelOutput forward(const ForwardInputs& inputs) = 0;
  // Final hidden states [B, T, hidden] (after the final norm), for embeddings.
  virtual torch::Tensor encode(const ForwardInputs& inputs) = 0;

  // The repeated units (transformer layers, Hyena or Mamba blocks) in execution order.
  virtual std::vector<std::shared_ptr<torch::nn::Module>> blocks() const = 0;
  // Per-block activation checkpointing on or off (parameter names never change).
  virtual void set_activation_checkpointing(bool on) = 0;
  // Note [Block hooks]: called around every block of every forward from now on (null: none).
  virtual void set_block_hooks(std::shared_ptr<BlockHooks> hooks) = 0;
  // Note [Context parallelism in a model]: from now on forward() sees this rank's positions
  // of every sequence (a context shard) and runs its sequence mixers context-parallel over
  // `group` (null: off). Families that cannot refuse (exit 2).
  virtual void set_context_parallel(std::shared_ptr<ContextParallel> cp);

  // Training FLOPs a token (forward + backward) at `seq_len`, for MFU: 6 a trainable
  // parameter, 4 a frozen one (no weight gradient), plus the sequence mixer's own work.
  virtual double flops_per_token(int64_t seq_len) const = 0;

  // Every parameter and buffer an export holds, by its exported name (LoRA not merged).
  virtual std::vector<std::pair<std::string, torch::Tensor>> named_weights() const = 0;
  // config.json of our model directory (final/, checkpoints' exports): "model_type" names the
  // family for the registry's loader.
  virtual nlohmann::ordered_json export_config() const = 0;

  // LoRA: adapters on the family's target linears, everything else frozen but task heads.
  // `r` > 0 overrides the configured rank. Families without LoRA refuse (exit 2).
  virtual void enable_lora(int64_t r = 0);
  // Folds adapters into the base weights (export path); a no-op without adapters.
  virtual void merge_lora() {}

  // Causal LM generation; `prompt` [B, P] (one length), returns [B, P + new]. By default a
  // causal language model recomputes the whole prefix for each new token (no KV cache: HyenaDNA);
  // other models refuse (exit 2).
  virtual bool can_generate() const {
    return spec().arch == Arch::kGpt && spec().task == Task::kPretrain;
  }
  virtual torch::Tensor generate(const torch::Tensor& prompt, const GenerateOptions& options);
};

// A holder of any family's model (TORCH_MODULE's, plus: a family's own holder, e.g.
// TransformerLM, converts to it implicitly; both share the one module).
class LanguageModel : public torch::nn::ModuleHolder<LanguageModelImpl> {
 public:
  using Impl = LanguageModelImpl;
  LanguageModel(std::nullptr_t) : torch::nn::ModuleHolder<LanguageModelImpl>(nullptr) {}  // NOLINT
  LanguageModel(std::shared_ptr<LanguageModelImpl> module)                                // NOLINT
      : torch::nn::ModuleHolder<LanguageModelImpl>(std::move(module)) {}
  template <typename Derived,
            typename = std::enable_if_t<std::is_base_of_v<LanguageModelImpl, Derived>>>
  LanguageModel(const torch::nn::ModuleHolder<Derived>& model)  // NOLINT: implicit by design
      : torch::nn::ModuleHolder<LanguageModelImpl>(
            std::static_pointer_cast<LanguageModelImpl>(model.ptr())) {}
};

template <typename Holder>
LanguageModel as_language_model(const Holder& model) {
  return LanguageModel(model);
}

const char* task_name(Task task);
// "pretrain", "classification", "regression"; anything else exit 2 naming `where`.
Task task_from_name(const std::string& name, const std::string& where);
const char* arch_name(Arch arch);

// The objective's summed loss for a family whose head gives full logits (LM [B, T, V],
// classification [B, C], regression [B] or [B, 1]), as the transformer computes it: a causal LM
// shifted when spec.shift_labels, labels -100 ignored, logits_for_labels_only honoured (the
// returned logits are then the scored rows [N, V]), the count from in.label_count when known.
ModelOutput loss_from_logits(const torch::Tensor& logits, const ForwardInputs& in,
                             const ModelSpec& spec);

// One decoding step of `g`: the next token of each row [B, 1] from the last position's logits
// [B, V] (fp32, CPU; suppressed ids already -inf): greedy, or sampled at g.temperature among the
// g.top_k most likely with `gen`.
torch::Tensor sample_next_token(torch::Tensor logits, const GenerateOptions& g, at::Generator& gen);

// Training FLOPs a token of the parameters alone: 6 a trainable parameter, 4 a frozen one.
double parameter_flops_per_token(const torch::nn::Module& model);

}  // namespace dnallm::models
