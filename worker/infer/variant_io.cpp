#include "worker/infer/variant_io.hpp"

#include <htslib/faidx.h>
#include <htslib/hts.h>
#include <htslib/vcf.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>

#include "core/error.hpp"

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

}  // namespace

ReferenceGenome::ReferenceGenome(const std::string& path)
    : path_(path), index_(std::make_unique<Index>()) {
  std::error_code ec;
  DNALLM_CHECK(std::filesystem::is_regular_file(path, ec), ExitCode::kBadData,
               "--reference {}: no such file", path);
  hts_set_log_level(HTS_LOG_OFF);
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
  ~Handle() {
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
  h_->hdr = bcf_hdr_read(h_->fp);
  DNALLM_CHECK(h_->hdr != nullptr, ExitCode::kBadData,
               "--vcf {}: no VCF header (the ##fileformat and #CHROM lines): not a VCF file", path);
  h_->rec = bcf_init();
}

VcfReader::~VcfReader() = default;

bool VcfReader::next(VcfRecord& out) {
  const int r = bcf_read(h_->fp, h_->hdr, h_->rec);
  if (r == -1) return false;
  ++records_;
  DNALLM_CHECK(r == 0 && h_->rec->errcode == 0, ExitCode::kBadData,
               "--vcf {}: record {} is damaged (htslib error {}): repair the file", path_, records_,
               r == 0 ? h_->rec->errcode : r);
  bcf_unpack(h_->rec, BCF_UN_STR);
  out.chrom = bcf_hdr_id2name(h_->hdr, h_->rec->rid);
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
