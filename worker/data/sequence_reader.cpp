#include "worker/data/sequence_reader.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include <htslib/bgzf.h>

#include "core/error.hpp"
#include "worker/data/compressed_stream.hpp"

namespace dnallm::data {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Normalisation table: 0 = invalid, else the base to keep: upper-case, or with `keep_case` a
// lower-case base stays lower-case (acgtn; u -> t, lower-case IUPAC codes -> n).
std::array<char, 256> make_base_table(bool keep_case) {
  std::array<char, 256> t{};
  const std::string keep = "ACGTN";
  for (char c : keep) {
    const char lower = static_cast<char>(c - 'A' + 'a');
    t[static_cast<uint8_t>(c)] = c;
    t[static_cast<uint8_t>(lower)] = keep_case ? lower : c;
  }
  t['U'] = 'T';
  t['u'] = keep_case ? 't' : 'T';
  for (char c : std::string("RYSWKMBDHV")) {
    t[static_cast<uint8_t>(c)] = 'N';
    t[static_cast<uint8_t>(c - 'A' + 'a')] = keep_case ? 'n' : 'N';
  }
  return t;
}
const std::array<char, 256> kBaseTable = make_base_table(false);
const std::array<char, 256> kBaseTableKeepCase = make_base_table(true);

std::string printable(char c) {
  auto u = static_cast<unsigned char>(c);
  if (u >= 0x20 && u < 0x7F) return fmt::format("'{}'", c);
  return fmt::format("byte 0x{:02X}", u);
}

// The record name: the header without its marker, up to the first whitespace.
std::string header_name(const std::string& header) {
  std::string name = header.substr(1);
  size_t ws = name.find_first_of(" \t");
  if (ws != std::string::npos) name.resize(ws);
  return name;
}

}  // namespace

cfg::DataFormat format_from_extension(const std::string& path) {
  std::string p = path;
  std::transform(p.begin(), p.end(), p.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* z : {".gz", ".bgz", ".bgzf"}) {
    if (ends_with(p, z)) {
      p.resize(p.size() - std::string(z).size());
      break;
    }
  }
  for (const char* e : {".fa", ".fasta", ".fna", ".fas", ".ffn"}) {
    if (ends_with(p, e)) return cfg::DataFormat::kFasta;
  }
  for (const char* e : {".fq", ".fastq"}) {
    if (ends_with(p, e)) return cfg::DataFormat::kFastq;
  }
  if (ends_with(p, ".csv")) return cfg::DataFormat::kCsv;
  if (ends_with(p, ".tsv")) return cfg::DataFormat::kTsv;
  if (ends_with(p, ".jsonl") || ends_with(p, ".json")) return cfg::DataFormat::kJsonl;
  return cfg::DataFormat::kAuto;
}

std::string reverse_complement(const std::string& bases) {
  std::string out(bases.rbegin(), bases.rend());
  for (char& c : out) {
    switch (c) {
      case 'A':
        c = 'T';
        break;
      case 'T':
        c = 'A';
        break;
      case 'C':
        c = 'G';
        break;
      case 'G':
        c = 'C';
        break;
      default:
        c = 'N';
    }
  }
  return out;
}

// The file and a buffer of its decompressed bytes (Note [Long records]: lines are cut from it a
// part at a time).
struct SequenceReader::Handle {
  static constexpr size_t kBufferBytes = size_t{64} << 10;
  BGZF* fp = nullptr;
  std::vector<char> buffer = std::vector<char>(kBufferBytes);
  size_t begin = 0, end = 0;  // the unread bytes of `buffer`
  bool eof = false;
  ~Handle() {
    if (fp != nullptr) bgzf_close(fp);
  }
};

