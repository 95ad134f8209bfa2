#include "worker/infer/variant_io.hpp"

#include <htslib/bgzf.h>
#include <htslib/faidx.h>
#include <htslib/hts.h>
#include <htslib/kseq.h>
#include <htslib/vcf.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "worker/data/compressed_stream.hpp"
#include "worker/infer/fasta_index.hpp"

namespace dnallm::infer {

struct ReferenceGenome::Index {
  faidx_t* fai = nullptr;
  ~Index() {
    if (fai != nullptr) fai_destroy(fai);
  }
};

namespace {

bool gzip_magic(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  unsigned char m[2] = {0, 0};
  const size_t n = std::fread(m, 1, 2, f);
  std::fclose(f);
  return n == 2 && m[0] == 0x1f && m[1] == 0x8b;
}

// Note [VCF lines]: htslib reads a line of 3 columns as a record without alleles, a POS of
// "abc", "0" or "-5" as position 0 and "12x" as 12, and a line cut by a truncated file as a
// record; each would be blamed on the reference or scored at the wrong place. A line is
// checked here first, naming the file, the line, the field and what is wrong.
void check_vcf_line(std::string_view text, const std::string& path, int64_t line) {
  std::vector<std::string_view> fields;
  for (size_t begin = 0; fields.size() < 5;) {
    const size_t tab = text.find('\t', begin);
    fields.push_back(text.substr(begin, tab == std::string_view::npos ? tab : tab - begin));
    if (tab == std::string_view::npos) break;
    begin = tab + 1;
  }
  DNALLM_CHECK(!text.empty(), ExitCode::kBadData,
               "--vcf {}:{}: an empty line where a record should be: remove it", path, line);
  DNALLM_CHECK(fields.size() >= 5, ExitCode::kBadData,
               "--vcf {}:{}: {} tab-separated column{} where a record has at least CHROM POS ID "
               "REF ALT (of the 8 columns of a VCF record): is the line cut, or separated by "
               "spaces?",
               path, line, fields.size(), fields.size() == 1 ? "" : "s");
  DNALLM_CHECK(!fields[0].empty(), ExitCode::kBadData, "--vcf {}:{}: CHROM is empty", path, line);
  const std::string_view pos = fields[1];
  const bool digits =
      !pos.empty() && pos.size() <= 15 &&
      std::all_of(pos.begin(), pos.end(), [](char c) { return c >= '0' && c <= '9'; });
  DNALLM_CHECK(digits, ExitCode::kBadData,
               "--vcf {}:{}: POS \"{}\" is not a position (a whole number from 1)", path, line,
               pos);
  DNALLM_CHECK(std::stoll(std::string(pos)) >= 1, ExitCode::kBadData,
               "--vcf {}:{}: POS 0 (a telomere) names no base to score", path, line);
  DNALLM_CHECK(!fields[3].empty() && fields[3] != ".", ExitCode::kBadData,
               "--vcf {}:{}: REF is empty or \".\" (it holds the reference bases at POS)", path,
               line);
  DNALLM_CHECK(!fields[4].empty(), ExitCode::kBadData, "--vcf {}:{}: ALT is empty (\".\" for none)",
               path, line);
}

// What htslib read past, as bcftools does: an undeclared contig or INFO/FORMAT tag.
constexpr int kReadAnyway = BCF_ERR_CTG_UNDEF | BCF_ERR_TAG_UNDEF;

// htslib's BCF_ERR_* bits of a record (or a negative return code) in words.
std::string htslib_error(int code) {
  if (code < 0) return fmt::format("htslib error {}", code);
  static const std::pair<int, const char*> kBits[] = {
      {BCF_ERR_CTG_UNDEF, "an undeclared contig"},
      {BCF_ERR_TAG_UNDEF, "an undeclared tag"},
      {BCF_ERR_NCOLS, "a wrong number of columns"},
      {BCF_ERR_LIMITS, "a value past htslib's limits"},
      {BCF_ERR_CHAR, "an invalid character"},
      {BCF_ERR_CTG_INVALID, "an invalid contig name"},
      {BCF_ERR_TAG_INVALID, "an invalid tag"}};
  std::string out;
  for (const auto& [bit, what] : kBits) {
    if ((code & bit) != 0) out += (out.empty() ? "" : ", ") + std::string(what);
  }
  return fmt::format("{} (htslib error {})", out.empty() ? "unknown" : out, code);
}

}  // namespace

ReferenceGenome::ReferenceGenome(const std::string& path)
    : path_(path), index_(std::make_unique<Index>()) {
  std::error_code ec;
  DNALLM_CHECK(std::filesystem::is_regular_file(path, ec), ExitCode::kBadData,
               "--reference {}: no such file", path);
  hts_set_log_level(HTS_LOG_OFF);
  check_fasta_index(path, "--reference " + path);  // Note [Stale indexes]
  index_->fai = fai_load3(path.c_str(), nullptr, nullptr, FAI_CREATE);
  if (index_->fai != nullptr) return;
  if (gzip_magic(path)) {
    fail(ExitCode::kBadData,
         "--reference {}: a gzip file faidx cannot index (plain gzip, not bgzip, or its .fai "
         "or .gzi is missing or unwritable): recompress it with `zcat {} | bgzip > ref.fa.gz` "
         "and index it with `samtools faidx ref.fa.gz` (or give the uncompressed FASTA)",
         path, path);
  }
  fail(ExitCode::kBadData,
       "--reference {}: faidx cannot index it (not a FASTA file, lines of unequal length in a "
       "record, or {}.fai unwritable and missing)",
       path, path);
}

ReferenceGenome::~ReferenceGenome() = default;

int64_t ReferenceGenome::length(const std::string& contig) const {
  if (faidx_has_seq(index_->fai, contig.c_str()) == 0) return -1;
  return faidx_seq_len(index_->fai, contig.c_str());
}

int64_t ReferenceGenome::contigs() const { return faidx_nseq(index_->fai); }

std::string ReferenceGenome::fetch(const std::string& contig, int64_t begin, int64_t end,
                                   bool keep_case) const {
  hts_pos_t len = 0;
  char* s = faidx_fetch_seq64(index_->fai, contig.c_str(), begin, end - 1, &len);
  DNALLM_CHECK(s != nullptr && len == end - begin, ExitCode::kBadData,
               "--reference {}: cannot read {}:{}-{} (a damaged file or index)", path_, contig,
               begin + 1, end);
  std::string out(s, static_cast<size_t>(len));
  std::free(s);
  for (auto& c : out) {
    const bool lower = std::islower(static_cast<unsigned char>(c)) != 0;
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (c != 'A' && c != 'C' && c != 'G' && c != 'T') c = 'N';
    if (lower && keep_case) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

struct VcfReader::Handle {
  htsFile* fp = nullptr;
  bcf_hdr_t* hdr = nullptr;
  bcf1_t* rec = nullptr;
  kstring_t line = {0, 0, nullptr};
  bool text = false;                 // VCF (read a line at a time), else BCF
  std::set<std::string> undeclared;  // contigs without a ##contig line, warned once each
  bool warned_tags = false;          // INFO/FORMAT tags without a header line, warned once
  ~Handle() {
    free(line.s);
    if (rec != nullptr) bcf_destroy(rec);
    if (hdr != nullptr) bcf_hdr_destroy(hdr);
    if (fp != nullptr) hts_close(fp);
  }
};

VcfReader::VcfReader(const std::string& path) : path_(path), h_(std::make_unique<Handle>()) {
  std::error_code ec;
  DNALLM_CHECK(std::filesystem::is_regular_file(path, ec), ExitCode::kBadData,
               "--vcf {}: no such file", path);
  hts_set_log_level(HTS_LOG_OFF);
  h_->fp = hts_open(path.c_str(), "r");
  DNALLM_CHECK(h_->fp != nullptr, ExitCode::kBadData, "--vcf {}: cannot open it", path);
  const htsFormat& format = h_->fp->format;
  if (format.compression == bgzf) data::check_bgzf_complete(h_->fp->fp.bgzf, "--vcf " + path);
  h_->hdr = bcf_hdr_read(h_->fp);
  DNALLM_CHECK(h_->hdr != nullptr, ExitCode::kBadData,
               "--vcf {}: no VCF header (the ##fileformat and #CHROM lines): not a VCF file", path);
  h_->text = format.format == vcf;
  h_->rec = bcf_init();
}

VcfReader::~VcfReader() = default;

bool VcfReader::read_record() {
  if (!h_->text) {
    const int r = bcf_read(h_->fp, h_->hdr, h_->rec);
    if (r == -1) return false;
    ++records_;
    DNALLM_CHECK(r == 0 && (h_->rec->errcode & ~kReadAnyway) == 0, ExitCode::kBadData,
                 "--vcf {}: BCF record {} is damaged ({}): repair the file", path_, records_,
                 htslib_error(r == 0 ? h_->rec->errcode : r));
    return true;
  }
  const int r = hts_getline(h_->fp, KS_SEP_LINE, &h_->line);
  const int64_t line = h_->fp->lineno;
  if (h_->fp->format.compression != no_compression) {
    // A line cut by the damage comes back before the error does.
    BGZF* z = h_->fp->fp.bgzf;
    if (r < -1 || z->errcode != 0)
      data::fail_damaged_stream("--vcf " + path_, line - 1, z->errcode);
  }
  DNALLM_CHECK(r >= -1, ExitCode::kBadData, "--vcf {}: cannot read line {}: {}", path_, line,
               std::strerror(errno));
  if (r == -1) return false;
  ++records_;
  check_vcf_line(std::string_view(h_->line.s, h_->line.l), path_, line);
  const int parsed = vcf_parse(&h_->line, h_->hdr, h_->rec);
  DNALLM_CHECK(parsed == 0 && (h_->rec->errcode & ~kReadAnyway) == 0, ExitCode::kBadData,
               "--vcf {}:{}: htslib cannot parse the record ({}): repair the line", path_, line,
               htslib_error(parsed == 0 ? h_->rec->errcode : parsed));
  return true;
}

bool VcfReader::next(VcfRecord& out) {
  if (!read_record()) return false;
  bcf_unpack(h_->rec, BCF_UN_STR);
  out.chrom = bcf_hdr_id2name(h_->hdr, h_->rec->rid);
  // As bcftools: a contig or a tag the header does not declare is read, with a warning.
  if ((h_->rec->errcode & BCF_ERR_CTG_UNDEF) != 0 && h_->undeclared.insert(out.chrom).second) {
    spdlog::warn(
        "--vcf {}: contig \"{}\" has no ##contig line in the header; read as bcftools "
        "reads it",
        path_, out.chrom);
  }
  if ((h_->rec->errcode & BCF_ERR_TAG_UNDEF) != 0 && !h_->warned_tags) {
    h_->warned_tags = true;
    spdlog::warn(
        "--vcf {}: INFO or FORMAT tags without a ##INFO/##FORMAT line in the header (first at "
        "record {}); read as bcftools reads them (this command reads neither)",
        path_, records_);
  }
  out.pos = h_->rec->pos;
  out.alts.clear();
  out.ref = h_->rec->n_allele > 0 ? h_->rec->d.allele[0] : "";
  for (int i = 1; i < h_->rec->n_allele; ++i) out.alts.emplace_back(h_->rec->d.allele[i]);
  for (auto& c : out.ref) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (auto& a : out.alts) {
    for (auto& c : a) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return true;
}

std::pair<int64_t, int64_t> centred_window(int64_t pos, int64_t window, int64_t length) {
  window = std::min(window, length);
  int64_t begin = std::max<int64_t>(0, pos - window / 2);
  const int64_t end = std::min(length, begin + window);
  begin = std::max<int64_t>(0, end - window);
  return {begin, end};
}

bool is_snv_allele(const std::string& a) {
  return a.size() == 1 && (a[0] == 'A' || a[0] == 'C' || a[0] == 'G' || a[0] == 'T');
}

}  // namespace dnallm::infer
