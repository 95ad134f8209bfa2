#include "worker/models/family_io.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/hf_directory.hpp"
#include "worker/models/quantized_weight.hpp"
#include "worker/models/torch_safetensors.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models {
namespace {

// The CharacterTokenizer's special tokens, in id order (Note [Character vocabularies]).
const char* const kTheirSpecials[] = {"[CLS]", "[SEP]",      "[BOS]", "[MASK]",
                                      "[PAD]", "[RESERVED]", "[UNK]"};
constexpr int64_t kTheirFirstCharacter = 7;
const char* const kTheirCharacters[] = {"A", "C", "G", "T", "N"};

}  // namespace

std::vector<int64_t> character_vocabulary_map(const data::Tokenizer& ours, const std::string& dir,
                                              int64_t their_vocab, const std::string& family) {
  DNALLM_CHECK(ours.tokenizer_kind() == cfg::TokenizerKind::kChar, ExitCode::kUsage,
               "model.init_from = \"{}\": {} reads one token a base; set tokenizer.kind = "
               "\"char\" (here \"{}\")",
               dir, family, ours.kind());
  std::map<std::string, int64_t> theirs;
  for (int64_t i = 0; i < int64_t(std::size(kTheirSpecials)); ++i) theirs[kTheirSpecials[i]] = i;
  for (int64_t i = 0; i < int64_t(std::size(kTheirCharacters)); ++i) {
    theirs[kTheirCharacters[i]] = kTheirFirstCharacter + i;
  }
  // A tokenizer_config.json that numbers its special tokens otherwise is another layout.
  const std::string config_path = dir + "/tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::is_regular_file(std::filesystem::symlink_status(config_path, ec))) {
    const auto c = read_directory_json(config_path, "a tokenizer directory");
    if (c.contains("added_tokens_decoder") && c["added_tokens_decoder"].is_object()) {
      for (const auto& [id, token] : c["added_tokens_decoder"].items()) {
        const auto content =
            token.is_object() ? token.value("content", std::string()) : std::string();
        const auto it = theirs.find(content);
        DNALLM_CHECK(it != theirs.end() && std::to_string(it->second) == id, ExitCode::kUsage,
                     "{}: token {} = {} is not {}'s character layout ([CLS] 0 [SEP] 1 [BOS] 2 "
                     "[MASK] 3 [PAD] 4 [RESERVED] 5 [UNK] 6, then A C G T N)",
                     config_path, clip_for_message(id), clip_for_message(content), family);
      }
    }
  }
  std::vector<int64_t> map(static_cast<size_t>(ours.vocab_size()), -1);
  const std::map<int64_t, std::string> roles = {{data::kPadId, "[PAD]"},
                                                {data::kUnkId, "[UNK]"},
                                                {data::kClsId, "[CLS]"},
                                                {data::kSepId, "[SEP]"},
                                                {data::kMaskId, "[MASK]"}};
  for (int64_t id = 0; id < ours.vocab_size(); ++id) {
    const auto role = roles.find(id);
    const std::string piece = role != roles.end() ? role->second : ours.id_to_piece(id);
    const auto it = theirs.find(piece);
    DNALLM_CHECK(it != theirs.end(), ExitCode::kUsage,
                 "model.init_from = \"{}\": our token \"{}\" has no row in {}'s vocabulary "
                 "(A C G T N and its special tokens)",
                 dir, clip_for_message(piece), family);
    DNALLM_CHECK(it->second < their_vocab, ExitCode::kUsage,
                 "{}: vocab_size {} has no row for {} (id {})", dir, their_vocab, piece,
                 it->second);
    map[static_cast<size_t>(id)] = it->second;
  }
  return map;
}

torch::Tensor gather_rows(const torch::Tensor& theirs, const std::vector<int64_t>& map,
                          const torch::Tensor& fresh) {
  torch::NoGradGuard no_grad;
  auto out = fresh.detach().clone();
  for (size_t i = 0; i < map.size(); ++i) {
    if (map[i] >= 0) out[static_cast<int64_t>(i)].copy_(theirs[map[i]]);
  }
  return out;
}

