// The spelling tables' compile-time checks, and cfg::spelling() / cfg::dtype_of() of
// core/config.hpp.
#include <iterator>

#include "core/config/spellings.hpp"

namespace dnallm::config_detail {

// Each enumerator in its table exactly once: the enums count from 0 without gaps, so a table
// of E's size whose values are 0..n-1 in some order covers E.
template <class E>
constexpr bool covers_each_once(std::span<const Spelling<E>> table) {
  for (size_t i = 0; i < table.size(); ++i) {
    size_t seen = 0;
    for (const auto& s : table) seen += static_cast<size_t>(s.value) == i ? 1 : 0;
    if (seen != 1) return false;
  }
  return true;
}
static_assert(covers_each_once(spellings_of(Arch{})) && std::size(kArchSpellings) == 5);
static_assert(covers_each_once(spellings_of(Task{})) && std::size(kTaskSpellings) == 3);
static_assert(covers_each_once(spellings_of(Position{})) && std::size(kPositionSpellings) == 3);
static_assert(covers_each_once(spellings_of(Mlp{})) && std::size(kMlpSpellings) == 2);
static_assert(covers_each_once(spellings_of(AttnImplementation{})) &&
              std::size(kAttnImplementationSpellings) == 3);
static_assert(covers_each_once(spellings_of(Pooling{})) && std::size(kPoolingSpellings) == 2);
static_assert(covers_each_once(spellings_of(QuantizeBase{})) &&
              std::size(kQuantizeBaseSpellings) == 2);
static_assert(covers_each_once(spellings_of(TokenizerKind{})) &&
              std::size(kTokenizerKindSpellings) == 5);
static_assert(covers_each_once(spellings_of(DataFormat{})) && std::size(kDataFormatSpellings) == 6);
static_assert(covers_each_once(spellings_of(OnBadRecord{})) &&
              std::size(kOnBadRecordSpellings) == 2);
static_assert(covers_each_once(spellings_of(Sampling{})) && std::size(kSamplingSpellings) == 2);
static_assert(covers_each_once(spellings_of(NPolicy{})) && std::size(kNPolicySpellings) == 2);
static_assert(covers_each_once(spellings_of(BatchSize{})) && std::size(kBatchSizeSpellings) == 2);
static_assert(covers_each_once(spellings_of(LrScheduler{})) &&
              std::size(kLrSchedulerSpellings) == 3);
static_assert(covers_each_once(spellings_of(Precision{})) && std::size(kPrecisionSpellings) == 3);
static_assert(covers_each_once(spellings_of(SyncFree{})) && std::size(kSyncFreeSpellings) == 3);
static_assert(covers_each_once(spellings_of(cfg::Device{})) && std::size(kDeviceSpellings) == 3);
static_assert(covers_each_once(spellings_of(Backend{})) && std::size(kBackendSpellings) == 4);
static_assert(covers_each_once(spellings_of(AccumulateSync{})) &&
              std::size(kAccumulateSyncSpellings) == 2);
static_assert(covers_each_once(spellings_of(Compression{})) &&
              std::size(kCompressionSpellings) == 2);
static_assert(covers_each_once(spellings_of(BestMetric{})) && std::size(kBestMetricSpellings) == 6);
static_assert(covers_each_once(spellings_of(LogLevel{})) && std::size(kLogLevelSpellings) == 7);

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
