// The inputs of dnallm-infer variants (Note [Zero-shot variant effects], variants.hpp): the
// reference genome through htslib's faidx (plain FASTA, or bgzip-compressed with its .fai and
// .gzi) and the VCF through htslib's VCF reader (plain or bgzip; a BCF file too). Torch-free.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dnallm::infer {

class ReferenceGenome {
 public:
  // Opens `path` and its index (made beside a plain FASTA when missing; rebuilt when stale:
  // Note [Stale indexes], fasta_index.hpp). Error(kBadData) for a gzip file that is not bgzip
  // (what to run to fix it), a stale or damaged index that cannot be rebuilt, a missing file.
  explicit ReferenceGenome(const std::string& path);
  ~ReferenceGenome();
  ReferenceGenome(const ReferenceGenome&) = delete;
  ReferenceGenome& operator=(const ReferenceGenome&) = delete;
  // The contig's length, -1 when the reference has no such contig.
  int64_t length(const std::string& contig) const;
  // Bases [begin, end) of `contig`, upper-cased, or with `keep_case` lower-case (soft-masked)
  // bases kept lower-case; anything but A C G T is N (n).
  std::string fetch(const std::string& contig, int64_t begin, int64_t end,
                    bool keep_case = false) const;
  int64_t contigs() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  struct Index;
  std::unique_ptr<Index> index_;
};

struct VcfRecord {
  std::string chrom;
  int64_t pos = 0;  // 0-based
  std::string ref;
  std::vector<std::string> alts;
};

class VcfReader {
 public:
  // Error(kBadData) naming the file when it cannot be opened or its header read.
  explicit VcfReader(const std::string& path);
  ~VcfReader();
  VcfReader(const VcfReader&) = delete;
  VcfReader& operator=(const VcfReader&) = delete;
  // The next record; false at the end. Error(kBadData) naming the line and the field for a
  // malformed record (Note [VCF lines] in variant_io.cpp), and for a truncated or damaged
  // compressed file. A contig without a ##contig line is read, with a warning (as bcftools).
  bool next(VcfRecord& out);

 private:
  // Reads the next record into the handle's bcf1_t; false at the end.
  bool read_record();
  std::string path_;
  struct Handle;
  std::unique_ptr<Handle> h_;
  int64_t records_ = 0;
};

// [begin, end) of `window` bases centred on `pos` inside [0, length).
std::pair<int64_t, int64_t> centred_window(int64_t pos, int64_t window, int64_t length);

// A single-base A/C/G/T allele.
bool is_snv_allele(const std::string& allele);

}  // namespace dnallm::infer
