#include "worker/models/transformer/hf_import.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <set>

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/models/block_hooks.hpp"
#include "worker/models/hf_directory.hpp"
#include "worker/models/torch_pickle.hpp"
#include "worker/models/transformer/hf_import_detail.hpp"
#include "worker/models/transformer/hf_names.hpp"

namespace dnallm::models {

using nlohmann::json;
using torch::Tensor;
using namespace detail;  // hf_import_detail.hpp

namespace detail {

// HF parameter name -> ours: old LayerNorm spellings (gamma, beta) first, then the family's
// table read backwards (hf_names.hpp; hf_export.cpp reads it forwards).
std::string rename(const std::string& model_type, std::string name) {
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends(".gamma")) name.replace(name.size() - 6, 6, ".weight");
  if (ends(".beta")) name.replace(name.size() - 5, 5, ".bias");
  return hf_names::translate(name, hf_names::rules(model_type), /*to_theirs=*/false);
}

std::string shape_text(const Shape& s) { return fmt::format("{}", fmt::join(s, "x")); }

// Row block `part` of `parts` of the file's `hf_name` (dimension 0) as our `ours`.
void add_row_block(HfCheckpoint& h, const std::string& ours, const std::string& hf_name,
                   const Shape& shape, int64_t part, int64_t parts) {
  Shape mine = shape;
  mine[0] /= parts;
  h.tensors[ours] = HfTensorSource{hf_name, part, parts, false, mine};
}

}  // namespace detail

namespace {

// At most `n` names of `names`, then how many more: a bounded message.
std::string some_names(const std::vector<std::string>& names, size_t n = 10) {
  std::vector<std::string> head;
  for (size_t i = 0; i < names.size() && i < n; ++i) head.push_back(clip_for_message(names[i]));
  std::string out = fmt::format("{}", fmt::join(head, ", "));
  if (names.size() > n) out += fmt::format(" and {} more", names.size() - n);
  return out;
}

// Buffers that hold nothing to load: the rotary table we compute (base 10000, checked where
// stored as rotary_embeddings.inv_freq) and gpt_neox's old causal-mask buffers.
bool is_computed_buffer(const std::string& model_type, const std::string& hf_name) {
  if (hf_name.find("rotary_emb.inv_freq") != std::string::npos) return true;
  return model_type == "gpt_neox" && (hf_name.find(".attention.bias") != std::string::npos ||
                                      hf_name.find(".attention.masked_bias") != std::string::npos);
}

// Note [pytorch_model.bin]: DNABERT-2's hub repository ships only a torch.save pickle of its
// state dict, read by our state-dict unpickler (torch_pickle.hpp, which builds tensors and
// containers and nothing else); read for DNABERT-2 directories only, when they hold no
// model.safetensors. Weights that are NaN or infinite are a damaged file, as in safetensors.
std::map<std::string, Tensor> load_weights(const std::string& path) {
  const bool pickle = path.size() > 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
  if (!pickle) return load_safetensors(path);
  auto weights = load_torch_state_dict(path);
  for (const auto& [name, t] : weights) {
    DNALLM_CHECK(!t.is_floating_point() || t.numel() == 0 || torch::isfinite(t).all().item<bool>(),
                 ExitCode::kCheckpointCorrupt,
                 "{}: tensor {} holds NaN or infinite values: the file is damaged; re-download it",
                 path, clip_for_message(name));
  }
  return weights;
}

}  // namespace

// Note [Lazy Hugging Face import]: the file's header (names, shapes) at once, a tensor's data
// when it is read; the last tensor read is kept, so a fused tensor's parts cost one read.
class HfWeightsFile {
 public:
  explicit HfWeightsFile(const std::string& path) : path_(path) {
    if (path.size() > 4 && path.compare(path.size() - 4, 4, ".bin") == 0) {
      pickled_ = load_weights(path);  // Note [pytorch_model.bin]: whole, checked
      for (const auto& [name, t] : pickled_) shapes_.emplace(name, t.sizes().vec());
      return;
    }
    reader_.emplace(path);  // the header checked (Note [Untrusted files])
    for (const auto& [name, e] : reader_->file().tensors) {
      shapes_.emplace(name, Shape(e.spec.shape.begin(), e.spec.shape.end()));
    }
  }
  const std::string& path() const { return path_; }
  const std::map<std::string, Shape>& shapes() const { return shapes_; }

