// cfg::spelling() and cfg::dtype_of() of core/config.hpp, and the resume spellings.
#include "core/config/spellings.hpp"

namespace dnallm::config_detail {

std::string resume_text(const Resume& r) {
  switch (r.kind) {
    case Resume::Kind::kAuto:
      return "auto";
    case Resume::Kind::kNone:
      return "none";
    case Resume::Kind::kPath:
      return r.path;
  }
  return "auto";
}

Resume parse_resume(const std::string& text) {
  if (text == "auto") return Resume::automatic();
  if (text == "none") return Resume::none();
  return Resume::from_path(text);
}

}  // namespace dnallm::config_detail

namespace dnallm {

using config_detail::resume_text;
using config_detail::spelling_in_table;

namespace cfg {

const char* spelling(Arch v) { return spelling_in_table(v); }
const char* spelling(Task v) { return spelling_in_table(v); }
const char* spelling(Position v) { return spelling_in_table(v); }
const char* spelling(Mlp v) { return spelling_in_table(v); }
const char* spelling(AttnImplementation v) { return spelling_in_table(v); }
const char* spelling(Pooling v) { return spelling_in_table(v); }
const char* spelling(QuantizeBase v) { return spelling_in_table(v); }
const char* spelling(TokenizerKind v) { return spelling_in_table(v); }
const char* spelling(DataFormat v) { return spelling_in_table(v); }
const char* spelling(OnBadRecord v) { return spelling_in_table(v); }
const char* spelling(Sampling v) { return spelling_in_table(v); }
const char* spelling(NPolicy v) { return spelling_in_table(v); }
const char* spelling(BatchSize v) { return spelling_in_table(v); }
const char* spelling(LrScheduler v) { return spelling_in_table(v); }
const char* spelling(Precision v) { return spelling_in_table(v); }
const char* spelling(SyncFree v) { return spelling_in_table(v); }
const char* spelling(Device v) { return spelling_in_table(v); }
const char* spelling(Backend v) { return spelling_in_table(v); }
const char* spelling(AccumulateSync v) { return spelling_in_table(v); }
const char* spelling(Compression v) { return spelling_in_table(v); }
const char* spelling(BestMetric v) { return spelling_in_table(v); }
const char* spelling(LogLevel v) { return spelling_in_table(v); }
std::string spelling(const Resume& v) { return resume_text(v); }

DType dtype_of(Precision v) {
  switch (v) {
    case Precision::kFp32:
      return DType::kFloat32;
    case Precision::kBf16:
      return DType::kBFloat16;
    case Precision::kFp16:
      return DType::kFloat16;
  }
  return DType::kFloat32;
}

}  // namespace cfg

}  // namespace dnallm
