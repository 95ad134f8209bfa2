#include "worker/models/hyena/hyena_model.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "checkpoint/durable_io.hpp"
#include "core/error.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/hf_directory.hpp"

namespace dnallm::models::hyena {
namespace {

// [model] and [lora] as HyenaDNA options: model.hidden = d_model, model.ffn = d_inner,
// model.layers = n_layer, model.max_seq_length = max_seq_len (the filters' length).
HyenaOptions options_from_config(const Config& config, int64_t vocab_size) {
  const auto& m = config.model;
  DNALLM_CHECK(m.task != cfg::Task::kRegression, ExitCode::kUsage,
               "model.arch = \"hyena\" has no regression head: use model.task = \"pretrain\" or "
               "\"classification\"");
  DNALLM_CHECK(m.hidden > 0 && m.ffn > 0 && m.layers > 0 && m.max_seq_length > 1, ExitCode::kUsage,
               "model.hidden, model.ffn, model.layers must be positive and model.max_seq_length "
               "> 1");
  HyenaOptions o;
  o.vocab_size = vocab_size;
  o.d_model = m.hidden;
  o.d_inner = m.ffn;
  o.n_layer = m.layers;
  o.max_seq_len = m.max_seq_length;
  o.pad_token_id = data::kPadId;
  o.classifier = m.task == cfg::Task::kClassification;
  o.num_labels = m.num_labels;
  o.gradient_checkpointing = m.gradient_checkpointing;
  o.chunking.positions = m.chunk_positions;
  o.chunking.channels = m.chunk_channels;
  return o;
}

HyenaModel wrap(HyenaLM lm) { return HyenaModel(std::make_shared<HyenaModelImpl>(std::move(lm))); }

const std::vector<std::string> kLoraTargets = {"in_proj", "out_proj", "fc1", "fc2"};

// [lora] on a model whose weights are in place.
void configure_lora(HyenaModelImpl& model, const Config& config) {
  model.lora = family_lora_options(config, kLoraTargets, "HyenaDNA");
  if (model.lora.r > 0) model.enable_lora();
}

// Parameters of `from` copied into `to` where name and shape agree (a fresh head stays
// fresh), and the stored positional features (Note [Hyena positional features]).
int64_t copy_matching(HyenaLM& from, HyenaLM& to) {
  const int64_t copied = copy_matching_parameters(*from, *to);
  for (size_t i = 0; i < to->blocks.size() && i < from->blocks.size(); ++i) {
    to->blocks[i]->mixer->filter_fn->stored_z = from->blocks[i]->mixer->filter_fn->stored_z;
  }
  return copied;
}

LanguageModel build(const Config& config, const data::Tokenizer& tokenizer,
                    const BuildContext& context) {
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  HyenaLM lm(nullptr);
  {
    // Note [Streamed build]: whole when it copies from another model below.
    // (LoRA is added to the whole model: built whole)
    StreamedBuild streamed(config.model.init_from.empty() && config.lora.r == 0 ? context.blocks
                                                                                : nullptr);
    lm = HyenaLM(options_from_config(config, tokenizer.vocab_size()));
  }
  if (!config.model.init_from.empty()) {  // one of our own HyenaDNA directories
    auto base = load_exported_model(config.model.init_from);
    auto* hyena = dynamic_cast<HyenaModelImpl*>(base.get());
    DNALLM_CHECK(hyena != nullptr, ExitCode::kUsage,
                 "model.init_from = \"{}\" holds a {} model, not HyenaDNA (model.arch = "
                 "\"hyena\")",
                 config.model.init_from, base->spec().family);
    const auto copied = copy_matching(hyena->lm(), lm);
    spdlog::info("initialised {} tensors from {}", copied, config.model.init_from);
  }
  auto model = wrap(lm);
  configure_lora(*model, config);
  return model;
}

// (built whole: `context.blocks` is not installed; these models are small)
LanguageModel init_from_hf(const Config& config, const data::Tokenizer& tokenizer,
                           const BuildContext& /*context*/) {
  const auto& dir = config.model.init_from;
  HyenaLM theirs = load_hf_hyena(dir);
  const auto& t = theirs->options();
  const auto map = character_vocabulary_map(tokenizer, dir, t.vocab_size, "HyenaDNA");
  HyenaOptions o = t;
  o.hf_config = nlohmann::json();  // ours: our vocabulary (export_config)
  o.vocab_size = tokenizer.vocab_size();
  o.pad_token_id = data::kPadId;
  DNALLM_CHECK(config.model.task != cfg::Task::kRegression, ExitCode::kUsage,
               "model.init_from = \"{}\": HyenaDNA has no regression head: use model.task = "
               "\"pretrain\" or \"classification\"",
               dir);
  o.classifier = config.model.task == cfg::Task::kClassification;
  o.num_labels = config.model.num_labels;
  o.gradient_checkpointing = config.model.gradient_checkpointing;
  o.chunking.positions = config.model.chunk_positions;
  o.chunking.channels = config.model.chunk_channels;
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  HyenaLM lm(o);
  const int64_t copied = copy_matching(theirs, lm);
  torch::NoGradGuard no_grad;
  lm->word_embeddings->weight.copy_(
      gather_rows(theirs->word_embeddings->weight, map, lm->word_embeddings->weight));
  const bool same_head =
      o.classifier == t.classifier && (!o.classifier || o.num_labels == t.num_labels);
  if (!o.classifier && !t.classifier) {
    lm->head->weight.copy_(gather_rows(theirs->head->weight, map, lm->head->weight));
  }
  auto model = std::make_shared<HyenaModelImpl>(lm);
  model->vocab_map = map;
  model->source_options = t;
  model->source_embedding = theirs->word_embeddings->weight.detach().clone();
  if (!t.classifier) model->source_head = theirs->head->weight.detach().clone();
  spdlog::info(
      "initialised {} tensors from the HyenaDNA checkpoint {} (embedding rows in our "
      "token order{})",
      copied, dir, same_head ? "" : "; the task head is new");
  configure_lora(*model, config);
  return HyenaModel(model);
}

LanguageModel load_exported(const std::string& dir, const nlohmann::json& c) {
  const std::string where = dir + "/config.json";
  HyenaOptions o = options_from_hf_config(c, where);
  read_exported_task(c, where, "HyenaDNA", o);
  HyenaLM lm(o);
  load_named_tensors(lm->named_weights(), dir, [](const std::string& name) {
    return name.find("modulation.deltas") != std::string::npos;  // regenerated (Note [Hyena])
  });
  lm->eval();
  auto model = wrap(lm);
  model->eval();
  return model;
}

std::optional<HfExport> hf_export(LanguageModel& model, const data::Tokenizer& tokenizer,
                                  const std::string& source_dir) {
  auto* m = &hub_model_of<HyenaModelImpl>(model, "HyenaDNA");
  HyenaLM lm = m->lm();
  // LoRA: the hub layout holds the merged weights (computed one linear at a time).
  const LiveWeights live(*lm, /*merge_adapters=*/true);
  HyenaOptions o = lm->options();
  WeightReader weight = live;
  if (!m->vocab_map.empty()) {
    // Note [Character vocabularies]: back to the checkpoint's token order.
    o = hub_options(m->source_options, lm->options(), "HyenaDNAForSequenceClassification",
                    "HyenaDNAForCausalLM");
    weight =
        vocabulary_scatter(live, m->vocab_map, lm->word_embeddings->weight, m->source_embedding,
                           o.classifier ? torch::Tensor() : lm->head->weight, m->source_head);
  } else if (tokenizer.tokenizer_kind() == cfg::TokenizerKind::kChar) {
    // A model of ours: its rows go to CharacterTokenizer's ids too (Note [Character
    // vocabularies]), [CLS] 0 ... [UNK] 6, A C G T N 7-11, so that the hub code and our own
    // model.init_from read the export as they read a published checkpoint (rows we have no
    // token for, [BOS] and [RESERVED], are zero).
    const auto map = character_vocabulary_map(tokenizer, "", kHubVocabSize, "HyenaDNA");
    o.vocab_size = kHubVocabSize;
    o.pad_token_id = map.at(data::kPadId);
    const auto zeros = torch::zeros({o.padded_vocab(), o.d_model});
    weight = vocabulary_scatter(live, map, lm->word_embeddings->weight, zeros,
                                o.classifier ? torch::Tensor() : lm->head->weight,
                                o.classifier ? torch::Tensor() : zeros);
  }
  return hub_layout_export(hf_tensors(lm, weight),
                           o.hf_config.is_null() ? hf_config_of(o) : o.hf_config, source_dir,
                           "HyenaDNA");
}

bool recognises_hf(const nlohmann::json& c) { return has_model_type(c, "hyenadna"); }

}  // namespace

HyenaModelImpl::HyenaModelImpl(HyenaLM lm) : HubModelImpl(std::move(lm)) {
  // The hub's names, unprefixed: this module holds the model's own children.
  for (const auto& child : lm_->named_children()) register_module(child.key(), child.value());
  const auto& o = lm_->options();
  spec_.family = "hyena";
  spec_.fp32_parameters = true;  // the fused mixer and fp32 regions read fp32 parameters
  spec_.arch = Arch::kGpt;
  spec_.task = o.classifier ? Task::kClassification : Task::kPretrain;
  spec_.vocab_size = o.vocab_size;
  spec_.hidden_size = o.d_model;
  spec_.max_seq_length = o.max_seq_len;
  spec_.num_labels = o.classifier ? o.num_labels : 2;
  spec_.pad_id = o.pad_token_id;
  spec_.shift_labels = true;
}

ModelOutput HyenaModelImpl::forward(const ForwardInputs& in) {
  return loss_from_logits(lm_->forward(in.input_ids), in, spec_);
}

torch::Tensor HyenaModelImpl::encode(const ForwardInputs& in) { return lm_->hidden(in.input_ids); }

std::vector<std::shared_ptr<torch::nn::Module>> HyenaModelImpl::blocks() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& b : lm_->blocks) out.push_back(b.ptr());
  return out;
}

