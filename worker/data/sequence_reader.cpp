#include "worker/data/sequence_reader.hpp"

#include <algorithm>
#include <array>

#include <htslib/bgzf.h>
#include <htslib/kstring.h>

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

struct SequenceReader::Handle {
  BGZF* fp = nullptr;
  kstring_t line = {0, 0, nullptr};
  ~Handle() {
    if (fp != nullptr) bgzf_close(fp);
    free(line.s);
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
  int r = bgzf_getline(handle_->fp, '\n', &handle_->line);
  if (r == -1) return false;
  if (r < -1) fail_damaged_stream(path_, line_no_, handle_->fp->errcode);
  ++line_no_;
  line.assign(handle_->line.s, handle_->line.l);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return true;
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

bool SequenceReader::normalise(const std::string& raw, int64_t line, std::string& out,
                               std::string& why) const {
  size_t bad_at = normalise_bases(raw, out, keep_case_);
  if (bad_at == std::string::npos) return true;
  why = fmt::format("invalid character {} at line {} column {} (allowed: ACGTN, IUPAC codes)",
                    printable(raw[bad_at]), line, bad_at + 1);
  return false;
}

bool SequenceReader::next(SequenceRecord& out) {
  for (;;) {
    bool got = format_ == SequenceFormat::kFasta ? next_fasta(out) : next_fastq(out);
    if (!got) return false;
    if (!out.bases.empty() || policy_ == BadRecordPolicy::kError) {
      if (out.bases.empty()) bad(out.line, out.name, "empty sequence (no bases)");
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
    bool record_bad = false;
    std::string why;
    while (read_line(line)) {
      if (!line.empty() && line[0] == '>') {
        pending_ = std::move(line);
        have_pending_ = true;
        break;
      }
      if (!record_bad && !normalise(line, line_no_, out.bases, why)) {
        if (policy_ == BadRecordPolicy::kError) bad(out.line, out.name, why);
        record_bad = true;
      }
    }
    if (!record_bad) return true;
    ++skipped_;
  }
}

bool SequenceReader::next_fastq(SequenceRecord& out) {
  std::string header, seq, plus, qual;
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
    if (!read_line(seq)) bad(header_line, out.name, "file ends before the sequence line");
    if (!read_line(plus) || plus.empty() || plus[0] != '+') {
      bad(line_no_, out.name, "expected the '+' separator line");
    }
    if (!read_line(qual)) bad(line_no_, out.name, "file ends before the quality line");
    std::string why;
    bool ok = normalise(seq, header_line + 1, out.bases, why);
    if (ok && qual.size() != seq.size()) {
      bad(line_no_, out.name,
          fmt::format("quality has {} characters but the sequence has {}", qual.size(),
                      seq.size()));
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
