// hf_tokenize_tool DIR SEQUENCES [--time]: the ids HfTokenizer::load(DIR).encode() gives each
// line of SEQUENCES (one sequence a line), one line of space-separated ids each, for
// tests/hf/check_bpe.py (the tokenizers library's ids, compared) and bench/data/bench_bpe.sh.
// --time: also "encode_seconds S bases B" on stderr (the encode calls only, not the reading).
// An error is one line on stderr and the project's exit code (2: a refused tokenizer).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "worker/data/hf_tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: hf_tokenize_tool DIR SEQUENCES [--time]\n");
    return 2;
  }
  const bool timed = argc > 3 && std::string(argv[3]) == "--time";
  try {
    const auto tok = dnallm::data::HfTokenizer::load(argv[1]);
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) dnallm::fail(dnallm::ExitCode::kUsage, "cannot open {}", argv[2]);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
    std::vector<std::vector<int64_t>> ids(lines.size());
    size_t bases = 0;
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < lines.size(); ++i) {
      ids[i] = tok.encode(lines[i]);
      bases += lines[i].size();
    }
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    std::string out;
    for (const auto& row : ids) {
      for (size_t j = 0; j < row.size(); ++j) {
        if (j) out += ' ';
        out += std::to_string(row[j]);
      }
      out += '\n';
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    if (timed) std::fprintf(stderr, "encode_seconds %.6f bases %zu\n", took.count(), bases);
    return 0;
  } catch (const dnallm::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return static_cast<int>(e.code());
  }
}
