#include "worker/models/caduceus/caduceus_model.hpp"

#include <algorithm>
#include <map>

#include <spdlog/spdlog.h>

#include "checkpoint/durable_io.hpp"
#include "core/error.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/caduceus/mamba_context.hpp"
#include "worker/models/hf_directory.hpp"

namespace dnallm::models::caduceus {
namespace {

// Our token id -> its reverse complement's (bases A<->T, C<->G; N and special tokens map to
// themselves), for RCPS.
std::vector<int64_t> complement_of(const data::Tokenizer& tokenizer, int64_t rows) {
  const std::map<std::string, std::string> pairs = {{"A", "T"}, {"T", "A"}, {"C", "G"}, {"G", "C"}};
  std::map<std::string, int64_t> ids;
  for (int64_t id = data::kFirstRegularId; id < tokenizer.vocab_size(); ++id) {
    ids[tokenizer.id_to_piece(id)] = id;
  }
  std::vector<int64_t> map(static_cast<size_t>(rows));
  for (int64_t id = 0; id < rows; ++id) {
    map[static_cast<size_t>(id)] = id;
    if (id < data::kFirstRegularId || id >= tokenizer.vocab_size()) continue;
    const auto pair = pairs.find(tokenizer.id_to_piece(id));
    if (pair != pairs.end() && ids.count(pair->second) != 0) {
      map[static_cast<size_t>(id)] = ids.at(pair->second);
    }
  }
  return map;
}

void check_task(const Config& config, const std::string& what) {
  DNALLM_CHECK(config.model.task != cfg::Task::kRegression, ExitCode::kUsage,
               "{}: Caduceus has no regression head: use model.task = \"pretrain\" or "
               "\"classification\"",
               what);
}

const std::vector<std::string> kLoraTargets = {"in_proj", "out_proj"};

CaduceusModel wrap(CaduceusLM lm, int64_t vocab_size) {
  return CaduceusModel(std::make_shared<CaduceusModelImpl>(std::move(lm), vocab_size));
}

// [model] gradient_checkpointing and [lora] on a model whose weights are in place.
void configure(CaduceusModelImpl& model, const Config& config) {
  model.set_activation_checkpointing(config.model.gradient_checkpointing);
  model.lora = family_lora_options(config, kLoraTargets, "Caduceus");
  if (model.lora.r > 0) model.enable_lora();
}

// [model] as Caduceus options: model.hidden = d_model, model.layers = n_layer; d_state 16,
// expand 2, d_conv 4 (the published models'); RCPS for model.arch = "caduceus-ps".
LanguageModel build(const Config& config, const data::Tokenizer& tokenizer,
                    const BuildContext& context) {
  const auto& m = config.model;
  check_task(config, fmt::format("model.arch = \"{}\"", cfg::spelling(m.arch)));
  DNALLM_CHECK(m.hidden > 0 && m.layers > 0, ExitCode::kUsage,
               "model.hidden and model.layers must be positive");
  DNALLM_CHECK(m.init_from.empty(), ExitCode::kUsage,
               "model.init_from = \"{}\": a Caduceus model starts from a Hugging Face Caduceus "
               "directory (kuleshov-group's layout) or from scratch",
               m.init_from);
  CaduceusOptions o;
  o.d_model = m.hidden;
  o.n_layer = m.layers;
  o.dt_rank = (o.d_model + 15) / 16;
  o.vocab_size = (tokenizer.vocab_size() + 7) / 8 * 8;
  o.rcps = m.arch == cfg::Arch::kCaduceusPs;
  if (o.rcps) o.complement = complement_of(tokenizer, o.vocab_size);
  o.classifier = m.task == cfg::Task::kClassification;
  o.num_labels = m.num_labels;
  // Note [Caduceus tied head]: RCPS ties, except a run from before the tie, resumed with its
  // own head.
  o.tie_head = o.rcps && context.resumed_parameters.count("head_weight") == 0;
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  CaduceusLM lm(nullptr);
  {
    // Note [Streamed build] (LoRA is added to the whole model: built whole)
    StreamedBuild streamed(config.lora.r == 0 ? context.blocks : nullptr);
    lm = CaduceusLM(o);
  }
  auto model = wrap(lm, tokenizer.vocab_size());
  configure(*model, config);
  return model;
}

// (built whole: `context.blocks` is not installed; these models are small)
LanguageModel init_from_hf(const Config& config, const data::Tokenizer& tokenizer,
                           const BuildContext& /*context*/) {
  const auto& dir = config.model.init_from;
  check_task(config, "model.init_from = \"" + dir + "\"");
  CaduceusLM theirs = load_hf_caduceus(dir);
  const auto& t = theirs->options();
  const auto map = character_vocabulary_map(tokenizer, dir, t.vocab_size, "Caduceus");
  CaduceusOptions o = t;
  o.hf_config = nlohmann::json();
  if (o.rcps) o.complement = complement_of(tokenizer, o.vocab_size);
  o.classifier = config.model.task == cfg::Task::kClassification;
  o.num_labels = config.model.num_labels;
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  CaduceusLM lm(o);
  const int64_t copied = copy_matching_parameters(*theirs, *lm);
  torch::NoGradGuard no_grad;
  lm->word_embeddings->weight.copy_(
      gather_rows(theirs->word_embeddings->weight, map, lm->word_embeddings->weight));
  if (!o.classifier && !t.classifier && !o.tied_head()) {  // (a tied head is the embedding)
    lm->head_weight.copy_(gather_rows(theirs->head(), map, lm->head_weight));
  }
  spdlog::info(
      "initialised {} tensors from the Caduceus checkpoint {} (embedding rows in our "
      "token order{})",
      copied, dir, o.classifier == t.classifier ? "" : "; the task head is new");
  auto model = wrap(lm, tokenizer.vocab_size());
  model->vocab_map = map;
  model->source_options = t;
  model->source_embedding = theirs->word_embeddings->weight.detach().clone();
  if (!t.classifier && !t.tied_head()) model->source_head = theirs->head_weight.detach().clone();
  configure(*model, config);
  return model;
}

LanguageModel load_exported(const std::string& dir, const nlohmann::json& c) {
  const std::string where = dir + "/config.json";
  CaduceusOptions o = options_from_hf_config(c, where);
  read_exported_task(c, where, "Caduceus", o);
  // Note [Caduceus tied head]: our directories say whether the head is the embedding; those
  // from before the tie do not, and hold a separate head_weight.
  o.tie_head = tie_word_embeddings(c, false, where);
  const int64_t vocab =
      family_int(c, "dnallm_vocab_size", o.vocab_size, 1, o.vocab_size, where, "Caduceus");
  CaduceusLM lm(o);
  auto model = wrap(lm, vocab);
  load_named_tensors(model->named_weights(), dir,
                     [](const std::string& name) { return name == "complement"; });
  model->eval();
  return model;
}

std::optional<HfExport> hf_export(LanguageModel& model, const data::Tokenizer& /*tokenizer*/,
                                  const std::string& source_dir) {
  auto* m = &hub_model_of<CaduceusModelImpl>(model, "Caduceus");
  CaduceusLM lm = m->lm();
  // LoRA: the hub layout holds the merged weights (computed one linear at a time).
  const LiveWeights live(*lm, /*merge_adapters=*/true);
  CaduceusOptions o = lm->options();
  if (o.rcps && !o.classifier && !o.tie_head) {
    spdlog::warn(
        "this Caduceus-PS masked LM has its own lm_head (trained before Note [Caduceus tied "
        "head]), but the hub code ties an RCPS head to the embedding on load: the exported "
        "model will compute with the embedding as its head");
  }
  WeightReader weight = live;
  torch::Tensor complement = lm->complement;
  if (!m->vocab_map.empty()) {
    // Note [Character vocabularies]: back to the checkpoint's token order and complement map.
    o = hub_options(m->source_options, lm->options(), "CaduceusForSequenceClassification",
                    "CaduceusForMaskedLM");
    weight = vocabulary_scatter(
        live, m->vocab_map, lm->word_embeddings->weight, m->source_embedding,
        o.classifier || lm->options().tied_head() ? torch::Tensor() : lm->head_weight,
        m->source_head);
    complement = complement_table(o);
  }
  return hub_layout_export(hf_tensors(lm, complement, weight), hf_export_config(o), source_dir,
                           "Caduceus");
}

bool recognises_hf(const nlohmann::json& c) { return has_model_type(c, "caduceus"); }

}  // namespace

CaduceusModelImpl::CaduceusModelImpl(CaduceusLM lm, int64_t vocab_size)
    : HubModelImpl(std::move(lm)) {
  for (const auto& p : lm_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value());
  }
  for (const auto& b : lm_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  for (const auto& child : lm_->named_children()) register_module(child.key(), child.value());
  const auto& o = lm_->options();
  spec_.family = "caduceus";
  spec_.arch = Arch::kBert;
  spec_.task = o.classifier ? Task::kClassification : Task::kPretrain;
  spec_.vocab_size = vocab_size;
  spec_.hidden_size = o.rcps ? 2 * o.d_model : o.d_model;
  spec_.max_seq_length = 131072;  // the published models' training length; any length computes
  spec_.extends_past_max_length = true;
  spec_.num_labels = o.classifier ? o.num_labels : 2;
  spec_.pad_id = data::kPadId;
  spec_.masks_padding = false;
}

ModelOutput CaduceusModelImpl::forward(const ForwardInputs& in) {
  return loss_from_logits(lm_->forward(in.input_ids).to(torch::kFloat32), in, spec_);
}

torch::Tensor CaduceusModelImpl::encode(const ForwardInputs& in) {
  return lm_->hidden(in.input_ids);
}

namespace {

// Layer i's unit: both directions of its BiMamba (mamba_rev's own x_proj, dt_proj, conv1d, A_log
// and D besides the tied projections that mamba_fwd holds), which mixer(i) alone reads, inside
// the block hooks. A view for blocks(): not registered in the model, so names are unchanged.
struct LayerUnit : torch::nn::Module {
  LayerUnit(const Mamba& fwd, const Mamba* rev) {
    register_module("mamba_fwd", fwd.ptr());
    if (rev != nullptr) register_module("mamba_rev", rev->ptr());
  }
};

}  // namespace

std::vector<std::shared_ptr<torch::nn::Module>> CaduceusModelImpl::blocks() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (size_t i = 0; i < lm_->fwd.size(); ++i) {
    out.push_back(
        std::make_shared<LayerUnit>(lm_->fwd[i], i < lm_->rev.size() ? &lm_->rev[i] : nullptr));
  }
  return out;
}