void HyenaModelImpl::set_activation_checkpointing(bool on) { lm_->set_gradient_checkpointing(on); }

void HyenaModelImpl::enable_lora(int64_t r) {
  const auto wants = start_lora(r, kLoraTargets, "HyenaDNA");
  for (auto& b : lm_->blocks) {
    if (wants("in_proj")) b->mixer->in_proj->enable_lora(lora.r, lora.alpha, lora.dropout);
    if (wants("out_proj")) b->mixer->out_proj->enable_lora(lora.r, lora.alpha, lora.dropout);
    if (wants("fc1")) b->fc1->enable_lora(lora.r, lora.alpha, lora.dropout);
    if (wants("fc2")) b->fc2->enable_lora(lora.r, lora.alpha, lora.dropout);
  }
  // A task head is new for a fine-tune: it trains in full (PEFT's modules_to_save).
  if (lm_->options().classifier) {
    for (auto& p : lm_->head->parameters()) p.set_requires_grad(true);
  }
  finish_lora();
}

void HyenaModelImpl::merge_lora() {
  for (auto& b : lm_->blocks) {
    for (auto* lin : {&b->mixer->in_proj, &b->mixer->out_proj, &b->fc1, &b->fc2}) {
      (*lin)->merge_lora();
    }
  }
}

