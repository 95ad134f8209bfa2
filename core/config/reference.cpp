// docs/config.md, rendered from the schema (config_reference()).
#include <fmt/format.h>

#include "core/config/schema.hpp"
#include "core/error.hpp"

namespace dnallm {

using namespace config_detail;  // NOLINT: the schema's internals

namespace {

// A Markdown table cell: '|' would end it.
std::string cell(const std::string& text) {
  std::string out;
  for (char ch : text) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}

// What a key accepts, for the reference's "allowed" column.
std::string allowed_text(const KeyDesc& k) {
  if (!k.allowed.empty()) {
    std::vector<std::string> quoted;
    for (const auto& a : k.allowed) quoted.push_back("`\"" + a + "\"`");
    return fmt::format("{}", fmt::join(quoted, " | "));
  }
  const std::string name = kind_reference_name(k.kind);
  const bool numeric =
      k.kind == Kind::kInt || k.kind == Kind::kDouble || k.kind == Kind::kNumberList;
  return numeric ? name + ", " + (k.kind == Kind::kNumberList ? "each " : "") + range_text(k)
                 : name;
}

// One table per section: key, default, allowed values, meaning.
std::string keys_markdown() {
  Config defaults;
  std::string out;
  std::string current;
  for (const auto& k : schema()) {
    if (current != k.section) {
      out += fmt::format(
          "{}### [{}]\n\n| key | default | allowed | meaning |\n"
          "| --- | --- | --- | --- |\n",
          current.empty() ? "" : "\n", k.section);
      current = k.section;
    }
    out += fmt::format("| `{}` | `{}` | {} | {} |\n", k.name, value_text(defaults, k),
                       cell(allowed_text(k)), cell(k.doc));
  }
  return out;
}

std::string aliases_markdown() {
  std::string out = "| alias | key |\n| --- | --- |\n";
  for (const auto& a : aliases()) {
    const std::string name = a.name;
    const std::string key = fmt::format("`{}.{}`", a.section, a.key);
    if (name == "bf16" || name == "fp16") {  // see assign_alias
      out += fmt::format("| `{0} = true` | {1} = `\"{0}\"` (`false`: back to `\"fp32\"`) |\n", name,
                         key);
    } else {
      out += fmt::format("| `{}` | {} |\n", name, key);
    }
  }
  return out;
}

void replace_marker(std::string& text, const std::string& marker, const std::string& with) {
  const auto at = text.find(marker);
  DNALLM_CHECK(at != std::string::npos, ExitCode::kUsage,
               "the configuration reference template has no {} marker", marker);
  text.replace(at, marker.size(), with);
}

}  // namespace

std::string config_reference(const std::string& page_template) {
  std::string page = page_template;
  replace_marker(page, "{{aliases}}", aliases_markdown());
  replace_marker(page, "{{keys}}", keys_markdown());
  return page;
}

}  // namespace dnallm
