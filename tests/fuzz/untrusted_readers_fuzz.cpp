// libFuzzer target (issue 22) for the readers of untrusted files (Note [Untrusted files] in
// core/untrusted_file.hpp): the safetensors header (checkpoint/safetensors.cpp), config.json's
// strict JSON parse, and a Hugging Face tokenizer directory (worker/data/hf_tokenizer.cpp and,
// for a BPE tokenizer.json such as DNABERT-2's, worker/data/hf_bpe.cpp), encoding a text.
// The first input byte picks the reader; the rest is the file(s). Every failure must be a
// dnallm::Error of one bounded line: any other exception, a message with a newline or longer
// than 4 KiB, a crash or a sanitizer report is a finding. Built and run for a bounded time by
// tests/fuzz/run-fuzz.sh (ctest: fuzz_untrusted_readers).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/hf_tokenizer.hpp"

namespace {

namespace fs = std::filesystem;

const fs::path& work_dir() {
  static const fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("dnallm_fuzz_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

void write(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

void check_message(const dnallm::Error& e) {
  const std::string what = e.what();
  if (what.find('\n') != std::string::npos || what.size() > 4096) {
    std::fprintf(stderr, "unbounded error message (%zu bytes)\n", what.size());
    std::abort();
  }
}

void run_safetensors(const std::string& data) {
  const auto path = work_dir() / "model.safetensors";
  write(path, data);
  dnallm::checkpoint::SafetensorsReader reader(path);
  std::vector<char> buffer;
  for (const auto& [name, entry] : reader.file().tensors) {
    buffer.resize(entry.data_end - entry.data_begin);  // bounded by the file size (checked)
    reader.read(entry, buffer.data());
  }
}

void run_tokenizer(const std::string& data) {
  // tokenizer_config.json \0 tokenizer.json \0 vocab.txt \0 text to encode (a missing
  // file part: no such file; no text part: a fixed DNA sequence)
  std::vector<std::string> parts(1);
  for (char c : data) {
    if (c == '\0' && parts.size() < 4) {
      parts.emplace_back();
    } else {
      parts.back().push_back(c);
    }
  }
  const char* names[] = {"tokenizer_config.json", "tokenizer.json", "vocab.txt"};
  for (size_t i = 0; i < 3; ++i) {
    std::error_code ec;
    fs::remove(work_dir() / names[i], ec);
    if (i < parts.size() && !parts[i].empty()) write(work_dir() / names[i], parts[i]);
  }
  auto t = dnallm::data::HfTokenizer::load(work_dir().string());
  (void)t.encode(parts.size() > 3 ? parts[3] : "ACGTNACGTTGCAacgtAAAATTTT");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 1) return 0;
  const std::string data(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  try {
    switch (bytes[0] % 3) {
      case 0:
        run_safetensors(data);
        break;
      case 1:
        (void)dnallm::parse_json_strict(data, "config.json", dnallm::ExitCode::kUsage);
        break;
      default:
        run_tokenizer(data);
        break;
    }
  } catch (const dnallm::Error& e) {
    check_message(e);
  }
  // Anything else (std::exception, nlohmann's type errors, ...) escapes: libFuzzer reports it.
  return 0;
}
