#include "worker/data/sequence_stream.hpp"

#include <cstring>
#include <memory>
#include <vector>

#include <htslib/bgzf.h>
#include <htslib/kstring.h>

#include "core/error.hpp"
#include "worker/data/compressed_stream.hpp"
#include "worker/data/sequence_reader.hpp"

namespace dnallm::data {
namespace {

constexpr size_t kBlockBytes = size_t{1} << 20;  // read from the decompressor at a time
constexpr size_t kFlushBases = size_t{1} << 16;  // bases handed to the sink at a time

using Bgzf = BgzfLines;

std::string header_name(const std::string& header) {
  std::string name = header.substr(1);
  size_t ws = name.find_first_of(" \t");
  if (ws != std::string::npos) name.resize(ws);
  return name;
}

// FASTA from blocks: a state machine over lines that may span blocks.
class FastaParser {
 public:
  FastaParser(const std::string& path, SequenceSink& sink, StreamedFile& stats)
      : path_(path), sink_(sink), stats_(stats) {}

  void feed(const char* p, size_t n) {
    size_t i = 0;
    while (i < n) {
      if (line_start_) start_line(p[i]);
      const void* nl = std::memchr(p + i, '\n', n - i);
      const size_t j = nl != nullptr ? static_cast<size_t>(static_cast<const char*>(nl) - p) : n;
      segment(std::string_view(p + i, j - i), j < n);
      if (j < n) end_line();
      i = j + 1;
    }
  }

  int64_t lines_done() const { return line_ - 1; }

  void finish() {
    if (!line_start_) end_line();
    if (in_record_) end_record();
  }

 private:
  enum class Kind { kPreamble, kHeader, kSequence };

  void start_line(char c) {
    line_start_ = false;
    column_ = 0;
    text_.clear();
    if (c == '>') {
      if (in_record_) end_record();
      kind_ = Kind::kHeader;
      record_line_ = line_;
    } else {
      kind_ = in_record_ ? Kind::kSequence : Kind::kPreamble;
    }
  }

  void segment(std::string_view s, bool line_ends) {
    if (kind_ != Kind::kSequence) {
      // Headers and lines before the first header are short; a preamble line is only looked
      // at for its first character.
      if (kind_ == Kind::kHeader || text_.size() < 16) text_.append(s);
      return;
    }
    if (cr_pending_ && !s.empty()) bad_char('\r', column_ - 1);
    cr_pending_ = false;
    const size_t kept = s.size();
    if (!s.empty() && s.back() == '\r') {
      s.remove_suffix(1);  // a Windows line end, or a '\r' that the next block shows is not one
      cr_pending_ = !line_ends;
    }
    const size_t bad = normalise_bases(s, out_, /*keep_case=*/true);
    if (bad != std::string::npos) bad_char(s[bad], column_ + static_cast<int64_t>(bad));
    column_ += static_cast<int64_t>(kept);
    if (out_.size() >= kFlushBases) flush();
  }

  void end_line() {
    if (kind_ == Kind::kHeader) {
      if (!text_.empty() && text_.back() == '\r') text_.pop_back();
      name_ = header_name(text_);
      in_record_ = true;
      any_bases_ = false;
      sink_.begin_record(name_);
    } else if (kind_ == Kind::kPreamble) {
      if (!text_.empty() && text_.back() == '\r' && text_.size() == 1) text_.clear();
      if (!text_.empty() && text_[0] != ';') {
        fail(ExitCode::kBadData, "{}:{}: expected a FASTA header starting with '>', found {}",
             path_, line_, printable_char(text_[0]));
      }
    }
    cr_pending_ = false;
    line_start_ = true;
    ++line_;
  }

  void flush() {
    if (out_.empty()) return;
    any_bases_ = true;
    stats_.bases += out_.size();
    sink_.bases(out_);
    out_.clear();
  }

  void end_record() {
    flush();
    if (!any_bases_) {
      fail(ExitCode::kBadData, "{}:{}: record '{}': empty sequence (no bases)", path_, record_line_,
           name_);
    }
    sink_.end_record();
    ++stats_.records;
    in_record_ = false;
  }

  [[noreturn]] void bad_char(char c, int64_t column) const {
    fail(ExitCode::kBadData,
         "{}:{}: record '{}': invalid character {} at line {} column {} (allowed: ACGTN, IUPAC "
         "codes)",
         path_, record_line_, name_, printable_char(c), line_, column + 1);
  }

