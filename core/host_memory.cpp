#include "core/host_memory.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

namespace dnallm {

double mem_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  double kb = 0;
  while (meminfo >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024.0;
  }
  return 0.0;
}

double available_memory_bytes() {
  double avail = mem_available_bytes();
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), current("/sys/fs/cgroup/memory.current");
  std::string max_text;
  double used = 0;
  if (max_file >> max_text && max_text != "max" && current >> used) {
    const double headroom = std::max(0.0, std::strtod(max_text.c_str(), nullptr) - used);
    avail = avail > 0 ? std::min(avail, headroom) : headroom;
  }
  return avail;
}

double peak_rss_mb() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

}  // namespace dnallm
