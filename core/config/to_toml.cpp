// A Config as TOML: to_toml(), the model hash, the defaults.
#include <algorithm>

#include <fmt/format.h>
#include <xxhash.h>

#include "core/config/schema.hpp"
#include "core/error.hpp"

namespace dnallm::config_detail {
namespace {

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<int>(ch));
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

std::string toml_double(double v) {
  // Shortest text that reads back to the same double, always with a '.' or exponent.
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

std::string value_text(Config& c, const KeyDesc& k) {
  void* f = k.ptr(c);
  switch (k.kind) {
    case Kind::kInt:
      return fmt::format("{}", *static_cast<int64_t*>(f));
    case Kind::kDouble:
      return toml_double(*static_cast<double*>(f));
    case Kind::kBool:
      return *static_cast<bool*>(f) ? "true" : "false";
    case Kind::kString:
      return toml_string(k.get_text ? k.get_text(c) : *static_cast<std::string*>(f));
    case Kind::kStringList: {
      std::vector<std::string> parts;
      for (const auto& s : *static_cast<std::vector<std::string>*>(f))
        parts.push_back(toml_string(s));
      return "[" + fmt::format("{}", fmt::join(parts, ", ")) + "]";
    }
    case Kind::kNumberList: {
      std::vector<std::string> parts;
      for (double v : *static_cast<std::vector<double>*>(f)) parts.push_back(toml_double(v));
      return "[" + fmt::format("{}", fmt::join(parts, ", ")) + "]";
    }
    case Kind::kStageList: {
      std::vector<std::string> parts;
      for (const auto& st : *static_cast<std::vector<SeqLenStage>*>(f))
        parts.push_back(fmt::format("{{steps = {}, seq_len = {}}}", st.steps, st.seq_len));
      return "[" + fmt::format("{}", fmt::join(parts, ", ")) + "]";
    }
  }
  return "";
}

}  // namespace dnallm::config_detail

namespace dnallm {

using namespace config_detail;  // NOLINT: the schema's internals

namespace {

// `omit_at_default`: keys left out while they hold their default value (see
// model_config_hash).
std::string sections_toml(const Config& config, const std::vector<std::string>& only,
                          const std::vector<std::string>& omit_at_default = {}) {
  Config c = config;  // value_text needs a mutable Config for the field accessors
  Config defaults;
  std::string out;
  std::string current;
  for (const auto& k : schema()) {
    if (!only.empty() && std::find(only.begin(), only.end(), k.section) == only.end()) continue;
    if (std::find(omit_at_default.begin(), omit_at_default.end(), k.full()) !=
            omit_at_default.end() &&
        value_text(c, k) == value_text(defaults, k))
      continue;
    if (current != k.section) {
      if (!current.empty()) out += "\n";
      out += fmt::format("[{}]\n", k.section);
      current = k.section;
    }
    out += fmt::format("{} = {}\n", k.name, value_text(c, k));
  }
  return out;
}

}  // namespace

std::string to_toml(const Config& config) { return sections_toml(config, {}); }

uint64_t model_config_hash(const Config& config) {
  // Note [Model hash across releases]: checkpoints store this hash and resume refuses another
  // one, so a [model]/[lora]/[tokenizer] key added after checkpoints exist joins the hash only
  // when it is set to something other than its default; list such keys here.
  static const std::vector<std::string> kAddedLater = {
      "lora.quantize_base",    "model.kv_heads",        "model.mlp",
      "model.post_layer_norm", "model.chunk_positions", "model.chunk_channels"};
  std::string text = sections_toml(config, {"model", "lora", "tokenizer"}, kAddedLater);
  return XXH64(text.data(), text.size(), 0);
}

std::vector<std::string> config_keys() {
  std::vector<std::string> out;
  for (const auto& k : schema()) out.push_back(k.full());
  return out;
}

bool operator==(const Config& a, const Config& b) { return to_toml(a) == to_toml(b); }

std::string config_default(const std::string& key) {
  Config defaults;
  for (const auto& k : schema()) {
    if (k.full() == key) return value_text(defaults, k);
  }
  fail(ExitCode::kFailure, "config_default: no key '{}'", key);
}

}  // namespace dnallm