void scatter_rows(torch::Tensor& theirs, const torch::Tensor& ours, const std::vector<int64_t>& map,
                  const torch::Tensor& source) {
  torch::NoGradGuard no_grad;
  if (source.defined()) theirs.copy_(source);
  for (size_t i = 0; i < map.size(); ++i) {
    if (map[i] >= 0) theirs[map[i]].copy_(ours[static_cast<int64_t>(i)]);
  }
}

int64_t copy_matching_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  std::map<std::string, torch::Tensor> source;
  for (const auto& p : from.named_parameters()) source.emplace(p.key(), p.value());
  torch::NoGradGuard no_grad;
  int64_t copied = 0;
  for (auto& p : to.named_parameters()) {
    auto it = source.find(p.key());
    if (it == source.end() || it->second.sizes() != p.value().sizes()) continue;
    p.value().copy_(it->second);
    ++copied;
  }
  return copied;
}

void copy_tokenizer_files(const std::string& from, const std::string& dir) {
  namespace fs = std::filesystem;
  if (from.empty()) return;
  for (const char* name : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const fs::path source = fs::path(from) / name;
    std::error_code ec;
    if (!fs::is_regular_file(fs::symlink_status(source, ec))) continue;
    checkpoint::write_file_durable(fs::path(dir) / name,
                                   read_bounded_file(source.string(), kMaxConfigFileBytes,
                                                     ExitCode::kUsage, "tokenizer file"));
  }
}

void load_named_tensors(const std::vector<std::pair<std::string, torch::Tensor>>& targets,
                        const std::string& dir,
                        const std::function<bool(const std::string&)>& derived) {
  const std::string path = dir + "/model.safetensors";
  auto weights = load_safetensors(path);
  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  for (const auto& [name, t] : targets) {
    auto it = weights.find(name);
    if (it == weights.end() && derived && derived(name)) continue;
    DNALLM_CHECK(it != weights.end(), ExitCode::kBadData, "{} lacks tensor {}", path, name);
    DNALLM_CHECK(it->second.sizes() == t.sizes(), ExitCode::kBadData,
                 "{}: {} has shape {} but config.json implies {}", path, name,
                 fmt::format("{}", fmt::join(it->second.sizes(), "x")),
                 fmt::format("{}", fmt::join(t.sizes(), "x")));
    auto& target = const_cast<torch::Tensor&>(t);
    target.copy_(it->second);
    used.insert(name);
  }
  for (const auto& [name, t] : weights) {
    DNALLM_CHECK(used.count(name) != 0, ExitCode::kBadData,
                 "{}: tensor {} is not part of the model config.json describes", path,
                 clip_for_message(name));
  }
}

LoraOptions family_lora_options(const Config& config, const std::vector<std::string>& all,
                                const std::string& family) {
  const auto& l = config.lora;
  DNALLM_CHECK(l.quantize_base == cfg::QuantizeBase::kNone, ExitCode::kUsage,
               "lora.quantize_base = \"{}\": {} keeps its frozen base in full precision (QLoRA is "
               "the transformer family's): set lora.quantize_base = \"none\"",
               cfg::spelling(l.quantize_base), family);
  LoraOptions o;
  if (l.r == 0) return o;
  o.r = l.r;
  o.alpha = l.alpha;
  o.dropout = l.dropout;
  const std::vector<std::string> transformer_default = LoraConfig().target_modules;
  if (l.target_modules == transformer_default) {
    o.targets = all;
    return o;
  }
  for (const auto& t : l.target_modules) {
    DNALLM_CHECK(std::find(all.begin(), all.end(), t) != all.end(), ExitCode::kUsage,
                 "lora.target_modules has \"{}\", which is not a {} linear: use some of {}",
                 clip_for_message(t), family, fmt::format("\"{}\"", fmt::join(all, "\", \"")));
    if (std::find(o.targets.begin(), o.targets.end(), t) == o.targets.end()) o.targets.push_back(t);
  }
  DNALLM_CHECK(!o.targets.empty(), ExitCode::kUsage,
               "lora.target_modules is empty: name some of the {} linears ({})", family,
               fmt::format("{}", fmt::join(all, ", ")));
  return o;
}

