// PEFT adapters on a Hugging Face model, and fine-tuning from a Hugging Face directory
// (init_from_hf: the vocabulary mapped, the tensors loaded block by block).
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/block_hooks.hpp"
#include "worker/models/hf_directory.hpp"
#include "worker/models/transformer/hf_import_detail.hpp"

namespace dnallm::models {

using nlohmann::json;
using torch::Tensor;
using namespace detail;  // hf_import_detail.hpp

namespace {

std::string shape_of(const Tensor& t) { return fmt::format("{}", fmt::join(t.sizes(), "x")); }

}  // namespace

PeftAdapter read_peft_adapter(const std::string& adapter_dir, const HfCheckpoint& base) {
  const std::string path = adapter_dir + "/adapter_config.json";
  const json c = read_directory_json(
      path, "a PEFT adapter directory holds adapter_config.json and adapter_model.safetensors");
  auto expect = [&](const char* key, const json& wanted, const char* what) {
    expect_value(c, path, key, wanted, what);
  };
  DNALLM_CHECK(c.value("peft_type", std::string()) == "LORA", ExitCode::kUsage,
               "{}: peft_type = {} is not supported: supported is \"LORA\"", path,
               c.value("peft_type", json()).dump());
  expect("use_dora", false, "DoRA is not supported");
  expect("use_rslora", false, "rsLoRA scaling is not supported");
  expect("fan_in_fan_out", false, "supported is false (nn.Linear layout)");
  expect("bias", "none", "supported is \"none\"");
  expect("lora_bias", false, "supported is false");
  expect("rank_pattern", json::object(), "per-module ranks are not supported");
  expect("alpha_pattern", json::object(), "per-module alphas are not supported");
  expect("layers_to_transform", json(), "supported is every layer (null)");
  expect("layer_replication", json(), "supported is null");
  expect("target_parameters", json(), "supported is null");
  expect("trainable_token_indices", json(), "supported is null");
  PeftAdapter a;
  a.r = c.value("r", int64_t{0});
  a.alpha = c.value("lora_alpha", 8.0);
  a.dropout = c.value("lora_dropout", 0.0);
  DNALLM_CHECK(a.r > 0, ExitCode::kUsage, "{}: r must be > 0", path);
  const auto& targets = c.value("target_modules", json());
  DNALLM_CHECK(targets.is_array(), ExitCode::kUsage,
               "{}: target_modules = {} is not supported: give a list of module names", path,
               targets.dump());
  for (const auto& t : targets) {
    const auto name = t.get<std::string>();
    DNALLM_CHECK(name == "query" || name == "key" || name == "value", ExitCode::kUsage,
                 "{}: target_modules has \"{}\": supported are \"query\", \"key\", \"value\"", path,
                 name);
    a.targets.push_back(name);
  }
  const std::string weights_path = adapter_dir + "/adapter_model.safetensors";
  DNALLM_CHECK(std::filesystem::exists(weights_path), ExitCode::kUsage, "{} not found",
               weights_path);
  const std::string prefix = "base_model.model.";
  for (auto& [name, t] : load_safetensors(weights_path)) {
    DNALLM_CHECK(name.rfind(prefix, 0) == 0, ExitCode::kUsage,
                 "{}: tensor {} does not start with \"{}\"", weights_path, name, prefix);
    std::string rest = name.substr(prefix.size());
    std::string ours;
    for (const char* part : {".lora_A.weight", ".lora_B.weight"}) {
      const auto pos = rest.find(part);
      if (pos != std::string::npos && pos + std::strlen(part) == rest.size()) {
        ours = rename(base.model_type, rest.substr(0, pos) + ".weight");
        ours = ours.substr(0, ours.size() - 7) + std::string(part).substr(0, 7);
      }
    }
    if (ours.empty()) ours = rename(base.model_type, rest);  // modules_to_save
    a.weights[ours] = t.to(torch::kFloat32);
  }
  return a;
}

TransformerLM build_hf_model_with_adapter(const HfCheckpoint& base, const PeftAdapter& a) {
  ModelOptions o = base.options;
  o.lora_r = a.r;
  o.lora_alpha = a.alpha;
  o.lora_dropout = a.dropout;
  o.lora_targets = a.targets;
  TransformerLM model(o);
  std::map<std::string, Tensor> params;
  for (const auto& item : model->named_parameters()) params.emplace(item.key(), item.value());
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_weights()) p.copy_(base.read(name));
  std::set<std::string> adapters_seen;
  for (const auto& [name, t] : a.weights) {
    auto it = params.find(name);
    DNALLM_CHECK(it != params.end(), ExitCode::kUsage,
                 "adapter tensor {} (our name) has no place in the {} base: the adapter was "
                 "made for another model",
                 name, base.architecture);
    DNALLM_CHECK(it->second.sizes() == t.sizes(), ExitCode::kUsage,
                 "adapter tensor {} has shape {} but the base needs {}", name, shape_of(t),
                 shape_of(it->second));
    it->second.copy_(t);
    adapters_seen.insert(name);
  }
  for (const auto& [name, p] : params) {
    const bool lora =
        name.find(".lora_A") != std::string::npos || name.find(".lora_B") != std::string::npos;
    DNALLM_CHECK(!lora || adapters_seen.count(name), ExitCode::kUsage,
                 "the adapter lacks {} (our name) for its target_modules", name);
  }
  model->eval();
  return model;
}

