// Internal to core/config/: the schema behind core/config.hpp. A table of key descriptors
// drives parsing, validation, printing and the "did you mean" suggestions, so a key is
// declared in exactly one place: its section's file (core/config/keys/<section>.toml).
//
//   schema.cpp       the table of every key, the aliases, lookups
//   keys/*.toml      one section's keys: name, range or choices, meaning (Note [Config key files])
//   parse.cpp        TOML and --set into a Config (parse_config, load_config)
//   validate.cpp     checks across keys, once every key is set
//   to_toml.cpp      a Config as TOML (to_toml, model_config_hash, config_default)
//   reference.cpp    docs/config.md (config_reference)
//   spellings.*      the enums' spellings (Note [Config choices])
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/config/spellings.hpp"

namespace dnallm::config_detail {

enum class Kind { kInt, kDouble, kBool, kString, kStringList, kNumberList, kStageList };

// What a key of kind `k` holds: in a message ("an integer") and in docs/config.md's "allowed"
// column ("integer").
const char* kind_name(Kind k);
const char* kind_reference_name(Kind k);

constexpr double kInf = std::numeric_limits<double>::infinity();

// One configuration key. `ptr` returns the field inside a Config; the constraints are
// checked where the value is read, so the message can name the file and line.
struct KeyDesc {
  const char* section;
  const char* name;
  Kind kind;
  std::function<void*(Config&)> ptr;
  double min = -kInf;  // numbers: inclusive bounds
  double max = kInf;
  std::vector<std::string> allowed = {};  // strings: allowed values (empty: any)
  const char* doc = "";                   // the key's meaning (Markdown, docs/config.md)
  // Strings held as another type (an enum, cfg::Resume): the field as its spelling, and the
  // field set from a spelling (one of `allowed` when that is not empty). Empty: a std::string.
  std::function<std::string(Config&)> get_text = {};
  std::function<void(Config&, const std::string&)> set_text = {};

  std::string full() const { return std::string(section) + "." + name; }
};

template <class T>
constexpr Kind kind_of();
template <>
constexpr Kind kind_of<int64_t>() {
  return Kind::kInt;
}
template <>
constexpr Kind kind_of<double>() {
  return Kind::kDouble;
}
template <>
constexpr Kind kind_of<bool>() {
  return Kind::kBool;
}
template <>
constexpr Kind kind_of<std::string>() {
  return Kind::kString;
}
template <>
constexpr Kind kind_of<std::vector<std::string>>() {
  return Kind::kStringList;
}
template <>
constexpr Kind kind_of<std::vector<double>>() {
  return Kind::kNumberList;
}
template <>
constexpr Kind kind_of<std::vector<SeqLenStage>>() {
  return Kind::kStageList;
}

// Declares the keys of one section, in the order docs/config.md and to_toml() list them. The
// field's C++ type gives the key's kind; `doc` is the key's meaning in Markdown.
template <class Section>
class SectionKeys {
 public:
  SectionKeys(std::vector<KeyDesc>& out, const char* section, Section Config::*member)
      : out_(out), section_(section), member_(member) {}

  template <class T>
  SectionKeys& key(const char* name, T Section::*field, const char* doc) {
    return add(name, field, -kInf, kInf, {}, doc);
  }
  template <class T>
  SectionKeys& range(const char* name, T Section::*field, double min, double max, const char* doc) {
    return add(name, field, min, max, {}, doc);
  }
  // A closed set of values: the enum's spellings (Note [Config choices]).
  template <class E>
  SectionKeys& choice(const char* name, E Section::*field, const char* doc) {
    return add_text(
        name, field, spellings_list<E>(), doc, [](const E& v) { return spelling_in_table(v); },
        [](const std::string& text) { return *parse_spelling<E>(text); });  // checked: allowed
  }
  // checkpoint.resume: "auto", "none" or a path.
  SectionKeys& resume(const char* name, Resume Section::*field, const char* doc) {
    return add_text(name, field, {}, doc, resume_text, parse_resume);
  }