void CaduceusModelImpl::set_activation_checkpointing(bool on) {
  lm_->gradient_checkpointing = on;  // Note [Caduceus activation checkpointing]
}

void CaduceusModelImpl::enable_lora(int64_t r) {
  const auto wants = start_lora(r, kLoraTargets, "Caduceus");
  for (auto& m : lm_->fwd) {  // mamba_rev uses these very modules (Note [Caduceus LoRA targets])
    if (wants("in_proj")) m->in_proj->enable_lora(lora.r, lora.alpha, lora.dropout);
    if (wants("out_proj")) m->out_proj->enable_lora(lora.r, lora.alpha, lora.dropout);
  }
  // A task head is new for a fine-tune: it trains in full (PEFT's modules_to_save).
  if (lm_->options().classifier) lm_->head_weight.set_requires_grad(true);
  finish_lora();
}

void CaduceusModelImpl::merge_lora() {
  for (auto& m : lm_->fwd) {
    m->in_proj->merge_lora();
    m->out_proj->merge_lora();
  }
}

void CaduceusModelImpl::set_context_parallel(std::shared_ptr<ContextParallel> cp) {
  if (cp == nullptr || cp->group == nullptr) {
    lm_->context = nullptr;
    return;
  }
  const int world = cp->group->world_size(), rank = cp->group->rank();
  // The trainer's mesh gives the length per batch (0 until then; its padding keeps it a
  // multiple of the degree and its layout contiguous, as spec().context_layout asks).
  DNALLM_CHECK(cp->full_length >= 0 && cp->full_length % world == 0, ExitCode::kUsage,
               "parallel.context_parallel = {}: the sequence length {} is not a positive multiple "
               "of it; pad sequences to a multiple of the context-parallel degree",
               world, cp->full_length);
  if (cp->positions.defined()) {  // Note [Mamba context parallelism]: contiguous shards only
    const int64_t per_rank = cp->full_length / world;
    DNALLM_CHECK(
        cp->positions.numel() == per_rank &&
            cp->positions.to(torch::kCPU, torch::kLong)
                .equal(torch::arange(rank * per_rank, (rank + 1) * per_rank, torch::kLong)),
        ExitCode::kUsage,
        "context parallelism: Caduceus needs each rank's positions contiguous (rank {} "
        "holding [{}, {})); the data path gave others (a zig-zag layout?)",
        rank, rank * per_rank, (rank + 1) * per_rank);
  }
  lm_->context = make_mamba_context(*cp->group);
}

