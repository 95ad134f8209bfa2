// Hostfiles in the OpenMPI style, one host per line:
//
//   # comment            (also after an entry)
//   node01 slots=4       slots defaults to 1
//   node02 slots=4 max_slots=8
//   node03:2             the MPICH "host:slots" spelling
//
// Blank lines and comments are skipped. A host listed twice, an unknown key, or a slot
// count that is not a positive integer is refused with the file and line.
#pragma once

#include <string>
#include <vector>

namespace dnallm::cluster {

struct HostSlots {
  std::string host;
  int slots = 1;      // processes to start on this host
  int max_slots = 0;  // 0: not given (no limit stated)
};

// Parses hostfile text; `origin` names it in messages ("hosts.txt"). Throws Error(kUsage)
// with "origin:line: what" on a malformed line.
std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& origin);

// Reads and parses `path`; an unreadable file is an Error(kUsage) naming it.
std::vector<HostSlots> load_hostfile(const std::string& path);

}  // namespace dnallm::cluster