SequenceReader::SequenceReader(std::string path, cfg::DataFormat format_hint,
                               BadRecordPolicy policy)
    : path_(std::move(path)), policy_(policy), handle_(std::make_unique<Handle>()) {
  handle_->fp = bgzf_open(path_.c_str(), "r");
  if (handle_->fp == nullptr) {
    fail(ExitCode::kBadData, "cannot open sequence file {}: {}", path_, errno_string());
  }
  check_bgzf_complete(handle_->fp, path_);
  cfg::DataFormat f = format_hint;
  if (f == cfg::DataFormat::kAuto) f = format_from_extension(path_);
  if (f == cfg::DataFormat::kAuto) {
    // Sniff the first character.
    int c = bgzf_peek(handle_->fp);
    if (c == '@')
      f = cfg::DataFormat::kFastq;
    else if (c == '>')
      f = cfg::DataFormat::kFasta;
    else if (c == -1)
      f = cfg::DataFormat::kFasta;  // empty file: reported as "no records" by callers
    else {
      fail(ExitCode::kBadData,
           "{}: cannot tell the format: first character {} is neither '>' (FASTA) nor '@' (FASTQ); "
           "set data.format",
           path_, printable(static_cast<char>(c)));
    }
  }
  switch (f) {
    case cfg::DataFormat::kFasta:
      format_ = SequenceFormat::kFasta;
      break;
    case cfg::DataFormat::kFastq:
      format_ = SequenceFormat::kFastq;
      break;
    case cfg::DataFormat::kAuto:
    case cfg::DataFormat::kCsv:
    case cfg::DataFormat::kTsv:
    case cfg::DataFormat::kJsonl:
      fail(ExitCode::kUsage, "{}: format \"{}\" is not a sequence format (fasta, fastq)", path_,
           cfg::spelling(f));
  }
}

SequenceReader::~SequenceReader() = default;

bool SequenceReader::read_line(std::string& line) {
  return read_part(line, std::numeric_limits<size_t>::max()) >= 0;
}

int SequenceReader::read_part(std::string& part, size_t max) {
  Handle& h = *handle_;
  part.clear();
  for (;;) {
    if (h.begin == h.end) {
      const ssize_t n = h.eof ? 0 : bgzf_read(h.fp, h.buffer.data(), h.buffer.size());
      if (n < 0) fail_damaged_stream(path_, line_no_, h.fp->errcode);
      if (n == 0) {
        h.eof = true;
        if (part.empty() && !mid_line_) return -1;
        ++line_no_;  // the last line, without its '\n'
        mid_line_ = false;
        if (!part.empty() && part.back() == '\r') part.pop_back();
        return 1;
      }
      h.begin = 0;
      h.end = static_cast<size_t>(n);
    }
    const char* at = h.buffer.data() + h.begin;
    const size_t take = std::min(h.end - h.begin, max - part.size());
    if (const void* nl = std::memchr(at, '\n', take)) {
      const size_t n = static_cast<size_t>(static_cast<const char*>(nl) - at);
      part.append(at, n);
      h.begin += n + 1;
      ++line_no_;
      mid_line_ = false;
      if (!part.empty() && part.back() == '\r') part.pop_back();
      return 1;
    }
    part.append(at, take);
    h.begin += take;
    if (part.size() >= max) {
      // A '\r' that ends a part may end the line: it is read again with the next part.
      if (part.back() == '\r' && part.size() > 1) {
        part.pop_back();
        --h.begin;
      }
      mid_line_ = true;
      return 0;
    }
  }
}

void SequenceReader::bad(int64_t line, const std::string& record, const std::string& what) const {
  fail(ExitCode::kBadData, "{}:{}: record '{}': {}", path_, line, record, what);
}

size_t normalise_bases(std::string_view raw, std::string& out, bool keep_case) {
  const auto& table = keep_case ? kBaseTableKeepCase : kBaseTable;
  for (size_t i = 0; i < raw.size(); ++i) {
    char c = raw[i];
    if (c == ' ' || c == '\t') continue;
    char b = table[static_cast<uint8_t>(c)];
    if (b == 0) return i;
    out.push_back(b);
  }
  return std::string::npos;
}

std::string printable_char(char c) { return printable(c); }

bool SequenceReader::add_bases(const std::string& part, int64_t line, size_t column,
                               SequenceRecord& out, std::string& why) {
  const bool keep = static_cast<int64_t>(out.bases.size()) < max_bases_;
  std::string& into = keep ? out.bases : scratch_;
  if (!keep) scratch_.clear();
  const size_t before = into.size();
  const size_t bad_at = normalise_bases(part, into, keep_case_);
  if (bad_at != std::string::npos) {
    why = fmt::format("invalid character {} at line {} column {} (allowed: ACGTN, IUPAC codes)",
                      printable(part[bad_at]), line, column + bad_at + 1);
    return false;
  }
  out.length += static_cast<int64_t>(into.size() - before);
  if (keep && static_cast<int64_t>(out.bases.size()) > max_bases_) {
    out.bases.resize(static_cast<size_t>(max_bases_));
  }
  return true;
}

