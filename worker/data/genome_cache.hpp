// Large FASTA/FASTQ training files packed once into a cached genome store.
//
// Note [Genome cache]: reading FASTA into memory costs every rank about 2 bytes and 12 ns a base
// at every start (Note [Genome storage], genome_dataset.hpp); a store costs neither. Genome
// files estimated to hold more than data.pack_threshold_bases (default 1 Gbase; 0: never) are
// packed once into a store and read from it, this run and every later one while the files are
// unchanged:
//   - estimate: a file's bytes, times 4 when it is gzip or BGZF (DNA compresses 3.5-4.3x), so a
//     compressed genome is not read to learn its size;
//   - where: `<cache_dir>/<name>` when data.cache_dir is set, else beside the first file,
//     else `$XDG_CACHE_HOME/dnallm-dist/genomes/<name>` (or ~/.cache): the first writable;
//     `<name>` is the first file's name + ".dnallm-store" (one file), or the first file's name,
//     the number of others and a hash of every path (several files);
//   - reused when the store's manifest lists exactly these files (absolute paths), each with the
//     size and modification time it has now; otherwise packed again in place (a process still
//     mapping the old store keeps reading it);
//   - several ranks (or jobs) at once: the first takes an flock on `<name>.lock` and packs, the
//     others wait on it, then reuse what it packed; the store is renamed into place whole
//     (pack_genome_store), so no process reads a half-written store;
//   - not with data.on_bad_record = "skip" (packing refuses a bad record): the files are read
//     into memory as before, with a warning.
// The log says which store is used or packed, and why.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace dnallm::data {

struct GenomeCacheOptions {
  int64_t threshold_bases = 1'000'000'000;  // data.pack_threshold_bases; <= 0: never pack
  std::string cache_dir;                    // data.cache_dir; "": beside the data
  cfg::DataFormat format = cfg::DataFormat::kAuto;
  bool skip_bad_records = false;
  std::string key = "data.train_files";  // names the files in messages
};

// The bases `files` are estimated to hold (Note [Genome cache]).
int64_t estimate_genome_bases(const std::vector<std::string>& files);

// The genome store to read `files` from, packing it when needed; "" to read them into memory
// (under the threshold, or skip_bad_records). Error(kUsage) when no candidate place is writable;
// packing errors as pack_genome_store's (a bad record: kBadData naming file and line).
std::string cached_genome_store(const std::vector<std::string>& files,
                                const GenomeCacheOptions& options);

}  // namespace dnallm::data
