// dnallm-config-reference: renders the configuration reference (docs/config.md) from the
// schema in core/config/ and the page's prose in docs/config.md.in. Run
// `cmake --build build --target config-reference` to regenerate docs/config.md.
#include <fstream>
#include <iostream>
#include <sstream>

#include "core/config.hpp"
#include "core/error.hpp"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::cerr << "usage: dnallm-config-reference TEMPLATE [OUTPUT]  (e.g. docs/config.md.in "
                 "docs/config.md; without OUTPUT the page goes to stdout)\n";
    return static_cast<int>(dnallm::ExitCode::kUsage);
  }
  std::ifstream in(argv[1]);
  if (!in) {
    std::cerr << "dnallm-config-reference: cannot read " << argv[1] << "\n";
    return static_cast<int>(dnallm::ExitCode::kUsage);
  }
  std::stringstream text;
  text << in.rdbuf();
  try {
    const std::string page = dnallm::config_reference(text.str());
    if (argc == 2) {
      std::cout << page;
      return 0;
    }
    std::ofstream out(argv[2], std::ios::binary | std::ios::trunc);
    out << page;
    if (!out.flush()) {
      std::cerr << "dnallm-config-reference: cannot write " << argv[2] << "\n";
      return static_cast<int>(dnallm::ExitCode::kUsage);
    }
    return 0;
  } catch (const dnallm::Error& e) {
    std::cerr << "dnallm-config-reference: " << e.what() << "\n";
    return e.exit_code();
  }
}