  // The file's tensor `name` as fp32 (NaN or infinite: exit 5).
  Tensor read(const std::string& name) {
    if (name == last_name_) return last_;
    Tensor t;
    if (reader_) {
      const auto& tensors = reader_->file().tensors;
      auto it = tensors.find(name);
      DNALLM_CHECK(it != tensors.end(), ExitCode::kFailure, "{}: no tensor {}", path_, name);
      t = read_finite_tensor(*reader_, it->second, path_, name);
    } else {
      t = pickled_.at(name).to(torch::kFloat32);
    }
    last_name_ = name;
    last_ = t;
    return t;
  }

 private:
  std::string path_;
  std::optional<checkpoint::SafetensorsReader> reader_;
  std::map<std::string, Tensor> pickled_;
  std::map<std::string, Shape> shapes_;
  std::string last_name_;
  Tensor last_;
};

Tensor HfCheckpoint::read(const std::string& name) const {
  auto it = tensors.find(name);
  DNALLM_CHECK(it != tensors.end(), ExitCode::kFailure, "{}: no tensor {} (our name)", dir, name);
  const HfTensorSource& s = it->second;
  Tensor t = file->read(s.name);
  if (s.per_head_qkv) {  // [head][q|k|v][head_dim](, hidden)
    const int64_t heads = options.heads, hd = options.hidden / options.heads;
    t = (t.dim() == 2 ? t.view({heads, 3, hd, t.size(1)}) : t.view({heads, 3, hd}))
            .select(1, s.part)
            .reshape(s.shape);
  } else if (s.parts > 1) {
    t = t.chunk(s.parts, 0)[size_t(s.part)];
  }
  t = t.contiguous();
  return t;
}