ParameterUnits whole_model_units() {
  return [](const auto& visit) { visit([](const torch::Tensor&) { return true; }); };
}

namespace {

// The file's type of a tensor that reads `t`: floating point in fp32 (the master values under
// bf16 gathers, whatever the parameter holds between steps), integers as they are.
DType exported_dtype(const torch::Tensor& t) {
  if (t.is_floating_point()) return DType::kFloat32;
  const auto d = dtype_of(t.scalar_type());
  DNALLM_CHECK(d.has_value(), ExitCode::kFailure, "export: unsupported dtype {}",
               c10::toString(t.scalar_type()));
  return *d;
}

torch::Tensor on_host(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kCPU);
  if (c.is_floating_point()) c = c.to(torch::kFloat32);
  return c.contiguous();
}

}  // namespace

ExportedTensor live_tensor(const std::string& name, const torch::Tensor& t) {
  return {name, t.sizes().vec(), exported_dtype(t), {t}, [t] { return on_host(t); }};
}

ExportedTensor computed_tensor(const std::string& name, std::vector<int64_t> shape,
                               std::function<torch::Tensor()> make) {
  return {name, std::move(shape), DType::kFloat32, {}, [make = std::move(make)] {
            return on_host(make());
          }};
}

ExportedTensor renamed_tensor(const ExportedTensor& from, const std::string& name) {
  ExportedTensor t = from;
  t.name = name;
  return t;
}

ExportedTensor combined_tensor(
    const std::string& name, std::vector<int64_t> shape, const std::vector<ExportedTensor>& inputs,
    std::function<torch::Tensor(const std::vector<torch::Tensor>&)> combine) {
  ExportedTensor out{name, std::move(shape), DType::kFloat32, {}, nullptr};
  std::vector<std::function<torch::Tensor()>> values;
  for (const auto& in : inputs) {
    out.reads.insert(out.reads.end(), in.reads.begin(), in.reads.end());
    values.push_back(in.value);
  }
  out.value = [values = std::move(values), combine = std::move(combine)] {
    std::vector<torch::Tensor> v;
    for (const auto& f : values) v.push_back(f());
    return on_host(combine(v));
  };
  return out;
}

LiveWeights::LiveWeights(torch::nn::Module& module, bool merge_adapters) : merge_(merge_adapters) {
  for (const auto& [name, linear] : lora_or_quantized_linears(module)) {
    linears_[linear->weight.unsafeGetTensorImpl()] = linear;
  }
}

ExportedTensor LiveWeights::operator()(const std::string& name, const torch::Tensor& t) const {
  const auto it = linears_.find(t.unsafeGetTensorImpl());
  if (it == linears_.end()) return live_tensor(name, t);
  const auto linear = it->second;
  std::vector<torch::Tensor> reads = linear->parameters();
  for (const auto& b : linear->buffers()) reads.push_back(b);
  // A quantized base's shape is its dequantized weight's, read without dequantising: under
  // ZeRO-3 its codes are sharded with its block (Note [Fully sharded quantized base]) and held
  // only while the weight is.
  const auto shape =
      linear->quantized() ? linear->quantized()->shape() : linear->weight.sizes().vec();
  const bool merge = merge_;
  return {name, shape, DType::kFloat32, std::move(reads),
          [linear, merge] { return on_host(full_linear_weight(*linear, merge)); }};
}