bool SequenceReader::next(SequenceRecord& out) {
  for (;;) {
    bool got = format_ == SequenceFormat::kFasta ? next_fasta(out) : next_fastq(out);
    if (!got) return false;
    if (out.length > 0 || policy_ == BadRecordPolicy::kError) {
      if (out.length == 0) bad(out.line, out.name, "empty sequence (no bases)");
      return true;
    }
    ++skipped_;  // empty record, skip policy
  }
}

bool SequenceReader::next_fasta(SequenceRecord& out) {
  std::string line;
  for (;;) {
    // Find the header.
    for (;;) {
      if (have_pending_) {
        line = std::move(pending_);
        have_pending_ = false;
      } else if (!read_line(line)) {
        return false;
      }
      if (line.empty()) continue;
      if (line[0] == '>') break;
      if (line[0] == ';') continue;  // old-style comment
      fail(ExitCode::kBadData, "{}:{}: expected a FASTA header starting with '>', found {}", path_,
           line_no_, printable(line[0]));
    }
    out.name = header_name(line);
    out.line = line_no_;
    out.bases.clear();
    out.length = 0;
    bool record_bad = false;
    std::string why;
    // The sequence lines a part at a time (Note [Long records]), up to the next header.
    for (;;) {
      const int64_t number = line_no_ + 1;
      int r = read_part(line, kLinePartBytes);
      if (r < 0) break;
      if (!line.empty() && line[0] == '>') {
        pending_ = std::move(line);
        for (std::string more; r == 0;) {
          r = read_part(more, kLinePartBytes);
          pending_ += more;
        }
        have_pending_ = true;
        break;
      }
      for (size_t column = 0;;) {
        if (!record_bad && !add_bases(line, number, column, out, why)) {
          if (policy_ == BadRecordPolicy::kError) bad(out.line, out.name, why);
          record_bad = true;
        }
        if (r == 1) break;
        column += line.size();
        r = read_part(line, kLinePartBytes);
      }
    }
    if (!record_bad) return true;
    ++skipped_;
  }
}

bool SequenceReader::next_fastq(SequenceRecord& out) {
  std::string header, part, plus;
  for (;;) {
    do {
      if (!read_line(header)) return false;
    } while (header.empty());
    int64_t header_line = line_no_;
    if (header[0] != '@') {
      fail(ExitCode::kBadData, "{}:{}: expected a FASTQ header starting with '@', found {}", path_,
           header_line, printable(header[0]));
    }
    out.name = header_name(header);
    out.line = header_line;
    out.bases.clear();
    out.length = 0;
    // The sequence and quality lines a part at a time (Note [Long records]).
    std::string why;
    bool ok = true;
    size_t seq_chars = 0;
    int r = read_part(part, kLinePartBytes);
    if (r < 0) bad(header_line, out.name, "file ends before the sequence line");
    for (;;) {
      if (ok) ok = add_bases(part, header_line + 1, seq_chars, out, why);
      seq_chars += part.size();
      if (r == 1) break;
      r = read_part(part, kLinePartBytes);
    }
    if (!read_line(plus) || plus.empty() || plus[0] != '+') {
      bad(line_no_, out.name, "expected the '+' separator line");
    }
    r = read_part(part, kLinePartBytes);
    if (r < 0) bad(line_no_, out.name, "file ends before the quality line");
    size_t qual_chars = part.size();
    while (r == 0) {
      r = read_part(part, kLinePartBytes);
      qual_chars += part.size();
    }
    if (ok && qual_chars != seq_chars) {
      bad(line_no_, out.name,
          fmt::format("quality has {} characters but the sequence has {}", qual_chars, seq_chars));
    }
    if (ok) return true;
    if (policy_ == BadRecordPolicy::kError) bad(header_line, out.name, why);
    ++skipped_;
  }
}

std::vector<SequenceRecord> read_sequences(const std::string& path, cfg::DataFormat format_hint,
                                           BadRecordPolicy policy, int64_t* skipped) {
  SequenceReader reader(path, format_hint, policy);
  std::vector<SequenceRecord> records;
  SequenceRecord rec;
  while (reader.next(rec)) records.push_back(std::move(rec));
  if (skipped != nullptr) *skipped = reader.skipped_records();
  return records;
}

}  // namespace dnallm::data
