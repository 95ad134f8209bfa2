// FASTA and FASTQ readers over htslib's BGZF layer, which reads plain text, plain gzip and
// BGZF transparently. Multi-record files, multi-line FASTA, Windows line ends.
//
// Validation (at the boundary, before anything is kept): sequence letters are upper-cased;
// A C G T N are kept, U becomes T, IUPAC ambiguity codes (R Y S W K M B D H V) become N.
// Anything else (digits, '-', '*', ...) is an invalid character. A record with no bases,
// a FASTQ record whose quality length differs from its sequence, a missing header, and a
// truncated or corrupt gzip stream are errors too. Every error is Error(kBadData) naming
// the file, the line, the record and what was found.
//
// FASTQ records are four lines (header, sequence, '+', quality); multi-line FASTQ is not
// supported.
//
// Note [Long records]: sequence and quality lines are read a part at a time (at most
// kLinePartBytes), so a chromosome on one line costs no more than its part. With
// set_max_bases(n) a record keeps its first n bases only; the rest are read, validated and
// counted (SequenceRecord::length) but not kept: what a program that cuts every record (embed,
// predict, dnallm-eval --max-bases) holds of a 200 MB record is what it uses (issue 57: embed
// held about 12 bytes a base of it).
//
// on_bad_record = kSkip drops a bad record (invalid character, empty) and counts it;
// a damaged file (truncated gzip, broken FASTQ structure) is always an error because
// what follows cannot be trusted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.hpp"

namespace dnallm::data {

// data.on_bad_record (kError, kSkip).
using BadRecordPolicy = cfg::OnBadRecord;

enum class SequenceFormat { kFasta, kFastq };

struct SequenceRecord {
  std::string name;    // header up to the first whitespace
  std::string bases;   // validated, upper-case A C G T N (lower-case too with set_keep_case)
  int64_t line = 0;    // 1-based line of the header
  int64_t length = 0;  // bases in the record: more than bases.size() when set_max_bases cut it
};

// The most bytes of a line a reader holds at once (Note [Long records]).
inline constexpr size_t kLinePartBytes = size_t{1} << 20;

// Streams records from one file. Not thread-safe; one reader per thread.
class SequenceReader {
 public:
  // format_hint: auto (by extension, then by the first character), fasta, fastq; a table
  // format is Error(kUsage). Throws Error(kBadData) if the file cannot be opened.
  SequenceReader(std::string path, cfg::DataFormat format_hint = cfg::DataFormat::kAuto,
                 BadRecordPolicy policy = BadRecordPolicy::kError);
  ~SequenceReader();
  SequenceReader(const SequenceReader&) = delete;
  SequenceReader& operator=(const SequenceReader&) = delete;

  // Reads the next good record into `out`; false at end of file.
  bool next(SequenceRecord& out);

  int64_t skipped_records() const { return skipped_; }
  // Keep lower-case (soft-masked) bases lower-case, for a tokenizer that reads them as its
  // reference does (Note [Sequence codec]); off: every base upper-case.
  void set_keep_case(bool on) { keep_case_ = on; }
  // Note [Long records]: keep at most `n` (>= 0) bases of each record from the next one on.
  void set_max_bases(int64_t n) { max_bases_ = n; }
  SequenceFormat format() const { return format_; }
  const std::string& path() const { return path_; }

 private:
  bool read_line(std::string& line);  // false at EOF; throws on a stream error
  // The next part of the current line, at most `max` bytes, into `part`: 1 when the line ends
  // with it (its '\n', and a '\r' before that, dropped), 0 when more of the line follows, -1 at
  // the end of the file. Throws on a stream error.
  int read_part(std::string& part, size_t max);
  // Validates the bases of `part` (from column `column` of line `line`), keeps them in `out` up
  // to max_bases_ and counts them in out.length; false (with `why`) on an invalid character.
  bool add_bases(const std::string& part, int64_t line, size_t column, SequenceRecord& out,
                 std::string& why);
  bool next_fasta(SequenceRecord& out);
  bool next_fastq(SequenceRecord& out);
  [[noreturn]] void bad(int64_t line, const std::string& record, const std::string& what) const;

  std::string path_;
  SequenceFormat format_ = SequenceFormat::kFasta;
  BadRecordPolicy policy_;
  bool keep_case_ = false;
  int64_t max_bases_ = INT64_MAX;
  bool mid_line_ = false;  // the last read_part returned 0
  std::string scratch_;    // bases read and not kept
  struct Handle;
  std::unique_ptr<Handle> handle_;
  int64_t line_no_ = 0;
  bool have_pending_ = false;
  std::string pending_;  // a header line read ahead by the FASTA parser
  int64_t skipped_ = 0;
};

// Reads every record of `path` (see SequenceReader). `skipped` receives the count of
// skipped records when non-null.
std::vector<SequenceRecord> read_sequences(const std::string& path, cfg::DataFormat format_hint,
                                           BadRecordPolicy policy, int64_t* skipped = nullptr);

// Format from the file name: ".fa/.fasta/.fna/.fas[.gz|.bgz]" fasta, ".fq/.fastq" fastq,
// ".csv" ".tsv" ".jsonl"/".json"; kAuto when unknown.
cfg::DataFormat format_from_extension(const std::string& path);

// Appends the normalised bases of `raw` to `out` (upper case; U -> T; IUPAC codes -> N;
// spaces and tabs ignored; with `keep_case` lower-case bases stay lower-case: a c g t, u -> t,
// IUPAC -> n). Returns the index in `raw` of the first invalid character, or
// std::string::npos when all are valid (then `out` holds every base).
size_t normalise_bases(std::string_view raw, std::string& out, bool keep_case = false);
// "'x'" for printable characters, "byte 0xNN" otherwise (messages).
std::string printable_char(char c);

// Reverse complement of upper-case A C G T N.
std::string reverse_complement(const std::string& bases);

}  // namespace dnallm::data