void HyenaModelImpl::set_context_parallel(std::shared_ptr<ContextParallel> cp) {
  const bool on = cp != nullptr;
  lm_->set_context_parallel(std::move(cp));
  spec_.shift_labels = !on;
}

double HyenaModelImpl::flops_per_token(int64_t seq_len) const {
  const auto& o = lm_->options();
  const double n = 2.0 * double(std::max<int64_t>(seq_len, 1));
  const double fft_per_point = 2.5 * std::log2(n);  // a real FFT of n points / n, FLOPs
  // Three FFTs of 2L points per channel and layer over L tokens: 3 x 2 x fft_per_point a token;
  // backward twice the forward.
  return parameter_flops_per_token(*this) +
         3.0 * double(o.n_layer) * double(o.d_model) * 3.0 * 2.0 * fft_per_point;
}

std::vector<std::pair<std::string, torch::Tensor>> HyenaModelImpl::named_weights() const {
  return lm_->named_weights();
}

nlohmann::ordered_json HyenaModelImpl::export_config() const {
  auto o = lm_->options();
  o.hf_config = nlohmann::json();
  nlohmann::ordered_json c = nlohmann::ordered_json::parse(hf_config_of(o).dump());
  c["dnallm_arch"] = "hyena";
  c["task"] = task_name(spec_.task);
  return c;
}

ModelFamily hyena_family() {
  ModelFamily f;
  f.name = "hyena";
  f.arches = {cfg::Arch::kHyena};
  f.exported_types = {"hyenadna"};
  f.recognises_hf = recognises_hf;
  f.build = build;
  f.init_from_hf = init_from_hf;
  f.load_exported = load_exported;
  f.load_hf = [](const std::string& dir) { return LanguageModel(wrap(load_hf_hyena(dir))); };
  f.hf_tokenizer = [](const std::string& dir) {
    return std::make_shared<const data::HfTokenizer>(
        data::HfTokenizer::dna_characters(dir, "HyenaDNATokenizer"));
  };
  f.hf_export = hf_export;
  return f;
}

}  // namespace dnallm::models::hyena
