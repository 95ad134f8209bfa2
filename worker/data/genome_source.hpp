// Where a GenomeDataset's bases live: the records of FASTA/FASTQ files read into memory, or a
// packed genome store memory-mapped from disk (genome_store.hpp). GenomeDataset draws its
// windows from either through this interface, so the sample stream is the same for the same
// genome whichever holds it (Note [Genome storage], genome_dataset.hpp).
//
// Every method is const and thread-safe: loader threads call them concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dnallm::data {

class GenomeSource {
 public:
  virtual ~GenomeSource() = default;
  virtual size_t record_count() const = 0;
  virtual int64_t record_length(size_t record) const = 0;
  virtual std::string record_name(size_t record) const = 0;
  // Appends bases [pos, pos + len) of `record` to `out`, upper-case A C G T N (soft-masked
  // bases upper-cased, as SequenceReader reads them). Requires the range within the record.
  virtual void read(size_t record, int64_t pos, int64_t len, std::string& out) const = 0;
  // The number of N in [pos, pos + len) of `record`; may stop counting once it exceeds `limit`
  // (then any value > limit).
  virtual int64_t count_n(size_t record, int64_t pos, int64_t len, int64_t limit) const = 0;
  // The files the records came from, in data.train_files' order (a store: the files it was
  // packed from, in the order it lists them), for data.weights (Note [Genome weights],
  // genome_dataset.hpp). Records in memory without files: one file named "".
  virtual size_t file_count() const { return 1; }
  virtual size_t record_file(size_t /*record*/) const { return 0; }
  virtual std::string file_name(size_t /*file*/) const { return ""; }
};

}  // namespace dnallm::data
