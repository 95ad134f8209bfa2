// dnallm-config-codegen: the configuration schema's declarations, from data. Each section's keys
// are a TOML file (core/config/keys/<section>.toml, Note [Config key files]); this program
// checks them and writes the C++ that declares them (SectionKeys calls, core/config/schema.hpp)
// into the build folder. The build runs it before compiling dnallm_core:
//
//   dnallm-config-codegen OUTPUT.cpp core/config/keys/model.toml ... (in the order listed)
//
// A mistake in a key file (an unknown field, a missing doc, min above max, a key declared
// twice) stops the build with the file, the key and what to do.
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <toml++/toml.h>

namespace {

struct BadKeys : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool is_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

// `text` as a C++ string literal (UTF-8 passes through).
std::string literal(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// The identifier string `field` of `table`; `fallback` when absent and not required.
std::string identifier(const toml::table& table, const std::string& field, const std::string& at,
                       const std::string& fallback = "") {
  const toml::node* node = table.get(field);
  if (!node) {
    if (!fallback.empty()) return fallback;
    throw BadKeys(fmt::format("{}: `{}` is missing; give it as a string", at, field));
  }
  auto value = node->value<std::string>();
  if (!value || !is_identifier(*value)) {
    throw BadKeys(fmt::format("{}: `{}` must be a C++ identifier in quotes", at, field));
  }
  return *value;
}

// A bound: an integer or a number ("inf" or absent: none).
std::string bound(const toml::table& key, const char* field, const std::string& at) {
  const toml::node* node = key.get(field);
  if (!node) return field == std::string("min") ? "-kInf" : "kInf";
  if (auto i = node->value_exact<int64_t>()) return fmt::format("{}", *i);
  auto d = node->value_exact<double>();
  if (!d || std::isnan(*d)) throw BadKeys(fmt::format("{}: `{}` must be a number", at, field));
  if (std::isinf(*d)) return *d > 0 ? "kInf" : "-kInf";
  return fmt::format("{}", *d);
}

void check_fields(const toml::table& table, const std::set<std::string>& allowed,
                  const std::string& at) {
  for (const auto& [name, node] : table) {
    if (allowed.count(std::string(name.str())) == 0) {
      throw BadKeys(
          fmt::format("{}: unknown field `{}` (a key takes name, field, kind, min, max "
                      "and doc; a file section, struct and [[key]])",
                      at, name.str()));
    }
  }
}

// One [[key]] table as the SectionKeys call that declares it.
std::string key_call(const toml::table& key, const std::string& structure, const std::string& at) {
  check_fields(key, {"name", "field", "kind", "min", "max", "doc"}, at);
  const std::string name = identifier(key, "name", at);
  const std::string where = fmt::format("{}, key `{}`", at, name);
  const std::string field = identifier(key, "field", where, name);
  auto doc = key["doc"].value<std::string>();
  if (!doc || doc->empty()) {
    throw BadKeys(fmt::format("{}: `doc` is missing; say what the key means (Markdown)", where));
  }
  const std::string kind = key["kind"].value_or(std::string());
  const bool bounded = key.contains("min") || key.contains("max");
  std::string method = bounded ? "range" : "key";
  if (kind == "choice" || kind == "resume") {
    if (bounded) throw BadKeys(fmt::format("{}: a {} has no min or max", where, kind));
    method = kind;
  } else if (!kind.empty()) {
    throw BadKeys(
        fmt::format("{}: kind `{}` is not `choice` or `resume` (numbers, strings, "
                    "flags and lists take their kind from the field's type)",
                    where, kind));
  }
  std::string bounds;
  if (bounded) {
    const std::string lo = bound(key, "min", where), hi = bound(key, "max", where);
    if (key.contains("min") && key.contains("max") &&
        key["min"].value<double>().value_or(0) > key["max"].value<double>().value_or(0)) {
      throw BadKeys(fmt::format("{}: min {} is above max {}", where, lo, hi));
    }
    bounds = fmt::format(" {}, {},", lo, hi);
  }
  return fmt::format("\n      .{}({}, &{}::{},{} {})", method, literal(name), structure, field,
                     bounds, literal(*doc));
}

// One file's section as one statement.
std::string section_statement(const std::string& path) {
  toml::table file;
  try {
    file = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw BadKeys(fmt::format("{}:{}: {}", path, e.source().begin.line, e.description()));
  }
  check_fields(file, {"section", "struct", "key"}, path);
  const std::string section = identifier(file, "section", path);
  const std::string structure = identifier(file, "struct", path);
  const toml::array* keys = file["key"].as_array();
  if (!keys || keys->empty()) throw BadKeys(path + ": no [[key]] tables");
  std::string out =
      fmt::format("  SectionKeys<{}>(out, {}, &Config::{})", structure, literal(section), section);
  std::set<std::string> names;
  for (size_t i = 0; i < keys->size(); ++i) {
    const toml::table* key = keys->get(i)->as_table();
    const std::string at = fmt::format("{}, [[key]] {}", path, i + 1);
    if (!key) throw BadKeys(at + ": not a table");
    out += key_call(*key, structure, at);
    const std::string name = key->at("name").value_or(std::string());
    if (!names.insert(name).second) {
      throw BadKeys(fmt::format("{}: `{}` is declared twice in this section; keep one", at, name));
    }
  }
  return out + ";\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: dnallm-config-codegen OUTPUT.cpp KEYS.toml...\n";
    return 2;
  }
  std::ostringstream code;
  code << "// Generated by dnallm-config-codegen (core/config_codegen_main.cpp) from the files of\n"
          "// core/config/keys/ (Note [Config key files]): edit those, not this.\n"
          "#include \"core/config/schema.hpp\"\n\n"
          "namespace dnallm::config_detail {\n\n"
          "void declare_keys(std::vector<KeyDesc>& out) {\n";
  try {
    for (int i = 2; i < argc; ++i) code << section_statement(argv[i]);
  } catch (const std::exception& e) {
    std::cerr << "dnallm-config-codegen: " << e.what() << "\n";
    return 2;
  }
  code << "}\n\n}  // namespace dnallm::config_detail\n";
  // The same declarations leave the file untouched, so what compiles it does not compile again
  // when only this program was relinked (Ninja's restat; Note [Build without LibTorch]).
  {
    std::ifstream old(argv[1], std::ios::binary);
    std::ostringstream had;
    had << old.rdbuf();
    if (old && had.str() == code.str()) return 0;
  }
  std::ofstream out(argv[1], std::ios::binary | std::ios::trunc);
  out << code.str();
  if (!out.flush()) {
    std::cerr << "dnallm-config-codegen: cannot write " << argv[1] << "\n";
    return 2;
  }
  return 0;
}
