#include "worker/data/data_files.hpp"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "worker/data/genome_store_format.hpp"
#include "worker/data/sequence_reader.hpp"

namespace dnallm::data {
namespace {

namespace fs = std::filesystem;

bool is_glob(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

void add_glob(const std::string& pattern, const std::string& key, std::vector<std::string>& out) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
    globfree(&g);
    fail(ExitCode::kUsage,
         "{}: \"{}\" matches no file; check the pattern and the working directory", key, pattern);
  }
  if (rc != 0) {
    globfree(&g);
    fail(ExitCode::kUsage, "{}: cannot expand \"{}\" (glob error {})", key, pattern, rc);
  }
  for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);  // sorted by glob
  globfree(&g);
}

void add_directory(const std::string& dir, const std::string& key, std::vector<std::string>& out) {
  std::vector<std::string> found;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
  if (ec) fail(ExitCode::kUsage, "{}: cannot list directory {}: {}", key, dir, ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) fail(ExitCode::kUsage, "{}: cannot list directory {}: {}", key, dir, ec.message());
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file(ec)) continue;
    if (format_from_extension(name) != cfg::DataFormat::kAuto) found.push_back(it->path().string());
  }
  if (found.empty()) {
    fail(ExitCode::kUsage,
         "{}: directory {} holds no sequence or table file (.fa .fasta .fna .fq .fastq, "
         "gzip'ed or not, .csv .tsv .jsonl) and is no genome store",
         key, dir);
  }
  std::sort(found.begin(), found.end());
  out.insert(out.end(), found.begin(), found.end());
}

void add_entry(const std::string& entry, const std::string& key, std::vector<std::string>& out) {
  std::error_code ec;
  if (is_genome_store(entry)) {
    out.push_back(entry);
  } else if (fs::is_directory(entry, ec)) {
    add_directory(entry, key, out);
  } else if (is_glob(entry) && !fs::exists(entry, ec)) {
    add_glob(entry, key, out);
  } else {
    out.push_back(entry);  // a file; its reader names it if it cannot be opened
  }
}

void add_list(const std::string& list, const std::string& key, std::vector<std::string>& out) {
  std::ifstream in(list);
  if (!in) {
    fail(ExitCode::kUsage, "{}: cannot read the file list \"@{}\": {}", key, list, errno_string());
  }
  const fs::path base = fs::path(list).parent_path();
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos || line[b] == '#') continue;
    const size_t e = line.find_last_not_of(" \t");
    std::string entry = line.substr(b, e - b + 1);
    if (entry[0] == '@') {
      fail(ExitCode::kUsage, "{}: the file list {} names another list ({}); lists do not nest", key,
           list, entry);
    }
    if (fs::path(entry).is_relative()) entry = (base / entry).string();
    add_entry(entry, key, out);
  }
}

}  // namespace

std::vector<std::string> expand_data_files(const std::vector<std::string>& entries,
                                           const std::string& key) {
  std::vector<std::string> out;
  for (const auto& e : entries) {
    if (!e.empty() && e[0] == '@') {
      add_list(e.substr(1), key, out);
    } else {
      add_entry(e, key, out);
    }
  }
  const auto stores = std::count_if(out.begin(), out.end(), is_genome_store);
  if (stores > 0 && out.size() > 1) {
    fail(ExitCode::kUsage,
         "{}: a genome store must be the only entry, but the list holds {} entries with {} "
         "store(s); pack every file into one store instead",
         key, out.size(), stores);
  }
  return out;
}

}  // namespace dnallm::data
