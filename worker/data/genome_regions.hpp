// Intervals of a genome read from BED files: where pre-training windows may come from
// (data.train_regions), which ones are held out for evaluation (data.eval_regions), and which
// are never used (data.exclude_regions). Note [Genome regions] (genome_dataset.hpp) says how a
// GenomeDataset combines them.
//
// BED as UCSC defines it: tab- or space-separated `name start end [...]`, 0-based half-open
// [start, end); `#`, `track` and `browser` lines and blank lines are skipped; the columns after
// the third are ignored (HyenaDNA's and Caduceus's hg38 split, `chr start end split`, is one
// file for each split: docs/data.md). Plain, gzip or BGZF. Overlapping and adjacent intervals of
// a name are merged.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dnallm::data {

struct Interval {
  int64_t begin = 0, end = 0;  // [begin, end), begin < end
  bool operator==(const Interval& o) const { return begin == o.begin && end == o.end; }
};

struct GenomeRegions {
  std::string origin;  // the BED file, for messages
  // Per record name: sorted, disjoint, non-adjacent intervals; with the line that named each
  // record first (a message about an unknown name points at it).
  std::map<std::string, std::vector<Interval>> intervals;
  std::map<std::string, int64_t> first_line;
};

// Reads a BED file. Error(kBadData) naming the file and line on a malformed line (fewer than 3
// columns, a start or end that is not a non-negative integer, start >= end) or when it holds no
// interval; Error(kBadData) when it cannot be opened or is cut short.
GenomeRegions read_bed(const std::string& path);

// [begin, end) intersected with `set` (sorted, disjoint), in order.
std::vector<Interval> intersect(const std::vector<Interval>& pieces,
                                const std::vector<Interval>& set);
// `pieces` less `set` (both sorted, disjoint), in order.
std::vector<Interval> subtract(const std::vector<Interval>& pieces,
                               const std::vector<Interval>& set);

}  // namespace dnallm::data