double CaduceusModelImpl::flops_per_token(int64_t /*seq_len*/) const {
  const auto& o = lm_->options();
  const double directions = (o.bidirectional ? 2.0 : 1.0) * (o.rcps ? 2.0 : 1.0);
  return parameter_flops_per_token(*this) +
         3.0 * 9.0 * directions * double(o.n_layer) * double(o.d_inner()) * double(o.d_state);
}

std::vector<std::pair<std::string, torch::Tensor>> CaduceusModelImpl::named_weights() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : named_parameters()) {
    if (!is_lora_parameter(p.key())) out.emplace_back(p.key(), p.value());
  }
  for (const auto& b : named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

nlohmann::ordered_json CaduceusModelImpl::export_config() const {
  auto o = lm_->options();
  o.hf_config = nlohmann::json();
  auto c = nlohmann::ordered_json::parse(hf_config_of(o).dump());
  c["dnallm_arch"] = lm_->options().rcps ? "caduceus-ps" : "caduceus";
  c["dnallm_vocab_size"] = spec_.vocab_size;
  c["task"] = task_name(spec_.task);
  if (spec_.task == Task::kClassification) c["num_labels"] = spec_.num_labels;
  return c;
}

ModelFamily caduceus_family() {
  ModelFamily f;
  f.name = "caduceus";
  f.arches = {cfg::Arch::kCaduceus, cfg::Arch::kCaduceusPs};
  f.exported_types = {"caduceus"};
  f.recognises_hf = recognises_hf;
  f.build = build;
  f.init_from_hf = init_from_hf;
  f.load_exported = load_exported;
  f.load_hf = [](const std::string& dir) {
    auto lm = load_hf_caduceus(dir);
    const int64_t vocab = lm->options().vocab_size;
    return LanguageModel(wrap(std::move(lm), vocab));
  };
  f.hf_tokenizer = [](const std::string& dir) {
    return std::make_shared<const data::HfTokenizer>(
        data::HfTokenizer::dna_characters(dir, "CaduceusTokenizer"));
  };
  f.hf_export = hf_export;
  f.peft_module_names = [](LanguageModel& model, const std::string& module) {
    auto* caduceus_model = dynamic_cast<CaduceusModelImpl*>(model.get());
    return caduceus_model != nullptr ? hf_module_names(caduceus_model->lm()->options(), module)
                                     : std::vector<std::string>{module};
  };
  return f;
}

}  // namespace dnallm::models::caduceus
