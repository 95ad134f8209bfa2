// Reading a whole string as an integer: what the readers of environment variables, hostfiles
// and command-line counts share; each names its own variable, file or flag in its error.
#pragma once

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>

namespace dnallm {

// `text` as a base-10 integer (std::stoll: leading white space and a sign allowed), or nullopt
// when it is empty, is not a number, holds anything after the number or does not fit.
inline std::optional<long long> parse_whole_int(const std::string& text) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::logic_error&) {  // std::invalid_argument, std::out_of_range
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return v;
}

}  // namespace dnallm
