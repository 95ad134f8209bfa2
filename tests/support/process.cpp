#include "tests/support/process.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <gtest/gtest.h>

namespace dnallm::testing {

int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

CommandResult run_shell(const std::string& cmd, Streams streams) {
  const std::string redirect = streams == Streams::kBoth ? " 2>&1" : " 2>/dev/null";
  FILE* p = ::popen((cmd + redirect).c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed: " + cmd);
  CommandResult r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  r.code = exit_code_of(::pclose(p));
  return r;
}

int run_command(const std::string& cmd, std::string* log) {
  CommandResult r = run_shell(cmd);
  if (log != nullptr) *log = std::move(r.out);
  return r.code;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string make_temp_dir(const std::string& name) {
  auto dir = std::filesystem::path(::testing::TempDir()) /
             ("dnallm_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string make_test_case_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("dnallm_" + name + "_" + std::to_string(::getpid()) + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string bundled_genome(size_t bytes) {
  const auto unzip = run_shell(
      "gzip -dc " + kSrc + "/data/ecoli_k12_mg1655.fa.gz | head -c " + std::to_string(bytes),
      Streams::kStdoutOnly);
  std::istringstream in(unzip.out);
  std::string genome, line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != '>') genome += line;
  }
  return genome;
}

void write_composition_table(const std::string& path, const std::string& genome, size_t offset,
                             size_t rows) {
  std::ofstream csv(path);
  csv << "sequence,label\n";
  for (size_t i = 0; i < rows; ++i) {
    auto w = genome.substr(offset + i * 60, 60);
    if (i % 2 == 1) {
      for (auto& c : w) c = c == 'A' ? 'C' : c;
    }
    csv << w << "," << (i % 2) << "\n";
  }
}

}  // namespace dnallm::testing
