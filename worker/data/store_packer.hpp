// Packs FASTA/FASTQ files into a genome store (Note [Genome store format]): what
// `dnallm-data pack` runs.
//
// Streaming: the files are read a block at a time (sequence_stream.hpp) and written as they
// are read, so memory stays a few MB whatever the input (no contig is ever held whole).
// Atomic: everything is written into a hidden sibling directory ".<name>.packing-<pid>", the
// manifest last, every file fsync'ed, and the directory renamed to its name at the end; a pack
// that is killed or fails leaves no directory under the store's name (the hidden one is removed
// on failure, or left by a kill, never read as a store).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace dnallm::data {

struct PackOptions {
  cfg::DataFormat format = cfg::DataFormat::kAuto;  // of every input: auto, fasta, fastq
  bool replace = false;         // replace an existing store at the output (never another dir)
  int threads = 1;              // BGZF inputs: decompression threads
  double progress_seconds = 2;  // between progress lines (0: none)
};

struct PackStats {
  uint64_t bases = 0;
  uint64_t contigs = 0;
  uint64_t n_bases = 0;
  uint64_t lower_bases = 0;
  uint64_t files = 0;
  uint64_t store_bytes = 0;  // every file of the store, manifest included
  double seconds = 0;
  double mbases_per_s() const {
    return seconds > 0 ? static_cast<double>(bases) / seconds / 1e6 : 0;
  }
  double bytes_per_base() const {
    return bases > 0 ? static_cast<double>(store_bytes) / static_cast<double>(bases) : 0;
  }
};

// Packs `files` (already expanded: expand_data_files) into the store directory `out_dir`.
// Error(kUsage) when `out_dir` exists (unless `replace` and it is a store) or cannot be
// written; Error(kBadData) on bad input, naming the file and line. Logs progress lines.
PackStats pack_genome_store(const std::string& out_dir, const std::vector<std::string>& files,
                            const PackOptions& options);

}  // namespace dnallm::data
