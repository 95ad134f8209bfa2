// Internal to core/config/: Note [Config choices] (core/config.hpp): one table per enum,
// (value, spelling), from which the schema parses and prints every closed-choice key.
#pragma once

#include <cstddef>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace dnallm::config_detail {

// Note [Config choices] (core/config.hpp): one table per enum, (value, spelling) in the order
// docs/config.md and the messages list the allowed spellings.
template <class E>
struct Spelling {
  E value;
  const char* text;
};

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

// Each enumerator in its table exactly once: the enums count from 0 without gaps, so a table
// of E's size whose values are 0..n-1 in some order covers E.
template <class Table>
constexpr bool covers_each_once(const Table& table) {
  for (size_t i = 0; i < std::size(table); ++i) {
    size_t seen = 0;
    for (const auto& s : table) seen += static_cast<size_t>(s.value) == i ? 1 : 0;
    if (seen != 1) return false;
  }
  return true;
}

// `kTable`, the table of an enum of `kCount` enumerators, checked at compile time to name each
// of them exactly once (a table that misses one or repeats one does not compile).
template <size_t kCount, const auto& kTable>
constexpr auto checked_table() {
  static_assert(std::size(kTable) == kCount && covers_each_once(kTable));
  return std::span(kTable);
}

// The table of E (overloads: the argument only selects it).
constexpr std::span<const Spelling<Arch>> spellings_of(Arch) {
  return checked_table<5, kArchSpellings>();
}
constexpr std::span<const Spelling<Task>> spellings_of(Task) {
  return checked_table<3, kTaskSpellings>();
}
constexpr std::span<const Spelling<Position>> spellings_of(Position) {
  return checked_table<3, kPositionSpellings>();
}
constexpr std::span<const Spelling<Mlp>> spellings_of(Mlp) {
  return checked_table<2, kMlpSpellings>();
}
constexpr std::span<const Spelling<AttnImplementation>> spellings_of(AttnImplementation) {
  return checked_table<3, kAttnImplementationSpellings>();
}
constexpr std::span<const Spelling<Pooling>> spellings_of(Pooling) {
  return checked_table<2, kPoolingSpellings>();
}
constexpr std::span<const Spelling<QuantizeBase>> spellings_of(QuantizeBase) {
  return checked_table<2, kQuantizeBaseSpellings>();
}
constexpr std::span<const Spelling<TokenizerKind>> spellings_of(TokenizerKind) {
  return checked_table<5, kTokenizerKindSpellings>();
}
constexpr std::span<const Spelling<DataFormat>> spellings_of(DataFormat) {
  return checked_table<6, kDataFormatSpellings>();
}
constexpr std::span<const Spelling<OnBadRecord>> spellings_of(OnBadRecord) {
  return checked_table<2, kOnBadRecordSpellings>();
}
constexpr std::span<const Spelling<Sampling>> spellings_of(Sampling) {
  return checked_table<2, kSamplingSpellings>();
}
constexpr std::span<const Spelling<NPolicy>> spellings_of(NPolicy) {
  return checked_table<2, kNPolicySpellings>();
}
constexpr std::span<const Spelling<BatchSize>> spellings_of(BatchSize) {
  return checked_table<2, kBatchSizeSpellings>();
}
constexpr std::span<const Spelling<LrScheduler>> spellings_of(LrScheduler) {
  return checked_table<3, kLrSchedulerSpellings>();
}
constexpr std::span<const Spelling<Precision>> spellings_of(Precision) {
  return checked_table<3, kPrecisionSpellings>();
}
constexpr std::span<const Spelling<SyncFree>> spellings_of(SyncFree) {
  return checked_table<3, kSyncFreeSpellings>();
}
constexpr std::span<const Spelling<cfg::Device>> spellings_of(cfg::Device) {
  return checked_table<3, kDeviceSpellings>();
}
constexpr std::span<const Spelling<Backend>> spellings_of(Backend) {
  return checked_table<4, kBackendSpellings>();
}
constexpr std::span<const Spelling<AccumulateSync>> spellings_of(AccumulateSync) {
  return checked_table<2, kAccumulateSyncSpellings>();
}
constexpr std::span<const Spelling<Compression>> spellings_of(Compression) {
  return checked_table<2, kCompressionSpellings>();
}
constexpr std::span<const Spelling<BestMetric>> spellings_of(BestMetric) {
  return checked_table<6, kBestMetricSpellings>();
}
constexpr std::span<const Spelling<LogLevel>> spellings_of(LogLevel) {
  return checked_table<7, kLogLevelSpellings>();
}

template <class E>
const char* spelling_in_table(E v) {
  for (const auto& s : spellings_of(v)) {
    if (s.value == v) return s.text;
  }
  return "?";  // unreachable for a valid value: see covers_each_once
}

template <class E>
std::optional<E> parse_spelling(const std::string& text) {
  for (const auto& s : spellings_of(E{})) {
    if (text == s.text) return s.value;
  }
  return std::nullopt;
}

template <class E>
std::vector<std::string> spellings_list() {
  std::vector<std::string> out;
  for (const auto& s : spellings_of(E{})) out.emplace_back(s.text);
  return out;
}

// checkpoint.resume: "auto", "none" or the path; and back.
std::string resume_text(const Resume& r);
Resume parse_resume(const std::string& text);

}  // namespace dnallm::config_detail