WeightReader vocabulary_scatter(WeightReader weight, std::vector<int64_t> map,
                                const torch::Tensor& embedding,
                                const torch::Tensor& source_embedding, const torch::Tensor& head,
                                const torch::Tensor& source_head) {
  return [=](const std::string& name, const torch::Tensor& t) {
    const void* impl = t.unsafeGetTensorImpl();
    const bool is_embedding = impl == embedding.unsafeGetTensorImpl();
    const bool is_head = head.defined() && impl == head.unsafeGetTensorImpl();
    if (!is_embedding && !is_head) return weight(name, t);
    const torch::Tensor source = is_embedding ? source_embedding : source_head;
    // (a head the checkpoint did not have as ours: its rows are the embedding's shape)
    const auto shape = (source.defined() ? source : source_embedding).sizes().vec();
    return combined_tensor(name, shape, {weight(name, t)},
                           [map, source, shape](const std::vector<torch::Tensor>& v) {
                             torch::Tensor theirs = torch::zeros(shape);
                             scatter_rows(theirs, v[0], map, source);
                             return theirs;
                           });
  };
}

namespace {

// One file of write_exported_files(): each tensor written once what it reads is held.
class StreamedFile {
 public:
  StreamedFile(const std::filesystem::path& path, const ExportedFile& file)
      : tensors_(file.tensors), done_(tensors_.size(), false) {
    std::vector<checkpoint::TensorSpec> specs;
    for (const auto& t : tensors_) specs.push_back({t.name, t.dtype, t.shape});
    writer_.emplace(path, std::move(specs), file.metadata);
  }
  void write_held(const HeldTensor& held) {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (done_[i]) continue;
      const auto& t = tensors_[i];
      if (!std::all_of(t.reads.begin(), t.reads.end(), held)) continue;
      const auto value = t.value();
      DNALLM_CHECK(value.sizes().vec() == t.shape && dtype_of(value.scalar_type()) == t.dtype,
                   ExitCode::kFailure,
                   "internal: the export computed {} as {} {}, its header says {} {}", t.name,
                   c10::toString(value.scalar_type()),
                   fmt::format("{}", fmt::join(value.sizes(), "x")), dtype_name(t.dtype),
                   fmt::format("{}", fmt::join(t.shape, "x")));
      writer_->write(i, safetensors_tensor(t.name, value).write_data);
      done_[i] = true;
    }
  }
  void commit() { writer_->commit(); }  // Error(kFailure) naming a tensor never written

 private:
  std::vector<ExportedTensor> tensors_;
  std::vector<bool> done_;
  std::optional<checkpoint::SafetensorsWriter> writer_;
};

}  // namespace

void write_exported_files(const std::string& dir, const std::vector<ExportedFile>& files,
                          const ParameterUnits& units, bool write) {
  torch::NoGradGuard no_grad;
  if (!write) {  // a rank that only takes part in the gathers
    units([](const HeldTensor&) {});
    return;
  }
  namespace fs = std::filesystem;
  std::vector<std::unique_ptr<StreamedFile>> streamed;
  for (const auto& f : files) {
    const fs::path path = fs::path(dir) / f.path;
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    DNALLM_CHECK(!ec, ExitCode::kFailure, "cannot create the directory {}: {}",
                 path.parent_path().string(), ec.message());
    streamed.push_back(std::make_unique<StreamedFile>(path, f));
  }
  units([&](const HeldTensor& held) {
    for (auto& s : streamed) s->write_held(held);
  });
  for (auto& s : streamed) s->commit();
}

HfExport hub_layout_export(std::vector<ExportedTensor> tensors, nlohmann::json config,
                           const std::string& source_dir, const std::string& family) {
  HfExport plan;
  plan.files.push_back({"model.safetensors", std::move(tensors), {{"format", "pt"}}});
  plan.finish = [config = std::move(config), source_dir, family](const std::string& dir) {
    checkpoint::write_json_durable(std::filesystem::path(dir) / "config.json", config);
    copy_tokenizer_files(source_dir, dir);
    spdlog::info("exported a {} model in the hub's layout to {}", family, dir);
  };
  return plan;
}

}  // namespace dnallm::models
