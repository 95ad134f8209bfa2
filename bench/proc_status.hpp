// A figure of /proc/<pid>/status, as the memory benchmarks report it (dnallm-bench-data,
// dnallm-bench-hyena, dnallm-coordinator-load).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace dnallm::bench {

// The "<key>:" line of /proc/<pid>/status in MiB ("self": this process), e.g. VmHWM (the peak
// resident set) or VmRSS (the resident set now); -1 where there is none (a process that exited,
// a zombie until its parent reaps it, has no VmRSS line).
inline double proc_status_mb(const std::string& key, const std::string& pid = "self") {
  std::ifstream in("/proc/" + pid + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream fields(line.substr(key.size() + 1));
      double kb = 0;
      fields >> kb;
      return kb / 1024.0;
    }
  }
  return -1;
}

}  // namespace dnallm::bench
