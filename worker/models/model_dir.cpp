#include "worker/models/model_dir.hpp"

#include <filesystem>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/hf_directory.hpp"

namespace dnallm::models {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSupported =
    "a directory written by dnallm-train (final/, best/, dnallm-ckpt export: config.json with "
    "\"dnallm_arch\" and tokenizer.json), a Hugging Face model directory as downloaded "
    "(config.json of BERT/DNABERT-1, DNABERT-2, ESM/Nucleotide Transformer v1/v2, "
    "RoBERTa-PreLayerNorm, GPT-NeoX, Llama, HyenaDNA or Caduceus, with its weights), or a PEFT "
    "adapter directory (adapter_config.json) on such a base";

bool present(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() != fs::file_type::not_found;
}

// The base a PEFT adapter names, when it is a directory here: as written, then beside the
// adapter (a relative path saved from another working directory).
std::string named_base(const std::string& adapter_dir, const nlohmann::json& adapter_config) {
  if (!adapter_config.contains("base_model_name_or_path") ||
      !adapter_config["base_model_name_or_path"].is_string()) {
    return "";
  }
  const auto named = adapter_config["base_model_name_or_path"].get<std::string>();
  if (named.empty()) return "";
  std::error_code ec;
  for (const fs::path& p : {fs::path(named), fs::path(adapter_dir) / named,
                            fs::path(adapter_dir).parent_path() / named}) {
    if (fs::is_regular_file(p / "config.json", ec)) return p.string();
  }
  return "";
}

}  // namespace

std::string ModelDirectory::describe() const {
  switch (layout) {
    case DirLayout::kOurs:
      return fmt::format("{} (a directory of ours)", dir);
    case DirLayout::kHub:
      return fmt::format("{} (a Hugging Face {} directory)", dir, family->name);
    case DirLayout::kPeftAdapter:
      return fmt::format("{} (a PEFT adapter on the Hugging Face {} directory {})", dir,
                         family->name, base_dir);
  }
  return dir;
}

ModelDirectory identify_model_dir(const std::string& dir, const std::string& base_dir) {
  std::error_code ec;
  DNALLM_CHECK(fs::is_directory(dir, ec), ExitCode::kUsage,
               "--model {}: {}; give a model directory: {}", dir,
               present(dir) ? "not a directory" : "no such directory", kSupported);
  ModelDirectory d;
  d.dir = dir;
  const fs::path config_path = fs::path(dir) / "config.json";
  const fs::path adapter_path = fs::path(dir) / "adapter_config.json";
  if (present(config_path)) {
    const auto c = read_directory_json(config_path.string(), "a model directory holds config.json");
    if (c.contains("dnallm_arch")) {
      d.layout = DirLayout::kOurs;
      return d;
    }
    if (!present(adapter_path)) {
      for (const auto& f : model_families()) {
        if (f.recognises_hf != nullptr && f.recognises_hf(c)) {
          d.layout = DirLayout::kHub;
          d.family = &f;
          return d;
        }
      }
      family_for_hf_config(c, config_path.string());  // exit 2 naming its model_type
    }
  }
  if (present(adapter_path)) {
    const auto a = read_directory_json(adapter_path.string(), "a PEFT adapter directory");
    d.layout = DirLayout::kPeftAdapter;
    d.base_dir = base_dir.empty() ? named_base(dir, a) : base_dir;
    DNALLM_CHECK(!d.base_dir.empty(), ExitCode::kUsage,
                 "{} is a PEFT adapter whose base_model_name_or_path ({}) is not a directory "
                 "here: give the base model's directory with --base DIR",
                 dir,
                 a.contains("base_model_name_or_path") ? a["base_model_name_or_path"].dump()
                                                       : std::string("absent"));
    const auto base = identify_model_dir(d.base_dir);
    DNALLM_CHECK(base.layout == DirLayout::kHub, ExitCode::kUsage,
                 "{}: a PEFT adapter applies to a Hugging Face base directory; {} is {}", dir,
                 d.base_dir, base.describe());
    d.family = base.family;
    return d;
  }
  fail(ExitCode::kUsage,
       "--model {}: holds neither config.json nor adapter_config.json, so it is no model "
       "directory: give {}",
       dir, kSupported);
}

LoadedModel load_model_dir(const std::string& dir, const std::string& base_dir,
                           const std::string& tokenizer_dir) {
  LoadedModel l;
  l.source = identify_model_dir(dir, base_dir);
  const auto& s = l.source;
  switch (s.layout) {
    case DirLayout::kOurs: {
      l.model = load_exported_model(dir);
      const std::string path = dir + "/tokenizer.json";
      DNALLM_CHECK(present(path), ExitCode::kBadData,
                   "{} is missing: a directory written by dnallm-train holds its tokenizer", path);
      auto tokenizer = data::load_tokenizer(path);
      DNALLM_CHECK(tokenizer->vocab_size() == l.model->spec().vocab_size, ExitCode::kBadData,
                   "{}: the tokenizer has {} tokens but the model {}: the files are from "
                   "different runs",
                   dir, tokenizer->vocab_size(), l.model->spec().vocab_size);
      DNALLM_CHECK(tokenizer_dir.empty(), ExitCode::kUsage,
                   "--tokenizer replaces a Hugging Face directory's tokenizer files; {} is {}", dir,
                   s.describe());
      l.codec = data::make_own_codec(std::move(tokenizer), l.model->spec().arch == Arch::kBert);
      break;
    }
    case DirLayout::kHub:
    case DirLayout::kPeftAdapter: {
      const auto& f = *s.family;
      const std::string model_dir = s.layout == DirLayout::kHub ? dir : s.base_dir;
      DNALLM_CHECK(f.load_hf != nullptr && f.hf_tokenizer != nullptr, ExitCode::kUsage,
                   "{}: the {} family cannot run a Hugging Face directory yet", dir, f.name);
      if (s.layout == DirLayout::kPeftAdapter) {
        DNALLM_CHECK(f.load_hf_with_adapter != nullptr, ExitCode::kUsage,
                     "{}: PEFT adapters on a {} base are not supported yet (the transformer "
                     "families' are): merge it in Python (merge_and_unload) and give the merged "
                     "directory",
                     dir, f.name);
        l.model = f.load_hf_with_adapter(model_dir, dir);
      } else {
        l.model = f.load_hf(model_dir);
      }
      std::string from = tokenizer_dir.empty() ? model_dir : tokenizer_dir;
      if (tokenizer_dir.empty() && s.layout == DirLayout::kPeftAdapter) {
        for (const char* file : {"tokenizer.json", "tokenizer_config.json", "vocab.txt"}) {
          if (present(fs::path(dir) / file)) from = dir;
        }
      }
      auto tokenizer = f.hf_tokenizer(from);
      DNALLM_CHECK(tokenizer->vocab_size() <= l.model->spec().vocab_size, ExitCode::kUsage,
                   "{}: the tokenizer has {} tokens but the model's vocab_size is {}: the "
                   "tokenizer files are from another model",
                   from, tokenizer->vocab_size(), l.model->spec().vocab_size);
      l.codec = data::make_hub_codec(std::move(tokenizer));
      break;
    }
  }
  l.model->eval();
  spdlog::info("model {}: tokenizer {}", s.describe(), l.codec->describe());
  return l;
}

}  // namespace dnallm::models
