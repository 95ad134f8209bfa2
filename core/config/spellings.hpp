// Internal to core/config/: Note [Config choices] (core/config.hpp): one table per enum,
// (value, spelling), from which the schema parses and prints every closed-choice key.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/enum_names.hpp"

namespace dnallm::config_detail {

// Note [Config choices] (core/config.hpp): one table per enum, (value, spelling) in the order
// of the enum, which is the order docs/config.md and the messages list the allowed spellings.
// Note [Enum tables] (core/enum_names.hpp): each is checked at compile time in spellings_of.
template <class E>
using Spelling = EnumName<E>;

using namespace cfg;  // NOLINT: the tables below name every enum

constexpr Spelling<Arch> kArchSpellings[] = {{Arch::kBert, "bert"},
                                             {Arch::kGpt, "gpt"},
                                             {Arch::kHyena, "hyena"},
                                             {Arch::kCaduceus, "caduceus"},
                                             {Arch::kCaduceusPs, "caduceus-ps"}};
constexpr Spelling<Task> kTaskSpellings[] = {{Task::kPretrain, "pretrain"},
                                             {Task::kClassification, "classification"},
                                             {Task::kRegression, "regression"}};
constexpr Spelling<Position> kPositionSpellings[] = {
    {Position::kLearned, "learned"}, {Position::kRotary, "rotary"}, {Position::kAlibi, "alibi"}};
constexpr Spelling<Mlp> kMlpSpellings[] = {{Mlp::kGelu, "gelu"}, {Mlp::kGeglu, "geglu"}};
constexpr Spelling<AttnImplementation> kAttnImplementationSpellings[] = {
    {AttnImplementation::kAuto, "auto"},
    {AttnImplementation::kSdpa, "sdpa"},
    {AttnImplementation::kEager, "eager"}};
constexpr Spelling<Pooling> kPoolingSpellings[] = {{Pooling::kCls, "cls"},
                                                   {Pooling::kMean, "mean"}};
constexpr Spelling<QuantizeBase> kQuantizeBaseSpellings[] = {{QuantizeBase::kNone, "none"},
                                                             {QuantizeBase::kNf4, "nf4"}};
constexpr Spelling<TokenizerKind> kTokenizerKindSpellings[] = {{TokenizerKind::kChar, "char"},
                                                               {TokenizerKind::kKmer, "kmer"},
                                                               {TokenizerKind::kNt, "nt"},
                                                               {TokenizerKind::kBpe, "bpe"},
                                                               {TokenizerKind::kHf, "hf"}};
constexpr Spelling<DataFormat> kDataFormatSpellings[] = {
    {DataFormat::kAuto, "auto"}, {DataFormat::kFasta, "fasta"}, {DataFormat::kFastq, "fastq"},
    {DataFormat::kCsv, "csv"},   {DataFormat::kTsv, "tsv"},     {DataFormat::kJsonl, "jsonl"}};
constexpr Spelling<OnBadRecord> kOnBadRecordSpellings[] = {{OnBadRecord::kError, "error"},
                                                           {OnBadRecord::kSkip, "skip"}};
constexpr Spelling<Sampling> kSamplingSpellings[] = {{Sampling::kRandom, "random"},
                                                     {Sampling::kTile, "tile"}};
constexpr Spelling<NPolicy> kNPolicySpellings[] = {{NPolicy::kSkip, "skip"},
                                                   {NPolicy::kMask, "mask"}};
constexpr Spelling<BatchSize> kBatchSizeSpellings[] = {{BatchSize::kMicroBatch, ""},
                                                       {BatchSize::kAuto, "auto"}};
constexpr Spelling<LrScheduler> kLrSchedulerSpellings[] = {{LrScheduler::kConstant, "constant"},
                                                           {LrScheduler::kLinear, "linear"},
                                                           {LrScheduler::kCosine, "cosine"}};
constexpr Spelling<Precision> kPrecisionSpellings[] = {
    {Precision::kFp32, "fp32"}, {Precision::kBf16, "bf16"}, {Precision::kFp16, "fp16"}};
constexpr Spelling<SyncFree> kSyncFreeSpellings[] = {
    {SyncFree::kAuto, "auto"}, {SyncFree::kOn, "on"}, {SyncFree::kOff, "off"}};
constexpr Spelling<cfg::Device> kDeviceSpellings[] = {
    {cfg::Device::kAuto, "auto"}, {cfg::Device::kCpu, "cpu"}, {cfg::Device::kCuda, "cuda"}};
constexpr Spelling<Backend> kBackendSpellings[] = {{Backend::kAuto, "auto"},
                                                   {Backend::kGloo, "gloo"},
                                                   {Backend::kMpi, "mpi"},
                                                   {Backend::kNccl, "nccl"}};
constexpr Spelling<AccumulateSync> kAccumulateSyncSpellings[] = {{AccumulateSync::kLast, "last"},
                                                                 {AccumulateSync::kEvery, "every"}};
constexpr Spelling<Compression> kCompressionSpellings[] = {{Compression::kZstd, "zstd"},
                                                           {Compression::kNone, "none"}};
constexpr Spelling<BestMetric> kBestMetricSpellings[] = {
    {BestMetric::kNone, "none"},
    {BestMetric::kLoss, "loss"},
    {BestMetric::kBitsPerBase, "bits_per_base"},
    {BestMetric::kAccuracy, "accuracy"},
    {BestMetric::kMcc, "mcc"},
    {BestMetric::kF1, "f1"}};
constexpr Spelling<LogLevel> kLogLevelSpellings[] = {
    {LogLevel::kTrace, "trace"}, {LogLevel::kDebug, "debug"}, {LogLevel::kInfo, "info"},
    {LogLevel::kWarn, "warn"},   {LogLevel::kError, "error"}, {LogLevel::kCritical, "critical"},
    {LogLevel::kOff, "off"}};

// The table of E (overloads: the argument only selects it), checked to list each value of E
// once, in order.
constexpr const auto& spellings_of(Arch) {
  static_assert(lists_each_in_order<Arch::kCaduceusPs>(kArchSpellings));
  return kArchSpellings;
}
constexpr const auto& spellings_of(Task) {
  static_assert(lists_each_in_order<Task::kRegression>(kTaskSpellings));
  return kTaskSpellings;
}
constexpr const auto& spellings_of(Position) {
  static_assert(lists_each_in_order<Position::kAlibi>(kPositionSpellings));
  return kPositionSpellings;
}
constexpr const auto& spellings_of(Mlp) {
  static_assert(lists_each_in_order<Mlp::kGeglu>(kMlpSpellings));
  return kMlpSpellings;
}
constexpr const auto& spellings_of(AttnImplementation) {
  static_assert(lists_each_in_order<AttnImplementation::kEager>(kAttnImplementationSpellings));
  return kAttnImplementationSpellings;
}
constexpr const auto& spellings_of(Pooling) {
  static_assert(lists_each_in_order<Pooling::kMean>(kPoolingSpellings));
  return kPoolingSpellings;
}
constexpr const auto& spellings_of(QuantizeBase) {
  static_assert(lists_each_in_order<QuantizeBase::kNf4>(kQuantizeBaseSpellings));
  return kQuantizeBaseSpellings;
}
constexpr const auto& spellings_of(TokenizerKind) {
  static_assert(lists_each_in_order<TokenizerKind::kHf>(kTokenizerKindSpellings));
  return kTokenizerKindSpellings;
}
constexpr const auto& spellings_of(DataFormat) {
  static_assert(lists_each_in_order<DataFormat::kJsonl>(kDataFormatSpellings));
  return kDataFormatSpellings;
}
constexpr const auto& spellings_of(OnBadRecord) {
  static_assert(lists_each_in_order<OnBadRecord::kSkip>(kOnBadRecordSpellings));
  return kOnBadRecordSpellings;
}
constexpr const auto& spellings_of(Sampling) {
  static_assert(lists_each_in_order<Sampling::kTile>(kSamplingSpellings));
  return kSamplingSpellings;
}
constexpr const auto& spellings_of(NPolicy) {
  static_assert(lists_each_in_order<NPolicy::kMask>(kNPolicySpellings));
  return kNPolicySpellings;
}
constexpr const auto& spellings_of(BatchSize) {
  static_assert(lists_each_in_order<BatchSize::kAuto>(kBatchSizeSpellings));
  return kBatchSizeSpellings;
}
constexpr const auto& spellings_of(LrScheduler) {
  static_assert(lists_each_in_order<LrScheduler::kCosine>(kLrSchedulerSpellings));
  return kLrSchedulerSpellings;
}
constexpr const auto& spellings_of(Precision) {
  static_assert(lists_each_in_order<Precision::kFp16>(kPrecisionSpellings));
  return kPrecisionSpellings;
}
constexpr const auto& spellings_of(SyncFree) {
  static_assert(lists_each_in_order<SyncFree::kOff>(kSyncFreeSpellings));
  return kSyncFreeSpellings;
}
constexpr const auto& spellings_of(cfg::Device) {
  static_assert(lists_each_in_order<cfg::Device::kCuda>(kDeviceSpellings));
  return kDeviceSpellings;
}
constexpr const auto& spellings_of(Backend) {
  static_assert(lists_each_in_order<Backend::kNccl>(kBackendSpellings));
  return kBackendSpellings;
}
constexpr const auto& spellings_of(AccumulateSync) {
  static_assert(lists_each_in_order<AccumulateSync::kEvery>(kAccumulateSyncSpellings));
  return kAccumulateSyncSpellings;
}
constexpr const auto& spellings_of(Compression) {
  static_assert(lists_each_in_order<Compression::kNone>(kCompressionSpellings));
  return kCompressionSpellings;
}
constexpr const auto& spellings_of(BestMetric) {
  static_assert(lists_each_in_order<BestMetric::kF1>(kBestMetricSpellings));
  return kBestMetricSpellings;
}
constexpr const auto& spellings_of(LogLevel) {
  static_assert(lists_each_in_order<LogLevel::kOff>(kLogLevelSpellings));
  return kLogLevelSpellings;
}

template <class E>
const char* spelling_in_table(E v) {
  return name_of(spellings_of(v), v, "?");  // "?": unreachable for a valid value
}

template <class E>
std::optional<E> parse_spelling(const std::string& text) {
  return value_named(spellings_of(E{}), text);
}

template <class E>
std::vector<std::string> spellings_list() {
  std::vector<std::string> out;
  for (const auto& s : spellings_of(E{})) out.emplace_back(s.name);
  return out;
}

// checkpoint.resume: "auto", "none" or the path; and back.
std::string resume_text(const Resume& r);
Resume parse_resume(const std::string& text);

}  // namespace dnallm::config_detail