std::vector<int64_t> vocabulary_map(const data::Tokenizer& ours, const data::HfTokenizer& theirs,
                                    const std::string& dir) {
  const auto& sp = theirs.special();
  std::vector<int64_t> map(static_cast<size_t>(ours.vocab_size()), -1);
  for (int64_t id = 0; id < ours.vocab_size(); ++id) {
    int64_t t = -1;
    switch (id) {
      case data::kPadId:
        t = sp.pad;
        break;
      case data::kUnkId:
        t = sp.unk;
        break;
      case data::kClsId:
        t = sp.cls >= 0 ? sp.cls : sp.bos;
        break;
      case data::kSepId:
        t = sp.sep >= 0 ? sp.sep : sp.eos;
        break;
      case data::kMaskId:
        t = sp.mask;
        break;
      default:
        t = theirs.id_of(ours.id_to_piece(id));
        break;
    }
    DNALLM_CHECK(t >= 0 || ours.is_special(id), ExitCode::kUsage,
                 "model.init_from = \"{}\": its vocabulary lacks \"{}\" of [tokenizer]: use the "
                 "tokenizer settings the model was trained with",
                 dir, ours.id_to_piece(id));
    map[static_cast<size_t>(id)] = t;
  }
  return map;
}

namespace {

// The same tokenization as the directory's, else every id would mean another thing.
void check_same_tokenization(const Config& config, const data::Tokenizer& ours,
                             const data::HfTokenizer& theirs, const std::string& dir) {
  using Scheme = data::HfTokenizer::Scheme;
  const bool same_scheme =
      (theirs.scheme() == Scheme::kOverlappingKmer &&
       ours.tokenizer_kind() == cfg::TokenizerKind::kKmer && config.tokenizer.k == theirs.k() &&
       config.tokenizer.stride == 1) ||
      (theirs.scheme() == Scheme::kLongestMatch &&
       ours.tokenizer_kind() == cfg::TokenizerKind::kNt && config.tokenizer.k == theirs.k()) ||
      (theirs.scheme() == Scheme::kCharacter &&
       ours.tokenizer_kind() == cfg::TokenizerKind::kChar) ||
      (theirs.scheme() == Scheme::kBpe && ours.tokenizer_kind() == cfg::TokenizerKind::kHf);
  std::string theirs_text, setting;
  switch (theirs.scheme()) {
    case Scheme::kOverlappingKmer:
      theirs_text = fmt::format("overlapping {}-mers (DNABERT)", theirs.k());
      setting = fmt::format("set tokenizer.kind = \"kmer\", tokenizer.k = {}, tokenizer.stride = 1",
                            theirs.k());
      break;
    case Scheme::kLongestMatch:
      theirs_text = fmt::format("non-overlapping {}-mers with single-base fallback (EsmTokenizer)",
                                theirs.k());
      setting = fmt::format("set tokenizer.kind = \"nt\", tokenizer.k = {}", theirs.k());
      break;
    case Scheme::kCharacter:
      theirs_text = "one token a base";
      setting = "set tokenizer.kind = \"char\"";
      break;
    case Scheme::kBpe:
      theirs_text = fmt::format("with BPE ({} merges in its tokenizer.json)", theirs.bpe_merges());
      setting = "set tokenizer.kind = \"hf\" (its own tokenizer; tokenizer.path empty)";
      break;
  }
  DNALLM_CHECK(same_scheme, ExitCode::kUsage,
               "model.init_from = \"{}\" tokenizes {}; [tokenizer] here is kind = \"{}\": {}", dir,
               theirs_text, ours.kind(), setting);
  if (ours.tokenizer_kind() == cfg::TokenizerKind::kHf) {
    // tokenizer.path may name another directory: its merges must be these.
    const auto own = data::load_hf_bpe_tokenizer(dir)->to_json();
    DNALLM_CHECK(own.at("hf_tokenizer_json") == ours.to_json().at("hf_tokenizer_json"),
                 ExitCode::kUsage,
                 "model.init_from = \"{}\": tokenizer.path names another tokenizer.json than the "
                 "model's: leave tokenizer.path empty to use the model's own",
                 dir);
  }
}

// The architecture from config.json; the task, heads, dropout and LoRA from `config`.
ModelOptions fine_tune_options(const Config& config, const data::Tokenizer& ours,
                               const HfCheckpoint& h) {
  const std::string& dir = config.model.init_from;
  const ModelOptions wanted = model_options_from_config(config, ours.vocab_size());
  const ModelOptions& a = h.options;
  DNALLM_CHECK(wanted.arch == a.arch, ExitCode::kUsage,
               "model.init_from = \"{}\" is a {} ({}): set model.arch = \"{}\"", dir,
               h.architecture, a.arch == Arch::kBert ? "encoder" : "causal LM",
               a.arch == Arch::kBert ? "bert" : "gpt");
  const int64_t usable =
      a.rotary || a.alibi ? config.model.max_seq_length : a.max_seq_length - reserved_positions(a);
  DNALLM_CHECK(config.model.max_seq_length <= usable, ExitCode::kUsage,
               "model.max_seq_length = {} exceeds the {} positions of model.init_from = \"{}\": "
               "set model.max_seq_length <= {}",
               config.model.max_seq_length, usable, dir, usable);
  ModelOptions o = a;
  o.task = wanted.task;
  o.num_labels = wanted.num_labels;
  o.mean_pooling = wanted.mean_pooling;
  o.dropout = wanted.dropout;
  o.attn = wanted.attn;
  o.gradient_checkpointing = wanted.gradient_checkpointing;
  o.lora_r = wanted.lora_r;
  o.lora_alpha = wanted.lora_alpha;
  o.lora_dropout = wanted.lora_dropout;
  o.lora_targets = wanted.lora_targets;
  o.vocab_size = ours.vocab_size();
  o.pad_id = data::kPadId;
  if (a.rotary || a.alibi) o.max_seq_length = config.model.max_seq_length;
  if (a.position_padding_idx >= 0) {  // Note [Positions after another pad id]
    o.position_padding_idx = data::kPadId;
    o.max_seq_length = a.max_seq_length - (a.position_padding_idx - data::kPadId);
  }
  return o;
}

// Note [Positions after another pad id]: RoBERTa numbering (roberta-prelayernorm, ESM with
// learned positions: Nucleotide Transformer v1, pad id 1) gives the real tokens positions
// padding_idx + 1, + 2, ... and padding tokens padding_idx, where padding_idx is the pad token's
// id, which it also compares the ids with. Our [PAD] is data::kPadId, so the fine-tuned model
// numbers from kPadId and its table is theirs without the first padding_idx - kPadId rows: row i
// of ours is row i + that shift of theirs (load_hf_weights), the same positions for every token.
int64_t position_shift(const ModelOptions& theirs, const ModelOptions& ours) {
  return theirs.position_padding_idx >= 0 && ours.position_padding_idx >= 0
             ? theirs.position_padding_idx - ours.position_padding_idx
             : 0;
}

// Copies the checkpoint's tensors into a fine-tuned model's parameters (vocabulary rows
// through `map`; a tensor the checkpoint lacks or holds in another shape keeps its fresh
// initialisation), one at a time, and logs what it did.
class HfLoader {
 public:
  HfLoader(const HfCheckpoint& h, const ModelOptions& ours, const std::string& root,
           const std::vector<int64_t>& map, const data::Tokenizer& tokenizer)
      : h_(h),
        map_(map),
        by_vocab_({root + ".embeddings.word_embeddings.weight", "cls.predictions.bias",
                   "cls.predictions.decoder.weight", "lm_head.weight"}),
        positions_(root + ".embeddings.position_embeddings.weight"),
        shift_(position_shift(h.options, ours)) {
    for (size_t id = 0; id < map.size(); ++id) {
      DNALLM_CHECK(map[id] < h.options.vocab_size, ExitCode::kUsage,
                   "model.init_from = \"{}\": token id {} is outside vocab_size {}", h.dir, map[id],
                   h.options.vocab_size);
      if (map[id] < 0) fresh_.push_back(tokenizer.id_to_piece(static_cast<int64_t>(id)));
    }
  }

