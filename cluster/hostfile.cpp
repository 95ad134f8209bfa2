#include "cluster/hostfile.hpp"

#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/parse_int.hpp"

namespace dnallm::cluster {
namespace {

int parse_count(const std::string& value, const std::string& origin, int line,
                const std::string& key) {
  const auto v = parse_whole_int(value);
  if (!v || *v < 1 || *v > 1000000) {
    fail(ExitCode::kUsage, "{}:{}: {}='{}' is not a positive integer", origin, line, key, value);
  }
  return static_cast<int>(*v);
}

}  // namespace

std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& origin) {
  std::vector<HostSlots> out;
  std::istringstream in(text);
  std::string raw;
  int line_no = 0;
  while (std::getline(in, raw)) {
    ++line_no;
    std::string line = raw.substr(0, raw.find('#'));
    std::istringstream words(line);
    std::string host;
    if (!(words >> host)) continue;  // blank or comment only

    HostSlots entry;
    auto colon = host.find(':');
    if (colon != std::string::npos) {
      entry.slots = parse_count(host.substr(colon + 1), origin, line_no, "slots");
      host = host.substr(0, colon);
    }
    if (host.empty() || host.find('=') != std::string::npos) {
      fail(ExitCode::kUsage, "{}:{}: expected a host name first, got '{}'", origin, line_no, raw);
    }
    entry.host = host;
    std::string word;
    while (words >> word) {
      auto eq = word.find('=');
      if (eq == std::string::npos) {
        fail(ExitCode::kUsage, "{}:{}: expected key=value after the host, got '{}'", origin,
             line_no, word);
      }
      std::string key = word.substr(0, eq);
      std::string value = word.substr(eq + 1);
      if (key == "slots") {
        entry.slots = parse_count(value, origin, line_no, key);
      } else if (key == "max_slots" || key == "max-slots") {
        entry.max_slots = parse_count(value, origin, line_no, key);
      } else {
        fail(ExitCode::kUsage, "{}:{}: unknown key '{}'; use slots=N or max_slots=N", origin,
             line_no, key);
      }
    }
    if (entry.max_slots != 0 && entry.slots > entry.max_slots) {
      fail(ExitCode::kUsage, "{}:{}: slots={} exceeds max_slots={}", origin, line_no, entry.slots,
           entry.max_slots);
    }
    for (const auto& prev : out) {
      if (prev.host == entry.host) {
        fail(ExitCode::kUsage, "{}:{}: host '{}' is listed twice; give it one line with slots=N",
             origin, line_no, entry.host);
      }
    }
    out.push_back(std::move(entry));
  }
  return out;
}

std::vector<HostSlots> load_hostfile(const std::string& path) {
  std::ifstream f(path);
  if (!f) {
    fail(ExitCode::kUsage, "cannot read hostfile '{}': {}", path, errno_string());
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse_hostfile(ss.str(), path);
}

}  // namespace dnallm::cluster
