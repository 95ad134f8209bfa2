#include "test_util.hpp"

#include <fstream>

namespace dnallm::checkpoint::testing {

void flip_byte(const std::filesystem::path& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << path;
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path));
  const int64_t at = offset >= 0 ? offset : size + offset;
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(at);
  f.write(&c, 1);
}

}  // namespace dnallm::checkpoint::testing