namespace {

// Note [Token-type table]: BERT and RoBERTa-PreLayerNorm add row 0 of their token-type table to
// every token (a DNA sequence is one segment). The table stays a parameter of ours
// (type_vocab_size rows, ModelOptions), as in transformers, instead of being folded into the
// learned positions: the forward pass is the same either way, but fine-tuning is not. Folded,
// the row got no gradient of its own (the sum over positions), no weight decay and no Adam
// state, so every step after the first differed from the Hugging Face Trainer's
// (tests/hf/check_finetune_parity.py found it: grad norm 0.1498 against 0.1567 at step 1).
//
// Every tensor of the weights file mapped onto our names (Note [Lazy Hugging Face import]);
// other tasks' tensors are logged and skipped.
void map_tensors(const std::string& weights_path, HfCheckpoint& h) {
  std::vector<std::string> skipped;
  const bool nt_v2 = h.model_type == "esm" && h.options.gated_mlp;  // Note [Remote code]
  for (const auto& [hf_name, t] : h.file->shapes()) {
    if (hf_name.rfind("esm.contact_head.", 0) == 0) {  // contact prediction: another task
      skipped.push_back(hf_name);
    } else if (nt_v2 && h.options.rotary &&
               hf_name == "esm.embeddings.position_embeddings.weight") {
      skipped.push_back(hf_name);  // built by the remote EsmEmbeddings, read only when absolute
    } else if (nt_v2 && hf_name.find(".intermediate.dense.") != std::string::npos) {
      split_gated_dense(weights_path, hf_name, t, h);
    } else if (hf_name.find("rotary_embeddings.inv_freq") != std::string::npos) {
      check_rotary_table(weights_path, hf_name, h.file->read(hf_name), h.options);
    } else if (h.model_type == "dnabert2" && split_dnabert2_fused(weights_path, hf_name, t, h)) {
      // (Note [DNABERT-2 import]: its token-type table is a parameter of ours, below)
    } else if (hf_name.find("token_type_embeddings") != std::string::npos &&
               h.model_type != "dnabert2") {
      // Note [Token-type table]: a parameter of ours, as in transformers.
      DNALLM_CHECK(t.size() == 2 && t[0] >= 1 && t[1] == h.options.hidden, ExitCode::kUsage,
                   "{}: {} has shape {} but config.json implies rows of {}", weights_path, hf_name,
                   shape_text(t), h.options.hidden);
      h.options.type_vocab_size = t[0];
      h.tensors[rename(h.model_type, hf_name)] = HfTensorSource{hf_name, 0, 1, false, t};
    } else if (h.model_type == "gpt_neox" &&
               hf_name.find(".attention.query_key_value.") != std::string::npos) {
      split_fused_qkv(weights_path, hf_name, t, h);
    } else if (!is_computed_buffer(h.model_type, hf_name)) {
      h.tensors[rename(h.model_type, hf_name)] = HfTensorSource{hf_name, 0, 1, false, t};
    }
  }
  if (!skipped.empty()) {
    spdlog::info("{}: not part of the {} model, not loaded: {}", weights_path, h.architecture,
                 fmt::join(skipped, ", "));
  }
}

// Drops stored copies of tied tensors. (The root's tensors are read here: a few rows of the
// vocabulary's size.)
void untie(const std::string& weights_path, HfCheckpoint& h) {
  // Tied decoders: a stored copy must equal the embedding it is tied to.
  for (const char* tied : {"cls.predictions.decoder.weight", "lm_head.weight"}) {
    auto it = h.tensors.find(tied);
    if (it == h.tensors.end() || !h.options.tie_embeddings) continue;
    const std::string emb = h.options.arch == Arch::kBert ? "bert.embeddings.word_embeddings.weight"
                                                          : "gpt.embeddings.word_embeddings.weight";
    DNALLM_CHECK(h.tensors.count(emb) && h.tensors.at(emb).shape == it->second.shape &&
                     torch::equal(h.read(emb), h.read(tied)),
                 ExitCode::kUsage,
                 "{}: {} differs from the word embeddings although tie_word_embeddings is true",
                 weights_path, tied);
    h.tensors.erase(it);
  }
  if (auto it = h.tensors.find("cls.predictions.decoder.bias"); it != h.tensors.end()) {
    DNALLM_CHECK(h.tensors.count("cls.predictions.bias") &&
                     h.tensors.at("cls.predictions.bias").shape == it->second.shape &&
                     torch::equal(h.read("cls.predictions.bias"), h.read(it->first)),
                 ExitCode::kUsage, "{}: lm_head.decoder.bias differs from lm_head.bias",
                 weights_path);
    h.tensors.erase(it);
  }
}

// Records the names and shapes of the blocks a model builds (and nothing else).
class ShapeSink final : public BlockSink {
 public:
  void block_built(size_t, const std::string& path, torch::nn::Module& block) override {
    path_ = path;
    for (const auto& p : block.named_parameters())
      shapes_.emplace_back(p.key(), p.value().sizes().vec());
  }
  std::string path_;
  std::vector<std::pair<std::string, Shape>> shapes_;
};

// Every name and shape of the model `o` describes, from a one-layer model: the root's, and
// the one block's repeated under each layer's prefix (ours end "<index>.").
std::map<std::string, Shape> model_shapes(const ModelOptions& o) {
  ModelOptions one = o;
  one.layers = std::min<int64_t>(o.layers, 1);
  ShapeSink sink;
  TransformerLM probe(nullptr);
  {
    StreamedBuild streamed(&sink);
    probe = TransformerLM(one);
  }
  std::map<std::string, Shape> out;
  for (auto& [name, p] : probe->named_weights()) {
    if (sink.path_.empty() || name.rfind(sink.path_, 0) != 0) out.emplace(name, p.sizes().vec());
  }
  if (o.layers == 0) return out;
  DNALLM_CHECK(sink.path_.size() > 2 && sink.path_.compare(sink.path_.size() - 2, 2, "0.") == 0,
               ExitCode::kFailure, "block prefix {} does not end with its index", sink.path_);
  const std::string stem = sink.path_.substr(0, sink.path_.size() - 2);
  for (int64_t i = 0; i < o.layers; ++i) {
    for (const auto& [name, shape] : sink.shapes_) {
      out.emplace(stem + std::to_string(i) + "." + name, shape);
    }
  }
  return out;
}

// Every mapped tensor must be a parameter of the model, with its shape, and every parameter
// must be there.
void check_against_model(const std::string& weights_path, const HfCheckpoint& h) {
  const std::map<std::string, Shape> ours = model_shapes(h.options);
  std::vector<std::string> unused;
  for (const auto& [name, t] : h.tensors) {
    auto it = ours.find(name);
    if (it == ours.end()) {
      unused.push_back(name);
      continue;
    }
    DNALLM_CHECK(it->second == t.shape, ExitCode::kUsage,
                 "{}: {} has shape {} but config.json implies {}", weights_path, name,
                 shape_text(t.shape), shape_text(it->second));
  }
  DNALLM_CHECK(unused.empty(), ExitCode::kUsage,
               "{}: tensors not used by the {} import (the model they belong to computes "
               "something this import does not): {} (our names); {}",
               weights_path, h.architecture, some_names(unused), kSupported);
  std::vector<std::string> missing;
  for (const auto& [name, p] : ours) {
    if (!h.tensors.count(name)) missing.push_back(name);
  }
  DNALLM_CHECK(missing.empty(), ExitCode::kUsage,
               "{}: {} needs tensors the file lacks: {} (our names)", weights_path, h.architecture,
               some_names(missing));
}

}  // namespace