  const std::string& path_;
  SequenceSink& sink_;
  StreamedFile& stats_;
  bool line_start_ = true;
  bool in_record_ = false;
  bool any_bases_ = false;
  bool cr_pending_ = false;
  Kind kind_ = Kind::kPreamble;
  int64_t line_ = 1;  // 1-based number of the current line
  int64_t record_line_ = 0;
  int64_t column_ = 0;  // characters of the current line before this segment
  std::string text_;    // the header (or the start of a preamble line) so far
  std::string name_;
  std::string out_;
};

void stream_fasta(const std::string& path, Bgzf& f, SequenceSink& sink, StreamedFile& stats) {
  FastaParser parser(path, sink, stats);
  std::vector<char> block(kBlockBytes);
  for (;;) {
    const ssize_t n = bgzf_read(f.fp, block.data(), block.size());
    if (n < 0) fail_damaged_stream(path, parser.lines_done(), f.fp->errcode);
    if (n == 0) break;
    parser.feed(block.data(), static_cast<size_t>(n));
  }
  parser.finish();
}

// FASTQ: SequenceReader::next_fastq's rules, a line at a time.
void stream_fastq(const std::string& path, Bgzf& f, SequenceSink& sink, StreamedFile& stats) {
  int64_t line_no = 0;
  auto read_line = [&](std::string& line) {
    const int r = bgzf_getline(f.fp, '\n', &f.line);
    if (r == -1) return false;
    if (r < -1) fail_damaged_stream(path, line_no, f.fp->errcode);
    ++line_no;
    line.assign(f.line.s, f.line.l);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return true;
  };
  std::string header, seq, plus, qual, out;
  for (;;) {
    do {
      if (!read_line(header)) return;
    } while (header.empty());
    const int64_t header_line = line_no;
    if (header[0] != '@') {
      fail(ExitCode::kBadData, "{}:{}: expected a FASTQ header starting with '@', found {}", path,
           header_line, printable_char(header[0]));
    }
    const std::string name = header_name(header);
    auto bad = [&](int64_t line, const std::string& what) {
      fail(ExitCode::kBadData, "{}:{}: record '{}': {}", path, line, name, what);
    };
    if (!read_line(seq)) bad(header_line, "file ends before the sequence line");
    if (!read_line(plus) || plus.empty() || plus[0] != '+')
      bad(line_no, "expected the '+' separator line");
    if (!read_line(qual)) bad(line_no, "file ends before the quality line");
    out.clear();
    const size_t at = normalise_bases(seq, out, /*keep_case=*/true);
    if (at != std::string::npos) {
      bad(header_line,
          fmt::format("invalid character {} at line {} column {} (allowed: ACGTN, IUPAC codes)",
                      printable_char(seq[at]), header_line + 1, at + 1));
    }
    if (qual.size() != seq.size()) {
      bad(line_no, fmt::format("quality has {} characters but the sequence has {}", qual.size(),
                               seq.size()));
    }
    if (out.empty()) bad(header_line, "empty sequence (no bases)");
    sink.begin_record(name);
    sink.bases(out);
    sink.end_record();
    ++stats.records;
    stats.bases += out.size();
  }
}

}  // namespace

StreamedFile stream_sequences(const std::string& path, cfg::DataFormat format_hint,
                              SequenceSink& sink, int threads) {
  // The format as SequenceReader decides it (hint, extension, first character), with its
  // messages for a file that cannot be opened or told apart.
  const SequenceFormat format = SequenceReader(path, format_hint).format();
  StreamedFile stats;
  stats.format = format == SequenceFormat::kFasta ? "fasta" : "fastq";
  Bgzf f;
  f.fp = bgzf_open(path.c_str(), "r");
  if (f.fp == nullptr)
    fail(ExitCode::kBadData, "cannot open sequence file {}: {}", path, errno_string());
  check_bgzf_complete(f.fp, path);
  if (threads > 1 && bgzf_compression(f.fp) == 2) bgzf_mt(f.fp, threads, 256);
  if (format == SequenceFormat::kFasta) {
    stream_fasta(path, f, sink, stats);
  } else {
    stream_fastq(path, f, sink, stats);
  }
  if (stats.records == 0) {
    fail(ExitCode::kBadData, "{}: no sequence records (an empty file?); remove it from the inputs",
         path);
  }
  return stats;
}

}  // namespace dnallm::data