  void load(const std::string& name, const Tensor& p) {
    torch::NoGradGuard no_grad;
    auto it = h_.tensors.find(name);
    const bool vocab = by_vocab_.count(name) != 0;
    if (it != h_.tensors.end() && name == positions_ && shift_ > 0 &&
        it->second.shape[0] == p.size(0) + shift_) {
      p.copy_(h_.read(name).narrow(0, shift_, p.size(0)));  // Note [Positions after another pad id]
    } else if (it == h_.tensors.end() || (!vocab && it->second.shape != p.sizes().vec())) {
      kept_.push_back(name);  // a new head
      return;
    } else if (vocab) {
      const Tensor theirs = h_.read(name);
      for (size_t id = 0; id < map_.size(); ++id) {
        if (map_[id] >= 0) p[static_cast<int64_t>(id)].copy_(theirs[map_[id]]);
      }
    } else {
      p.copy_(h_.read(name));
    }
    ++loaded_;
  }

  void log() const {
    spdlog::info("initialised {} tensors from the Hugging Face {} in {}{}{}", loaded_,
                 h_.architecture, h_.dir,
                 kept_.empty() ? std::string()
                               : fmt::format("; newly initialised: {}", fmt::join(kept_, ", ")),
                 fresh_.empty()
                     ? std::string()
                     : fmt::format("; tokens without a row there: {}", fmt::join(fresh_, " ")));
  }

