// TOML files and --set overrides into a Config: every value read through its key's
// descriptor, so the message names the key, the file and line, and what is allowed.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/config/schema.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"

namespace dnallm {

using namespace config_detail;  // NOLINT: the schema's internals

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// The nearest valid key to `section.name` (canonical keys and aliases), or "".
std::string suggest_key(const std::string& section, const std::string& name) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  auto consider = [&](const std::string& candidate_leaf, const std::string& candidate_full,
                      size_t bonus) {
    size_t d = edit_distance(name, candidate_leaf) * 2 + bonus;
    if (d < best_d) {
      best_d = d;
      best = candidate_full;
    }
  };
  for (const auto& k : schema()) consider(k.name, k.full(), section == k.section ? 0 : 1);
  for (const auto& a : aliases()) consider(a.name, a.name, 1);
  // Only suggest when reasonably close: at most about a third of the name edited.
  size_t limit = std::max<size_t>(4, name.size()) * 2 / 3 + 1;
  return best_d <= limit * 2 ? best : "";
}

std::string suggest_section(const std::string& name) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& s : section_names()) {
    size_t d = edit_distance(name, s);
    if (d < best_d) {
      best_d = d;
      best = s;
    }
  }
  return best_d <= 3 ? best : "";
}

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i].empty() ? "\"\"" : "\"" + items[i] + "\"";
  }
  return out;
}

std::string where(const std::string& origin, const toml::source_region& src) {
  if (src.begin.line == 0) return origin;
  return fmt::format("{}:{}", origin, src.begin.line);
}

[[noreturn]] void type_error(const KeyDesc& k, const std::string& at) {
  fail(ExitCode::kUsage, "{}: key '{}' must be {}{}; fix the value", at, k.full(),
       kind_name(k.kind), k.allowed.empty() ? std::string() : " (one of " + join(k.allowed) + ")");
}

void check_range(const KeyDesc& k, double v, const std::string& shown, const std::string& at) {
  if (!std::isfinite(v) || v < k.min || v > k.max) {
    fail(ExitCode::kUsage, "{}: key '{}' is {}, must be {}", at, k.full(), shown, range_text(k));
  }
}

int64_t read_int(const KeyDesc& k, const toml::node& node, const std::string& at) {
  auto v = node.value_exact<int64_t>();
  if (!v) type_error(k, at);
  check_range(k, static_cast<double>(*v), fmt::format("{}", *v), at);
  return *v;
}

double read_double(const KeyDesc& k, const toml::node& node, const std::string& at) {
  std::optional<double> v;
  if (node.is_floating_point()) v = node.value_exact<double>();
  if (node.is_integer()) v = static_cast<double>(*node.value_exact<int64_t>());
  if (!v) type_error(k, at);
  check_range(k, *v, fmt::format("{}", *v), at);
  return *v;
}

std::string read_string(const KeyDesc& k, const toml::node& node, const std::string& at) {
  auto v = node.value_exact<std::string>();
  if (!v) type_error(k, at);
  if (!k.allowed.empty() && std::find(k.allowed.begin(), k.allowed.end(), *v) == k.allowed.end()) {
    fail(ExitCode::kUsage, "{}: key '{}' is \"{}\", allowed values are {}", at, k.full(), *v,
         join(k.allowed));
  }
  return *v;
}

// A list of strings; a single string is a list of one.
std::vector<std::string> read_string_list(const KeyDesc& k, const toml::node& node,
                                          const std::string& at) {
  if (auto s = node.value_exact<std::string>()) return {*s};
  const auto* arr = node.as_array();
  if (arr == nullptr) type_error(k, at);
  std::vector<std::string> out;
  for (const auto& el : *arr) {
    auto s = el.value_exact<std::string>();
    if (!s) type_error(k, at);
    out.push_back(*s);
  }
  return out;
}

// A list of numbers, each within the key's bounds; a single number is a list of one.
std::vector<double> read_number_list(const KeyDesc& k, const toml::node& node,
                                     const std::string& at) {
  if (node.is_number()) return {read_double(k, node, at)};
  const auto* arr = node.as_array();
  if (arr == nullptr) type_error(k, at);
  std::vector<double> out;
  for (const auto& el : *arr) {
    if (!el.is_number()) type_error(k, at);
    out.push_back(read_double(k, el, at));
  }
  return out;
}