 private:
  template <class T>
  SectionKeys& add(const char* name, T Section::*field, double min, double max,
                   std::vector<std::string> allowed, const char* doc) {
    Section Config::*member = member_;
    out_.push_back({section_, name, kind_of<T>(),
                    [member, field](Config& c) -> void* { return &(c.*member.*field); }, min, max,
                    std::move(allowed), doc});
    return *this;
  }

  // A string key whose field holds another type T: `print` gives its spelling, `parse` the
  // value of a spelling (one of `allowed` when that is not empty).
  template <class T, class Print, class Parse>
  SectionKeys& add_text(const char* name, T Section::*field, std::vector<std::string> allowed,
                        const char* doc, Print print, Parse parse) {
    Section Config::*member = member_;
    KeyDesc k{section_,
              name,
              Kind::kString,
              [member, field](Config& c) -> void* { return &(c.*member.*field); },
              -kInf,
              kInf,
              std::move(allowed),
              doc};
    k.get_text = [member, field, print](Config& c) -> std::string {
      return print(c.*member.*field);
    };
    k.set_text = [member, field, parse](Config& c, const std::string& text) {
      c.*member.*field = parse(text);
    };
    out_.push_back(std::move(k));
    return *this;
  }

  std::vector<KeyDesc>& out_;
  const char* section_;
  Section Config::*member_;
};

// Note [Config key files]
// A section's keys are data: core/config/keys/<section>.toml, one file a section, holds
//
//   section = "model"            the TOML table, and the member of Config that holds it
//   struct = "ModelConfig"       that member's type (core/config.hpp)
//   [[key]]                      one a key, in the order docs/config.md and to_toml() list them
//   name = "hidden"              the key
//   field = "..."                the member of `struct` that holds it; absent: as `name`
//   min = 1, max = 65_536        a number's inclusive bounds (either may be left out: none)
//   kind = "choice"              a closed set of spellings, the field an enum (Note [Config
//                                choices]); "resume": checkpoint.resume's "auto", "none" or a path
//   doc = "..."                  what the key means, in Markdown (docs/config.md)
//
// The key's kind (integer, number, flag, string, list) is its field's C++ type (kind_of), its
// default the field's initialiser. At build time dnallm-config-codegen
// (core/config_codegen_main.cpp) checks the files and writes them as the SectionKeys calls of
// `declare_keys`; a file it refuses (an unknown field, no doc, min above max, a key twice) stops
// the build naming the file and key. A new key is a field in core/config.hpp and a [[key]] in its
// section's file; a new section is also a file named in core/CMakeLists.txt
// (DNALLM_CONFIG_SECTIONS, in the order of the reference).

// Appends every key of every section to `out`, in the order of the files (generated from
// core/config/keys/*.toml: Note [Config key files]).
void declare_keys(std::vector<KeyDesc>& out);

// Every key, section by section, in the order docs/config.md and to_toml() list them.
const std::vector<KeyDesc>& schema();
const std::vector<std::string>& section_names();
const KeyDesc* find_key(const std::string& section, const std::string& name);

// Hugging Face / DNALLM spellings that map one to one onto our keys. Accepted at the top
// level of a file, inside any section, and in --set (with or without a section).
struct Alias {
  const char* name;
  const char* section;  // canonical key
  const char* key;
};
const std::vector<Alias>& aliases();
const Alias* find_alias(const std::string& name);

// "between 1 and 8", "at least 0", ...: a number key's bounds, for messages and the reference.
std::string range_text(const KeyDesc& k);

// The field `k` of `c` as TOML text (core/config/to_toml.cpp).
std::string value_text(Config& c, const KeyDesc& k);

// Checks across keys, once every key is set (core/config/validate.cpp); throws Error(kUsage)
// naming `origin`.
void validate(const Config& c, const std::string& origin);

}  // namespace dnallm::config_detail
