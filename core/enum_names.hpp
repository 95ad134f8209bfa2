// Note [Enum tables]: an enum's names (or the values of another enum it stands for) as one
// table of {value, name}, read in both directions: name_of() for messages, logs and wire names,
// value_named() to parse a name back (or to map the other enum back). A switch over the enum
// had the compiler's check that no value is missing; a table keeps it at compile time with
//   static_assert(lists_each_in_order<E::kLastValue>(kTable));
// which holds when the table lists E's values 0, 1, ... up to the last one, each once and in
// the order of the enum: a value added to the enum is added to its table, and the last value
// named in the assert is the enum's last one.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>
#include <type_traits>

namespace dnallm {

template <class E, class Name = const char*>
struct EnumName {
  E value;
  Name name;
};

// See Note [Enum tables]: `table` lists 0, 1, ..., kLast, in order, each value once.
template <auto kLast, class Name, std::size_t n>
constexpr bool lists_each_in_order(const EnumName<decltype(kLast), Name> (&table)[n]) {
  for (std::size_t i = 0; i < n; ++i) {
    if (static_cast<std::size_t>(table[i].value) != i) return false;
  }
  return static_cast<std::size_t>(kLast) + 1 == n;
}

// For a table of one enum's values to another's, read both ways (value_named() maps back): the
// names too list 0, 1, ..., kLast, in order, each once.
template <auto kLast, class E, std::size_t n>
constexpr bool names_each_in_order(const EnumName<E, decltype(kLast)> (&table)[n]) {
  for (std::size_t i = 0; i < n; ++i) {
    if (static_cast<std::size_t>(table[i].name) != i) return false;
  }
  return static_cast<std::size_t>(kLast) + 1 == n;
}

// The name of `v` in `table`, or `otherwise` for a value the table does not list (a byte off
// the wire, a value cast from a number).
template <class E, class Name, std::size_t n>
constexpr Name name_of(const EnumName<E, Name> (&table)[n], E v,
                       std::type_identity_t<Name> otherwise) {
  for (const auto& e : table) {
    if (e.value == v) return e.name;
  }
  return otherwise;
}

// The value whose name is `name` (the first one, where several values share a name), or
// nullopt when no value has it. Names that are text compare as text, whatever holds `name`.
template <class E, class Name, std::size_t n, class Text>
constexpr std::optional<E> value_named(const EnumName<E, Name> (&table)[n], const Text& name) {
  for (const auto& e : table) {
    if constexpr (std::is_same_v<Name, const char*>) {
      if (std::string_view(name) == e.name) return e.value;
    } else {
      if (name == e.name) return e.value;
    }
  }
  return std::nullopt;
}

}  // namespace dnallm
