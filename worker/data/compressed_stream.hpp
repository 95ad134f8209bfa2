// What a reader of a compressed text file (FASTA/FASTQ, VCF) says when the file lost data:
// one check and one message for every reader (issue 57: the VCF reader had none).
#pragma once

#include <cstdint>
#include <string>

#include <htslib/kstring.h>

struct BGZF;

namespace dnallm::data {

// An open BGZF (plain, gzip or BGZF) file and the line buffer bgzf_getline fills; both freed
// when it goes (the FASTQ stream, the BED reader).
struct BgzfLines {
  BGZF* fp = nullptr;
  kstring_t line = {0, 0, nullptr};
  BgzfLines() = default;
  BgzfLines(const BgzfLines&) = delete;
  BgzfLines& operator=(const BgzfLines&) = delete;
  ~BgzfLines();
};

// Error(kBadData) "<label>: the BGZF file is truncated ..." when `fp` is BGZF without its
// end-of-file block. A BGZF file cut at a block boundary decompresses cleanly; only the missing
// end-of-file block (28 bytes) tells that data is lost. Plain and gzip streams pass.
void check_bgzf_complete(BGZF* fp, const std::string& label);

// Error(kBadData): a read of `label` failed after `line` lines (htslib's BGZF error bits
// `errcode`): a gzip stream cut short or corrupt, or an I/O error.
[[noreturn]] void fail_damaged_stream(const std::string& label, int64_t line, int errcode);

}  // namespace dnallm::data
