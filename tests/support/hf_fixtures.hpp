// The Hugging Face fixtures the worker tests read: the committed ones (tests/data/hf-fixtures,
// the DNALLM_HF_FIXTURES definition of the test target), or DNALLM_HF_FIXTURES_DIR (a set
// tests/hf/make_fixtures.py made now: CTest hf_fixtures_regenerated).
#pragma once

#include <cstdlib>
#include <string>

namespace dnallm::testing {

inline std::string hf_fixtures_dir() {
  const char* dir = std::getenv("DNALLM_HF_FIXTURES_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) : std::string(DNALLM_HF_FIXTURES);
}

// `name` (a fixture folder or file) under hf_fixtures_dir().
inline std::string hf_fixture(const std::string& name) { return hf_fixtures_dir() + "/" + name; }

}  // namespace dnallm::testing