bool is_transformer_hf_config(const json& c) {
  if (nt_v2_remote_code(c)) return true;
  const auto type = c.value("model_type", std::string());
  return type == "bert" || type == "esm" || type == "roberta-prelayernorm" || type == "gpt_neox" ||
         type == "llama";
}

bool is_hf_model_dir(const std::string& dir) {
  try {  // (a file that cannot be read is reported by whoever reads it next)
    const auto c = json::parse(
        read_bounded_file(dir + "/config.json", kMaxConfigFileBytes, ExitCode::kUsage, "config"));
    return c.is_object() && (c.contains("model_type") || nt_v2_remote_code(c)) &&
           !c.contains("dnallm_arch");
  } catch (const std::exception&) {
    return false;
  }
}

HfCheckpoint read_hf_checkpoint(const std::string& dir) {
  const std::string path = dir + "/config.json";
  const json c = read_directory_json(
      path, "a Hugging Face model directory holds config.json and model.safetensors");
  HfCheckpoint h;
  h.dir = dir;
  try {
    read_model_class(c, path, h);
    check_config(c, path, h.model_type);
    set_arch_and_task(c, path, h, h.options);
    set_common_options(c, path, h.options);
    set_model_type_options(c, path, h.model_type, h.options);
  } catch (const json::exception& e) {  // a value of the wrong JSON type
    fail(ExitCode::kUsage, "{}: a value has the wrong type ({}): repair or re-download the file",
         path, clip_for_message(e.what(), 200));
  }
  check_model_shape(h.options, path);  // Note [Model shape limits], before any allocation

  std::string weights_path = dir + "/model.safetensors";
  std::error_code ec;
  if (h.model_type == "dnabert2" && !std::filesystem::exists(weights_path, ec) &&
      std::filesystem::exists(dir + "/pytorch_model.bin", ec)) {
    weights_path = dir + "/pytorch_model.bin";  // Note [pytorch_model.bin]
  }
  DNALLM_CHECK(
      std::filesystem::symlink_status(weights_path, ec).type() !=
          std::filesystem::file_type::not_found,
      ExitCode::kUsage,
      "{} not found{}: save the model with safe_serialization (model.safetensors); "
      "sharded and .bin checkpoints are not read",
      weights_path,
      std::filesystem::exists(dir + "/pytorch_model.bin", ec) ? " (pytorch_model.bin is)" : "");
  h.file = std::make_shared<HfWeightsFile>(weights_path);
  map_tensors(weights_path, h);
  untie(weights_path, h);
  check_against_model(weights_path, h);
  return h;
}

TransformerLM build_hf_model(const HfCheckpoint& h) {
  TransformerLM model(h.options);
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : model->named_weights()) p.copy_(h.read(name));
  model->eval();
  return model;
}

}  // namespace dnallm::models