 private:
  const HfCheckpoint& h_;
  const std::vector<int64_t>& map_;
  const std::set<std::string> by_vocab_;
  const std::string positions_;
  const int64_t shift_;
  int64_t loaded_ = 0;
  std::vector<std::string> kept_, fresh_;
};

}  // namespace

TransformerLM build_filled(const ModelOptions& options, int64_t lora_r, WeightFormat base,
                           BlockSink* blocks,
                           const std::function<void(const std::string&, const Tensor&)>& fill) {
  ModelOptions lora_options = options;
  lora_options.lora_r = lora_r;
  std::set<const void*> offered;  // the blocks' parameters, given to `fill` as they were built
  QuantizeReport quantized;
  FillingSink filling(blocks, [&](const std::string& prefix, torch::nn::Module& block) {
    for (const auto& p : block.named_parameters()) {
      if (fill) fill(prefix + p.key(), p.value());
      offered.insert(p.value().unsafeGetTensorImpl());
    }
    if (lora_r > 0) enable_block_lora(block, lora_options);
    quantize_block_linears(block, base, quantized);
  });
  TransformerLM model(nullptr);
  {
    StreamedBuild streamed(&filling);
    model = TransformerLM(options);
  }
  if (fill) {
    for (auto& [name, p] : model->named_weights()) {
      if (offered.count(p.unsafeGetTensorImpl()) == 0) fill(name, p);
    }
  }
  if (lora_r > 0) model->enable_lora(lora_r);
  if (quantized.linears > 0) {
    spdlog::info(
        "QLoRA: {} base linears in {} ({:.2f} MB, {:.3f}x bf16)", quantized.linears,
        base == WeightFormat::kNf4 ? "nf4" : "int8", quantized.quantized_bytes / 1e6,
        double(quantized.quantized_bytes) / double(std::max<int64_t>(quantized.bf16_bytes(), 1)));
  }
  return model;
}

WeightFormat qlora_base_format(const Config& config, int64_t lora_r) {
  const auto base = config.lora.quantize_base;
  DNALLM_CHECK(base == cfg::QuantizeBase::kNone || lora_r > 0, ExitCode::kUsage,
               "lora.quantize_base = \"{}\" quantizes the frozen base of a LoRA fine-tune: "
               "set lora.r > 0",
               cfg::spelling(base));
  return weight_format_of(base);
}

ModelOptions hf_fine_tune_options(const Config& config, const data::Tokenizer& ours) {
  return fine_tune_options(config, ours, read_hf_checkpoint(config.model.init_from));
}

TransformerLM init_from_hf(const Config& config, const data::Tokenizer& ours,
                           const BuildContext& context) {
  const std::string& dir = config.model.init_from;
  const HfCheckpoint h = read_hf_checkpoint(dir);
  const auto theirs = data::HfTokenizer::load(dir);
  check_same_tokenization(config, ours, theirs, dir);
  ModelOptions o = fine_tune_options(config, ours, h);
  const int64_t lora_r = o.lora_r;
  o.lora_r = 0;  // LoRA is enabled block by block as the weights are loaded
  const auto map = vocabulary_map(ours, theirs, dir);
  HfLoader loader(h, o, o.arch == Arch::kBert ? "bert" : "gpt", map, ours);  // (root_name())
  torch::manual_seed(static_cast<uint64_t>(config.training.seed));
  // Note [Lazy Hugging Face import]: each tensor read as it is copied in.
  TransformerLM model =
      build_filled(o, lora_r, qlora_base_format(config, lora_r), context.blocks,
                   [&](const std::string& name, const Tensor& p) { loader.load(name, p); });
  loader.log();
  return model;
}

}  // namespace dnallm::models