#include "worker/models/language_model.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <limits>

#include "core/enum_names.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"

namespace dnallm::models {

void LanguageModelImpl::enable_lora(int64_t /*r*/) {
  fail(ExitCode::kUsage,
       "the {} family has no LoRA adapters: set lora.r = 0 (full fine-tuning) or choose a model "
       "family with LoRA (model.arch = \"bert\" or \"gpt\", or a transformer model.init_from)",
       spec().family);
}

void LanguageModelImpl::set_context_parallel(std::shared_ptr<ContextParallel> cp) {
  if (cp == nullptr) return;
  fail(ExitCode::kUsage,
       "the {} family has no context parallelism yet: set parallel.context_parallel = 1, or "
       "choose a family that has it (HyenaDNA, Caduceus, the transformer's language models)",
       spec().family);
}

torch::Tensor LanguageModelImpl::generate(const torch::Tensor& prompt, const GenerateOptions& g) {
  DNALLM_CHECK(can_generate(), ExitCode::kUsage,
               "this {} model cannot generate: generation needs a causal language model "
               "(pre-trained with model.arch = \"gpt\", or a causal Hugging Face model)",
               spec().family);
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(g.seed);
  const int64_t vocab = spec().vocab_size;
  auto tokens = prompt;
  for (int64_t step = 0; step < g.max_new_tokens; ++step) {
    ForwardInputs in;
    in.input_ids = tokens;
    // A padded head's extra rows (HyenaDNA pads its vocabulary to a multiple of 8) are no token.
    auto logits = forward(in).logits.select(1, tokens.size(1) - 1).narrow(-1, 0, vocab);
    logits = logits.to(torch::kFloat32).cpu().clone();
    for (const int64_t id : g.suppress_ids) {
      if (id >= 0 && id < vocab)
        logits.select(-1, id).fill_(-std::numeric_limits<float>::infinity());
    }
    tokens = torch::cat({tokens, sample_next_token(logits, g, gen).to(tokens.device())}, 1);
  }
  return tokens;
}

torch::Tensor sample_next_token(torch::Tensor logits, const GenerateOptions& g,
                                at::Generator& gen) {
  if (g.greedy || g.temperature <= 0) return logits.argmax(-1, true);
  logits = logits / g.temperature;
  if (g.top_k > 0 && g.top_k < logits.size(-1)) {
    auto kth = std::get<0>(logits.topk(g.top_k, -1)).select(-1, g.top_k - 1).unsqueeze(-1);
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
  }
  return torch::multinomial(torch::softmax(logits, -1), 1, false, gen);
}

namespace {

constexpr EnumName<Task> kTaskNames[] = {{Task::kPretrain, "pretrain"},
                                         {Task::kClassification, "classification"},
                                         {Task::kRegression, "regression"}};
static_assert(lists_each_in_order<Task::kRegression>(kTaskNames));

}  // namespace

const char* task_name(Task task) { return name_of(kTaskNames, task, "?"); }

Task task_from_name(const std::string& name, const std::string& where) {
  if (auto task = value_named(kTaskNames, name)) return *task;
  fail(ExitCode::kUsage,
       "{}: task \"{}\" is not supported (\"pretrain\", \"classification\" or \"regression\")",
       where, clip_for_message(name));
}

const char* arch_name(Arch arch) { return arch == Arch::kBert ? "bert" : "gpt"; }

ModelOutput loss_from_logits(const torch::Tensor& logits, const ForwardInputs& in,
                             const ModelSpec& spec) {
  namespace F = torch::nn::functional;
  const auto ce = F::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum);
  ModelOutput out;
  if (spec.task == Task::kRegression) {
    out.logits = logits.dim() == 2 ? logits.squeeze(-1) : logits;
    if (in.targets.defined()) {
      out.loss_sum = (out.logits.to(torch::kFloat32) - in.targets.to(torch::kFloat32)).pow(2).sum();
      out.loss_count = in.targets.numel();
    }
    return out;
  }
  if (spec.task == Task::kClassification) {
    out.logits = logits;
    if (in.labels.defined()) {
      out.loss_sum = F::cross_entropy(logits.to(torch::kFloat32), in.labels, ce);
      out.loss_count =
          in.label_count >= 0 ? in.label_count : in.labels.ne(-100).sum().item<int64_t>();
    }
    return out;
  }
  if (!in.labels.defined()) {
    out.logits = logits;
    return out;
  }
  auto scored = logits;
  auto labels = in.labels;
  if (spec.arch == Arch::kGpt && spec.shift_labels) {  // position i predicts token i + 1
    scored = scored.narrow(1, 0, scored.size(1) - 1);
    labels = labels.narrow(1, 1, labels.size(1) - 1);
  }
  auto flat_logits = scored.reshape({-1, scored.size(-1)});
  auto flat_labels = labels.reshape({-1});
  if (in.logits_for_labels_only) {
    auto idx =
        in.label_index.defined() ? in.label_index : flat_labels.ne(-100).nonzero().squeeze(1);
    flat_logits = flat_logits.index_select(0, idx);
    flat_labels = flat_labels.index_select(0, idx);
  }
  out.loss_sum = F::cross_entropy(flat_logits.to(torch::kFloat32), flat_labels, ce);
  out.loss_count =
      in.label_count >= 0 ? in.label_count : flat_labels.ne(-100).sum().item<int64_t>();
  out.logits = in.logits_for_labels_only ? flat_logits : logits;
  return out;
}

double parameter_flops_per_token(const torch::nn::Module& model) {
  double flops = 0;
  for (const auto& p : model.parameters()) {
    flops += (p.requires_grad() ? 6.0 : 4.0) * double(p.numel());
  }
  return flops;
}

}  // namespace dnallm::models
