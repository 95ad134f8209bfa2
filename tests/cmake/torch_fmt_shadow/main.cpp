// Includes a torch-like header, spdlog and fmt in one translation unit, as worker/ does.
#include <ATen/fake.h>
#include <spdlog/spdlog.h>
#include <torch/api.h>

#include <vector>

#include <fmt/format.h>
#if __has_include(<fmt/ranges.h>)
#include <fmt/ranges.h>
#endif

int main() {
  std::vector<int> v{1, 2, 3};
  spdlog::info("fmt {} join {}", FMT_VERSION, fmt::join(v, ","));
  return fake_aten() + fake_api() == 49 ? 0 : 1;
}
