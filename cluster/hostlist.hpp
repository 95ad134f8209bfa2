// Slurm hostlist expressions: "gpu[01-04,07]", "a[1-2]-b[3-4]", "host1,host2[5-6]".
//
// Grammar (what Slurm's scontrol accepts for the common cases):
//   list    = item { "," item }            commas inside brackets do not split items
//   item    = { text | bracket }           non-empty; text is any char but , [ ]
//   bracket = "[" range { "," range } "]"
//   range   = digits [ "-" digits ]        lo <= hi; the width of lo is kept ("01" -> 01..)
// Several brackets in one item expand as a cartesian product, leftmost bracket slowest.
// Pure functions; no I/O.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace dnallm::cluster {

// Refuse to expand lists longer than this (a typo like "n[0-99999999]" would eat memory).
inline constexpr std::size_t kMaxHostlistSize = 1u << 20;

// Expands `list` into host names, in order, duplicates kept. An empty or all-blank list
// gives an empty vector. Throws Error(kUsage) naming the 1-based character position of a
// malformed part (unbalanced or nested bracket, empty item, non-digit bound, lo > hi).
std::vector<std::string> expand_hostlist(const std::string& list);

// The inverse, for messages: runs of hosts that differ only in a trailing number of the
// same digit count are folded into one bracket, keeping order ("n01,n02,n03,n07" ->
// "n[01-03,07]"). expand_hostlist(compress_hostlist(h)) == h for every h.
std::string compress_hostlist(const std::vector<std::string>& hosts);

}  // namespace dnallm::cluster