// data.seq_len_warmup: an array of {steps, seq_len} tables (a single table is a list of one).
// The order of the stages and their lengths against model.max_seq_length are checked by
// validate(), once every key is set.
std::vector<SeqLenStage> read_stage_list(const KeyDesc& k, const toml::node& node,
                                         const std::string& at) {
  std::vector<const toml::table*> tables;
  if (const auto* t = node.as_table()) {
    tables.push_back(t);
  } else if (const auto* arr = node.as_array()) {
    for (const auto& el : *arr) {
      if (!el.is_table()) type_error(k, at);
      tables.push_back(el.as_table());
    }
  } else {
    type_error(k, at);
  }
  std::vector<SeqLenStage> out;
  for (size_t i = 0; i < tables.size(); ++i) {
    const std::string stage = fmt::format("{}[{}]", k.full(), i);
    SeqLenStage s;
    bool has_steps = false, has_len = false;
    for (const auto& [key, value] : *tables[i]) {
      const std::string name(key.str());
      auto v = value.value_exact<int64_t>();
      if (name != "steps" && name != "seq_len") {
        fail(ExitCode::kUsage,
             "{}: {} has an unknown key '{}'; a stage is {{steps = N, seq_len = N}}", at, stage,
             name);
      }
      if (!v) fail(ExitCode::kUsage, "{}: {}.{} must be an integer", at, stage, name);
      if (name == "steps") {
        if (*v < 1) fail(ExitCode::kUsage, "{}: {}.steps is {}, must be at least 1", at, stage, *v);
        s.steps = *v;
        has_steps = true;
      } else {
        if (*v < 4 || *v > (1 << 20)) {
          fail(ExitCode::kUsage, "{}: {}.seq_len is {}, must be between 4 and {}", at, stage, *v,
               1 << 20);
        }
        s.seq_len = *v;
        has_len = true;
      }
    }
    if (!has_steps || !has_len) {
      fail(ExitCode::kUsage, "{}: {} needs both keys: {{steps = N, seq_len = N}}", at, stage);
    }
    out.push_back(s);
  }
  return out;
}

// Reads `node` into the field described by `k`; `at` is "file:line" or "--set key=value".
void assign(Config& c, const KeyDesc& k, const toml::node& node, const std::string& at) {
  void* field = k.ptr(c);
  switch (k.kind) {
    case Kind::kInt:
      *static_cast<int64_t*>(field) = read_int(k, node, at);
      break;
    case Kind::kDouble:
      *static_cast<double*>(field) = read_double(k, node, at);
      break;
    case Kind::kBool: {
      auto v = node.value_exact<bool>();
      if (!v) type_error(k, at);
      *static_cast<bool*>(field) = *v;
      break;
    }
    case Kind::kString:
      if (k.set_text) {
        k.set_text(c, read_string(k, node, at));
      } else {
        *static_cast<std::string*>(field) = read_string(k, node, at);
      }
      break;
    case Kind::kStringList:
      *static_cast<std::vector<std::string>*>(field) = read_string_list(k, node, at);
      break;
    case Kind::kNumberList:
      *static_cast<std::vector<double>*>(field) = read_number_list(k, node, at);
      break;
    case Kind::kStageList:
      *static_cast<std::vector<SeqLenStage>*>(field) = read_stage_list(k, node, at);
      break;
  }
}

// Applies an alias. `bf16`/`fp16` are booleans that select a precision.
void assign_alias(Config& c, const Alias& a, const toml::node& node, const std::string& at) {
  std::string name = a.name;
  if (name == "bf16" || name == "fp16") {
    auto v = node.value_exact<bool>();
    if (!v) fail(ExitCode::kUsage, "{}: key '{}' must be true or false", at, name);
    const Precision selected = name == "bf16" ? Precision::kBf16 : Precision::kFp16;
    if (*v) {
      c.training.precision = selected;
    } else if (c.training.precision == selected) {
      c.training.precision = Precision::kFp32;
    }
    return;
  }
  assign(c, *find_key(a.section, a.key), node, at);
}

// Sets `section.name` (or an alias) from `node`; unknown keys fail with a suggestion.
void set_key(Config& c, const std::string& section, const std::string& name, const toml::node& node,
             const std::string& at) {
  if (const KeyDesc* k = find_key(section, name)) {
    assign(c, *k, node, at);
    return;
  }
  if (const Alias* a = find_alias(name)) {
    assign_alias(c, *a, node, at);
    return;
  }
  std::string full = section.empty() ? name : section + "." + name;
  std::string hint = suggest_key(section, name);
  fail(ExitCode::kUsage, "{}: unknown key '{}'{}; see docs/config.md for the valid keys", at, full,
       hint.empty() ? std::string() : "; did you mean '" + hint + "'?");
}

// The canonical "section.key" that `name` sets in a table of `section` ("" when it names
// none, or for the bf16/fp16 selectors, which may both appear: see assign_alias).
std::string canonical_key(const std::string& section, const std::string& name) {
  if (find_key(section, name) != nullptr) return section + "." + name;
  if (const Alias* a = find_alias(name)) {
    const std::string n = a->name;
    if (n == "bf16" || n == "fp16") return "";
    return std::string(a->section) + "." + a->key;
  }
  return "";
}

