// Streams the records of a FASTA/FASTQ file (plain, gzip, BGZF) to a sink a piece at a time,
// never holding a whole record: what packing a genome store reads (store_packer.hpp). FASTA is
// parsed from fixed-size blocks, so a chromosome written on one line costs no more memory than
// a wrapped one; FASTQ line by line (one read a line).
//
// The rules and messages are SequenceReader's (sequence_reader.hpp) with on_bad_record =
// "error" and lower-case kept: the same bases, the same Error(kBadData) naming the file, line,
// record and what was found. A test holds the two to the same output.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/config.hpp"

namespace dnallm::data {

// Called in order: begin_record, bases (one or more times, normalised A C G T N, lower-case
// kept: acgtn), end_record. A record has at least one base.
class SequenceSink {
 public:
  virtual ~SequenceSink() = default;
  virtual void begin_record(const std::string& name) = 0;
  virtual void bases(std::string_view bases) = 0;
  virtual void end_record() = 0;
};

struct StreamedFile {
  std::string format;   // "fasta" or "fastq"
  int64_t records = 0;  // records streamed
  uint64_t bases = 0;   // bases streamed
};

// Streams every record of `path` to `sink`. `format_hint` as SequenceReader's; `threads` > 1
// decompresses a BGZF file on that many threads. Throws Error(kBadData) on bad data (a file
// without records included).
StreamedFile stream_sequences(const std::string& path, cfg::DataFormat format_hint,
                              SequenceSink& sink, int threads = 1);

}  // namespace dnallm::data
