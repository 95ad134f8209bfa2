#include "worker/data/compressed_stream.hpp"

#include <htslib/bgzf.h>

#include "core/error.hpp"

namespace dnallm::data {

BgzfLines::~BgzfLines() {
  if (fp != nullptr) bgzf_close(fp);
  free(line.s);
}

void check_bgzf_complete(BGZF* fp, const std::string& label) {
  if (bgzf_compression(fp) == 2 && bgzf_check_EOF(fp) == 0) {
    fail(ExitCode::kBadData,
         "{}: the BGZF file is truncated (its end-of-file block is missing); re-download or "
         "re-compress it",
         label);
  }
}

void fail_damaged_stream(const std::string& label, int64_t line, int errcode) {
  fail(ExitCode::kBadData,
       "{}: the compressed stream is truncated or corrupt after line {} (htslib error {}); "
       "re-download or re-compress the file",
       label, line, static_cast<unsigned>(errcode));
}

}  // namespace dnallm::data