// Note [One spelling a table]: `lr` and its alias `learning_rate` (any key and an alias of
// it) in one table would leave the value to whichever comes later; refused, naming both.
void check_one_spelling(const toml::table& table, const std::string& section,
                        const std::string& origin) {
  std::map<std::string, std::pair<std::string, toml::source_region>> seen;
  for (const auto& [key, node] : table) {
    if (node.is_table()) continue;
    const std::string name(key.str());
    const std::string canonical = canonical_key(section, name);
    if (canonical.empty()) continue;
    const auto region = key.source().begin.line ? key.source() : node.source();
    auto [it, fresh] = seen.emplace(canonical, std::make_pair(name, region));
    if (fresh) continue;
    // (toml++ iterates keys in name order: the message names the later line first.)
    auto later = std::make_pair(name, region), earlier = it->second;
    if (later.second.begin.line < earlier.second.begin.line) std::swap(later, earlier);
    fail(ExitCode::kUsage,
         "{}: '{}' and '{}' ({}) both set {} in one table, so one would silently win: keep one "
         "of them",
         where(origin, later.second), later.first, earlier.first, where(origin, earlier.second),
         canonical);
  }
}

void apply_table(Config& c, const toml::table& root, const std::string& origin) {
  check_one_spelling(root, "", origin);
  for (const auto& [key, node] : root) {
    if (const auto* table = node.as_table())
      check_one_spelling(*table, std::string(key.str()), origin);
  }
  for (const auto& [key, node] : root) {
    std::string name(key.str());
    std::string at = where(origin, key.source().begin.line ? key.source() : node.source());
    if (const auto* table = node.as_table()) {
      bool known =
          std::find(section_names().begin(), section_names().end(), name) != section_names().end();
      if (!known) {
        std::string hint = suggest_section(name);
        fail(ExitCode::kUsage, "{}: unknown section [{}]{}; valid sections are [{}]", at, name,
             hint.empty() ? std::string() : "; did you mean [" + hint + "]?",
             fmt::format("{}", fmt::join(section_names(), "] [")));
      }
      for (const auto& [sub, subnode] : *table) {
        std::string sub_at =
            where(origin, sub.source().begin.line ? sub.source() : subnode.source());
        set_key(c, name, std::string(sub.str()), subnode, sub_at);
      }
    } else {
      set_key(c, "", name, node, at);  // top level: only aliases are valid
    }
  }
}

// Sets `path` ("section.key", or an alias) from `value`: TOML, or a bare word taken as a
// string. `at` names where the value came from in messages.
void set_from_text(Config& c, const std::string& path, const std::string& value,
                   const std::string& at) {
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", value}};  // bare word: a string
  }
  if (parsed.size() != 1 || !parsed.contains("v")) parsed = toml::table{{"v", value}};
  const toml::node& node = *parsed.get("v");
  auto dot = path.find('.');
  if (dot == std::string::npos) {
    set_key(c, "", path, node, at);
    return;
  }
  std::string section = path.substr(0, dot);
  if (std::find(section_names().begin(), section_names().end(), section) == section_names().end()) {
    std::string hint = suggest_section(section);
    fail(ExitCode::kUsage, "{}: unknown section '{}'{}", at, section,
         hint.empty() ? std::string() : "; did you mean '" + hint + "'?");
  }
  set_key(c, section, path.substr(dot + 1), node, at);
}

// `--set section.key=value`.
void apply_override(Config& c, const std::string& spec) {
  auto eq = spec.find('=');
  if (eq == std::string::npos || eq == 0) {
    fail(ExitCode::kUsage, "--set '{}': expected section.key=value (e.g. training.lr=3e-4)", spec);
  }
  set_from_text(c, spec.substr(0, eq), spec.substr(eq + 1), fmt::format("--set {}", spec));
}

}  // namespace

Config parse_config(const std::string& toml_text, const std::string& origin,
                    const std::vector<std::string>& overrides) {
  Config c;
  c.source_file = origin;
  if (!toml_text.empty()) {
    toml::table root;
    try {
      root = toml::parse(toml_text, origin);
    } catch (const toml::parse_error& e) {
      fail(ExitCode::kUsage, "{}:{}:{}: malformed TOML: {}", origin, e.source().begin.line,
           e.source().begin.column, e.description());
    }
    apply_table(c, root, origin);
  }
  for (const auto& o : overrides) apply_override(c, o);
  validate(c, origin);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return parse_config("", "", overrides);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail(ExitCode::kUsage, "--config '{}' is a directory; name a TOML file (e.g. {}/run.toml)",
         path, path);
  std::string text = read_bounded_file(path, kMaxConfigFileBytes, ExitCode::kUsage, "--config");
  if (text.empty()) text = "\n";  // an empty file is valid: defaults
  return parse_config(text, path, overrides);
}

void apply_key_overrides(Config& config, const std::vector<KeyOverride>& overrides) {
  for (const auto& o : overrides) set_from_text(config, o.key, o.value, o.origin);
  validate(config, config.source_file);
}

}  // namespace dnallm
