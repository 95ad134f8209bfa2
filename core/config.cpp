// TOML configuration: a table of key descriptors drives parsing, validation, printing and
// the "did you mean" suggestions, so a key is declared in exactly one place.
#include "core/config.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <span>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>
#include <xxhash.h>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"

namespace dnallm {
namespace {

enum class Kind { kInt, kDouble, kBool, kString, kStringList, kStageList };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kInt:
      return "an integer";
    case Kind::kDouble:
      return "a number";
    case Kind::kBool:
      return "true or false";
    case Kind::kString:
      return "a string";
    case Kind::kStringList:
      return "a list of strings";
    case Kind::kStageList:
      return "a list of {steps = N, seq_len = N} tables";
  }
  return "?";
}

constexpr double kInf = std::numeric_limits<double>::infinity();

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

// The table of E (overloads: the argument only selects it).
constexpr std::span<const Spelling<Arch>> spellings_of(Arch) { return kArchSpellings; }
constexpr std::span<const Spelling<Task>> spellings_of(Task) { return kTaskSpellings; }
constexpr std::span<const Spelling<Position>> spellings_of(Position) { return kPositionSpellings; }
constexpr std::span<const Spelling<Mlp>> spellings_of(Mlp) { return kMlpSpellings; }
constexpr std::span<const Spelling<AttnImplementation>> spellings_of(AttnImplementation) {
  return kAttnImplementationSpellings;
}
constexpr std::span<const Spelling<Pooling>> spellings_of(Pooling) { return kPoolingSpellings; }
constexpr std::span<const Spelling<QuantizeBase>> spellings_of(QuantizeBase) {
  return kQuantizeBaseSpellings;
}
constexpr std::span<const Spelling<TokenizerKind>> spellings_of(TokenizerKind) {
  return kTokenizerKindSpellings;
}
constexpr std::span<const Spelling<DataFormat>> spellings_of(DataFormat) {
  return kDataFormatSpellings;
}
constexpr std::span<const Spelling<OnBadRecord>> spellings_of(OnBadRecord) {
  return kOnBadRecordSpellings;
}
constexpr std::span<const Spelling<Sampling>> spellings_of(Sampling) { return kSamplingSpellings; }
constexpr std::span<const Spelling<NPolicy>> spellings_of(NPolicy) { return kNPolicySpellings; }
constexpr std::span<const Spelling<BatchSize>> spellings_of(BatchSize) {
  return kBatchSizeSpellings;
}
constexpr std::span<const Spelling<LrScheduler>> spellings_of(LrScheduler) {
  return kLrSchedulerSpellings;
}
constexpr std::span<const Spelling<Precision>> spellings_of(Precision) {
  return kPrecisionSpellings;
}
constexpr std::span<const Spelling<SyncFree>> spellings_of(SyncFree) { return kSyncFreeSpellings; }
constexpr std::span<const Spelling<cfg::Device>> spellings_of(cfg::Device) {
  return kDeviceSpellings;
}
constexpr std::span<const Spelling<Backend>> spellings_of(Backend) { return kBackendSpellings; }
constexpr std::span<const Spelling<AccumulateSync>> spellings_of(AccumulateSync) {
  return kAccumulateSyncSpellings;
}
constexpr std::span<const Spelling<Compression>> spellings_of(Compression) {
  return kCompressionSpellings;
}
constexpr std::span<const Spelling<BestMetric>> spellings_of(BestMetric) {
  return kBestMetricSpellings;
}
constexpr std::span<const Spelling<LogLevel>> spellings_of(LogLevel) { return kLogLevelSpellings; }

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

// One configuration key. `ptr` returns the field inside a Config; the constraints are
// checked where the value is read, so the message can name the file and line.
struct KeyDesc {
  const char* section;
  const char* name;
  Kind kind;
  std::function<void*(Config&)> ptr;
  double min = -kInf;  // numbers: inclusive bounds
  double max = kInf;
  std::vector<std::string> allowed = {};  // strings: allowed values (empty: any)
  const char* doc = "";                   // the key's meaning (Markdown, docs/config.md)
  // Strings held as another type (an enum, cfg::Resume): the field as its spelling, and the
  // field set from a spelling (one of `allowed` when that is not empty). Empty: a std::string.
  std::function<std::string(Config&)> get_text = {};
  std::function<void(Config&, const std::string&)> set_text = {};

  std::string full() const { return std::string(section) + "." + name; }
};

template <class T>
constexpr Kind kind_of();
template <>
constexpr Kind kind_of<int64_t>() {
  return Kind::kInt;
}
template <>
constexpr Kind kind_of<double>() {
  return Kind::kDouble;
}
template <>
constexpr Kind kind_of<bool>() {
  return Kind::kBool;
}
template <>
constexpr Kind kind_of<std::string>() {
  return Kind::kString;
}
template <>
constexpr Kind kind_of<std::vector<std::string>>() {
  return Kind::kStringList;
}
template <>
constexpr Kind kind_of<std::vector<SeqLenStage>>() {
  return Kind::kStageList;
}

// Declares the keys of one section, in the order docs/config.md and to_toml() list them. The
// field's C++ type gives the key's kind; `doc` is the key's meaning in Markdown.
template <class Section>
class SectionKeys {
 public:
  SectionKeys(std::vector<KeyDesc>& out, const char* section, Section Config::*member)
      : out_(out), section_(section), member_(member) {}

  template <class T>
  SectionKeys& key(const char* name, T Section::*field, const char* doc) {
    return add(name, field, -kInf, kInf, {}, doc);
  }
  template <class T>
  SectionKeys& range(const char* name, T Section::*field, double min, double max, const char* doc) {
    return add(name, field, min, max, {}, doc);
  }
  // A closed set of values: the enum's spellings (Note [Config choices]).
  template <class E>
  SectionKeys& choice(const char* name, E Section::*field, const char* doc) {
    return add_text(
        name, field, spellings_list<E>(), doc, [](const E& v) { return spelling_in_table(v); },
        [](const std::string& text) { return *parse_spelling<E>(text); });  // checked: allowed
  }
  // checkpoint.resume: "auto", "none" or a path.
  SectionKeys& resume(const char* name, Resume Section::*field, const char* doc) {
    return add_text(name, field, {}, doc, resume_text, parse_resume);
  }

 private:
  template <class T>
  SectionKeys& add(const char* name, T Section::*field, double min, double max,
                   std::vector<std::string> allowed, const char* doc) {
    Section Config::*member = member_;
    out_.push_back({section_, name, kind_of<T>(),
                    [member, field](Config& c) -> void* { return &(c.*member.*field); }, min, max,
                    std::move(allowed), doc});
    return *this;
  }

  // A string key whose field holds another type T: `print` gives its spelling, `parse` the
  // value of a spelling (one of `allowed` when that is not empty).
  template <class T, class Print, class Parse>
  SectionKeys& add_text(const char* name, T Section::*field, std::vector<std::string> allowed,
                        const char* doc, Print print, Parse parse) {
    Section Config::*member = member_;
    KeyDesc k{section_,
              name,
              Kind::kString,
              [member, field](Config& c) -> void* { return &(c.*member.*field); },
              -kInf,
              kInf,
              std::move(allowed),
              doc};
    k.get_text = [member, field, print](Config& c) -> std::string {
      return print(c.*member.*field);
    };
    k.set_text = [member, field, parse](Config& c, const std::string& text) {
      c.*member.*field = parse(text);
    };
    out_.push_back(std::move(k));
    return *this;
  }

  std::vector<KeyDesc>& out_;
  const char* section_;
  Section Config::*member_;
};

void model_keys(std::vector<KeyDesc>& out) {
  SectionKeys<ModelConfig>(out, "model", &Config::model)
      .choice("arch", &ModelConfig::arch,
              "the model family (Note [Model registry]): `bert`: bidirectional transformer "
              "encoder trained as a masked LM; `gpt`: transformer decoder trained as a causal LM; "
              "`hyena`: HyenaDNA (long convolutions; `hidden` = d_model, `ffn` = d_inner), a "
              "causal LM; `caduceus` / `caduceus-ps`: Caduceus (bidirectional Mamba; `-ps` with "
              "reverse-complement parameter sharing), a masked LM")
      .choice("task", &ModelConfig::task,
              "`pretrain`: the language-model objective of `arch`; `classification` / "
              "`regression`: a sequence-level head on labelled tables (`data.label_column`)")
      .range("hidden", &ModelConfig::hidden, 1, 65536, "model width")
      .range("layers", &ModelConfig::layers, 1, 1024, "transformer blocks")
      .range("heads", &ModelConfig::heads, 1, 1024, "attention heads; `hidden` % `heads` == 0")
      .range("kv_heads", &ModelConfig::kv_heads, 0, 1024,
             "key/value heads (grouped-query attention, Llama's `num_key_value_heads`): each is "
             "shared by `heads` / `kv_heads` query heads, 1 is multi-query; `heads` % "
             "`kv_heads` == 0; 0: as many as `heads`")
      .range("ffn", &ModelConfig::ffn, 1, 1 << 20, "feed-forward inner width")
      .range("max_seq_length", &ModelConfig::max_seq_length, 4, 1 << 20,
             "tokens per sequence, [CLS]/[SEP] included")
      .choice("position", &ModelConfig::position,
              "position encoding: learned absolute embeddings, rotary (RoPE) or ALiBi (attention "
              "biases -slope * distance per head, any length; DNABERT-2)")
      .choice("mlp", &ModelConfig::mlp,
              "feed-forward: `gelu` (dense, GELU, dense) or `geglu` (GELU(gate) * up, then "
              "down; the gate and up projections without bias; DNABERT-2)")
      .key("post_layer_norm", &ModelConfig::post_layer_norm,
           "BERT's post-LN blocks (LN(x + sublayer(x))) with a LayerNorm after the embeddings, "
           "instead of pre-LN blocks with a final norm (DNABERT-1/2)")
      .choice("attn_implementation", &ModelConfig::attn_implementation,
              "attention kernel: `sdpa` (LibTorch's scaled_dot_product_attention), `eager` "
              "(explicit matmul and softmax); `auto` is `sdpa`")
      .range("dropout", &ModelConfig::dropout, 0, 0.99,
             "dropout probability (0 keeps runs deterministic)")
      .key("gradient_checkpointing", &ModelConfig::gradient_checkpointing,
           "recompute each block's activations in the backward pass instead of keeping them: "
           "less memory for about one more forward pass of compute")
      .range("chunk_positions", &ModelConfig::chunk_positions, 0, int64_t{1} << 30,
             "HyenaDNA with `gradient_checkpointing`: each block's position-wise parts this many "
             "positions at a time, forward and recompute (Note [Hyena chunked block]; 0: all at "
             "once); the same function, less memory at long lengths (docs/long-context.md)")
      .range("chunk_channels", &ModelConfig::chunk_channels, 0, int64_t{1} << 20,
             "HyenaDNA with `gradient_checkpointing`: the FFT long convolution this many channels "
             "at a time (0: all at once); with `chunk_positions`, what lets 1M tokens fit")
      .range("num_labels", &ModelConfig::num_labels, 1, 1 << 20,
             "classification classes (regression: 1)")
      .choice("pooling", &ModelConfig::pooling,
              "how classification/regression heads summarise a sequence: the first token's "
              "state, or the mean over its tokens")
      .key("init_from", &ModelConfig::init_from,
           "model directory to start from (fine-tuning): one of our exports (`[tokenizer]` must "
           "match its `tokenizer.json`, else exit 2) or a Hugging Face directory (config.json + "
           "model.safetensors + vocab.txt/tokenizer.json of a bert, esm, roberta-prelayernorm, "
           "gpt_neox or llama model; its config.json sets the architecture, `[model]` the task, "
           "heads and dropout; see [hugging-face.md](hugging-face.md))");
}

void lora_keys(std::vector<KeyDesc>& out) {
  SectionKeys<LoraConfig>(out, "lora", &Config::lora)
      .range("r", &LoraConfig::r, 0, 4096, "adapter rank; 0 disables LoRA")
      .range("alpha", &LoraConfig::alpha, 0, kInf, "scaling = alpha / r")
      .range("dropout", &LoraConfig::dropout, 0, 0.99,
             "dropout probability on the adapters' input (training only)")
      .key("target_modules", &LoraConfig::target_modules,
           "module names that get adapters: the transformer's `query` `key` `value` `dense`; "
           "HyenaDNA's `in_proj` `out_proj` `fc1` `fc2`; Caduceus' `in_proj` `out_proj` (for "
           "these two the default means all of them, [models.md](models.md))")
      .choice("quantize_base", &LoraConfig::quantize_base,
              "`nf4`: QLoRA, the frozen linears of the blocks stored as 4-bit NF4 (block "
              "scales, double quantisation) and dequantised on the fly; adapters and heads "
              "train in full precision; the export merges into full precision "
              "([inference.md](inference.md#qlora))");
}

void tokenizer_keys(std::vector<KeyDesc>& out) {
  SectionKeys<TokenizerConfig>(out, "tokenizer", &Config::tokenizer)
      .choice("kind", &TokenizerConfig::kind,
              "`char`: one token per base; `kmer`: k-mers every `stride` bases; `nt`: the "
              "Nucleotide Transformer split (EsmTokenizer's): non-overlapping k-mers, single "
              "bases for N and leftovers; `bpe`: byte-pair encoding trained on the data; `hf`: "
              "a Hugging Face directory's BPE tokenizer.json as it is (DNABERT-2: "
              "`tokenizer.path`, else `model.init_from`)")
      .range("k", &TokenizerConfig::k, 3, 8, "k-mer length")
      .range("stride", &TokenizerConfig::stride, 1, 8,
             "k-mer stride: 1 overlapping, k non-overlapping")
      .range("vocab_size", &TokenizerConfig::vocab_size, 16, 1 << 20,
             "bpe: vocabulary size to train")
      .key("path", &TokenizerConfig::path,
           "bpe: model file to load, or where to save a trained one; hf: the model directory");
}

void data_keys(std::vector<KeyDesc>& out) {
  SectionKeys<DataConfig>(out, "data", &Config::data)
      .key("train_files", &DataConfig::train_files,
           "FASTA/FASTQ (plain, gzip, BGZF) or CSV/TSV/JSONL files to train on")
      .key("eval_files", &DataConfig::eval_files, "held-out files for evaluation")
      .choice("format", &DataConfig::format,
              "file format; `auto`: from the first file's extension (sequence files without a "
              "known one are recognised by their first character)")
      .choice("on_bad_record", &DataConfig::on_bad_record,
              "a malformed record: `error` stops the run (exit 3, naming file and line); "
              "`skip` drops it and counts it")
      .choice("sampling", &DataConfig::sampling,
              "genomes: `random` windows, or `tile`: windows at a fixed stride")
      .range("window_stride", &DataConfig::window_stride, 0, kInf,
             "`tile`: bases between window starts; 0 = window length")
      .choice("n_policy", &DataConfig::n_policy, "runs of N: `skip` windows with N, or `mask` them")
      .range("max_n_fraction", &DataConfig::max_n_fraction, 0, 1,
             "`skip`: windows with more N than this are skipped")
      .range("reverse_complement", &DataConfig::reverse_complement, 0, 1,
             "RC augmentation: probability of reverse-complementing a training window (genomes) "
             "or record (tables: the label is kept); evaluation reads the data as written. "
             "Also spelled `rc_augment`")
      .range("eval_fraction", &DataConfig::eval_fraction, 0, 0.9,
             "hold out the last fraction of each genome for evaluation")
      .range("samples_per_epoch", &DataConfig::samples_per_epoch, 0, kInf,
             "`random`: windows per epoch; 0 = genome length / window")
      .key("sequence_column", &DataConfig::sequence_column,
           "tables (CSV/TSV header, JSONL field): the column holding the sequence")
      .key("label_column", &DataConfig::label_column,
           "tables: the column holding the label (`model.task` classification or regression)")
      .range("mlm_probability", &DataConfig::mlm_probability, 0.001, 0.999,
             "masked LM: fraction of tokens selected")
      .range("dataloader_num_workers", &DataConfig::dataloader_num_workers, 0, 64,
             "background threads preparing batches")
      .range("prefetch_factor", &DataConfig::prefetch_factor, 1, 64, "batches queued per worker")
      .key("pin_memory", &DataConfig::pin_memory, "pinned host buffers when training on CUDA")
      .key("group_by_length", &DataConfig::group_by_length,
           "tables: batch records of similar length together")
      .key("packing", &DataConfig::packing, "pack short records into `max_seq_length` rows")
      .key("cache_dir", &DataConfig::cache_dir,
           "where .fai / offset indexes go when the data directory is read-only")
      .key("seq_len_warmup", &DataConfig::seq_len_warmup,
           "staged sequence-length warm-up (HyenaDNA's; Note [Sequence-length warm-up]), e.g. "
           "`[{steps = 100, seq_len = 1024}, {steps = 100, seq_len = 4096}]`: the first 100 "
           "optimizer steps at 1024 tokens a row, the next 100 at 4096, the rest at "
           "`model.max_seq_length`. Tokens per step stay constant: a stage's micro-batch holds "
           "`micro_batch_size` x `max_seq_length` / `seq_len` rows, each window of the full "
           "length cut into that many pieces, so the samples of a step, the resume point and "
           "the data order at any world size are those without warm-up. Lengths grow, each "
           "divides `model.max_seq_length`; genome pre-training only (docs/long-context.md)");
}

// [training], part 1: how long, how big a batch, and the optimizer.
void training_optimizer_keys(std::vector<KeyDesc>& out) {
  SectionKeys<TrainingConfig>(out, "training", &Config::training)
      .range("max_steps", &TrainingConfig::max_steps, 0, kInf,
             "optimizer steps; 0 = use `num_train_epochs`")
      .range("num_train_epochs", &TrainingConfig::num_train_epochs, 0, kInf,
             "with `max_steps` = 0: passes over the training set (may be fractional); the run "
             "takes ceil(epochs × samples per epoch / global batch) steps")
      .choice("batch_size", &TrainingConfig::batch_size,
              "`\"\"` = `micro_batch_size`; `\"auto\"` = the largest that fits (see "
              "[batch_size = \"auto\"](#batch_size--auto))")
      .range("micro_batch_size", &TrainingConfig::micro_batch_size, 1, 1 << 20,
             "sequences per rank per micro-step")
      .range("grad_accum_steps", &TrainingConfig::grad_accum_steps, 1, 1 << 20,
             "micro-steps whose gradients add up to one optimizer step")
      .range("auto_batch_memory_mb", &TrainingConfig::auto_batch_memory_mb, 0, kInf,
             "`batch_size = \"auto\"` on CPU: resident-memory budget per rank in MiB; 0 = 80% of "
             "available memory / ranks on the node + what the process holds")
      .range("memory_limit_gb", &TrainingConfig::memory_limit_gb, 0, kInf,
             "memory a rank may use in GB (1e9 bytes); the model's parameters, gradients, AdamW "
             "moments and activations are predicted from its shape before it is built, and a "
             "run predicted to need more is exit 2 naming the figures; 0 = available memory "
             "(MemAvailable, or the cgroup's memory.max) / ranks on the node, checked on CPU "
             "only")
      .range("lr", &TrainingConfig::lr, 0, 10, "peak learning rate of AdamW")
      .range("weight_decay", &TrainingConfig::weight_decay, 0, 10,
             "AdamW's decoupled weight decay; biases and layer norms are not decayed")
      .range("adam_beta1", &TrainingConfig::adam_beta1, 0, 0.999999,
             "AdamW's decay of the first moment")
      .range("adam_beta2", &TrainingConfig::adam_beta2, 0, 0.999999,
             "AdamW's decay of the second moment")
      .range("adam_epsilon", &TrainingConfig::adam_epsilon, 1e-12, 1,
             "AdamW's epsilon (0 would divide 0 by 0 for parameters without gradient: loss nan)")
      .choice("lr_scheduler", &TrainingConfig::lr_scheduler,
              "learning rate after the warm-up: constant, or decaying to 0 at the last step "
              "linearly or along a cosine")
      .range("warmup_steps", &TrainingConfig::warmup_steps, 0, kInf,
             "steps of linear warm-up from 0 to `lr`")
      .range("warmup_ratio", &TrainingConfig::warmup_ratio, 0, 1,
             "warm-up as a fraction of all steps, used when `warmup_steps` = 0")
      .range("max_grad_norm", &TrainingConfig::max_grad_norm, 0, kInf,
             "clip the global gradient norm (over all ranks) to this; 0 disables clipping");
}

// [training], part 2: numerics, evaluation, logging and where it runs.
void training_run_keys(std::vector<KeyDesc>& out) {
  SectionKeys<TrainingConfig>(out, "training", &Config::training)
      .choice("precision", &TrainingConfig::precision,
              "compute precision of forward and backward (parameters stay fp32); `fp16` needs a "
              "GPU and uses a loss scaler")
      .key("tf32", &TrainingConfig::tf32,
           "CUDA: allow TF32 tensor-core math in fp32 matmuls and convolutions")
      .choice("sync_free", &TrainingConfig::sync_free,
              "steps that never wait for the host (loss and grad norm read on logging steps "
              "only; a NaN loss is reported at the next logging step); `auto` = on for GPUs, "
              "off on CPU")
      .key("optimizer_offload", &TrainingConfig::optimizer_offload,
           "keep this rank's AdamW moments and an fp32 master copy of its parameter range (the "
           "ZeRO shard, or all of it) in host memory (pinned on CUDA): the update runs on the "
           "host and the parameters are copied back without a host wait. Frees 8 bytes (+4 of "
           "scratch) per owned parameter on the device; costs a host wait and two PCIe copies "
           "of the range per step (see [Optimizer offload](#optimizer-offload))")
      .key("keep_global_batch", &TrainingConfig::keep_global_batch,
           "resuming at another world size: adjust `grad_accum_steps` so micro × accum × world "
           "equals the checkpoint's global batch")
      .range("seed", &TrainingConfig::seed, 0, kInf,
             "seeds the model's initialisation, the sampler's order and masking: with the step "
             "it decides which samples a global batch holds")
      .range("eval_steps", &TrainingConfig::eval_steps, 0, kInf,
             "evaluate every this many steps; 0 disables evaluation")
      .range("eval_batches", &TrainingConfig::eval_batches, 1, kInf,
             "micro-batches per rank per evaluation: an evaluation scores the first min(eval "
             "set, eval_batches × micro_batch_size × world size) samples, each exactly once (a "
             "smaller set is not wrapped around)")
      .range("logging_steps", &TrainingConfig::logging_steps, 1, kInf,
             "write a step line (log and metrics file) every this many steps, and at the first "
             "and last step")
      .choice("device", &TrainingConfig::device,
              "`auto` = CUDA when a GPU is visible; a CUDA rank trains on cuda:LOCAL_RANK, "
              "counted within CUDA_VISIBLE_DEVICES ([gpu.md](gpu.md))")
      .key("output_dir", &TrainingConfig::output_dir,
           "where the exported model goes; empty: `<checkpoint.dir>/final`");
}

void parallel_keys(std::vector<KeyDesc>& out) {
  SectionKeys<ParallelConfig>(out, "parallel", &Config::parallel)
      .choice("backend", &ParallelConfig::backend,
              "`auto` = nccl for a CUDA model (one GPU per rank, NCCL built), else mpi under "
              "mpirun, else gloo; gloo/mpi reduce a CUDA model's buckets through pinned host "
              "memory")
      .range("zero_stage", &ParallelConfig::zero_stage, 0, 3,
             "0: every rank keeps the whole optimizer state; 1: optimizer state sharded across "
             "ranks; 2: gradients sharded too (reduce-scatter); 3: parameters sharded too, "
             "each block all-gathered just before it computes and freed after; with "
             "training.precision = bf16 gathered in bf16 and computed with in bf16, the shard "
             "staying fp32 (docs/parallelism.md)")
      .range("bucket_cap_mb", &ParallelConfig::bucket_cap_mb, 0.001, 65536,
             "size of a gradient bucket (MiB): a bucket is reduced as soon as its last gradient "
             "is written, while the backward pass goes on")
      .range("first_bucket_mb", &ParallelConfig::first_bucket_mb, 0.001, 65536,
             "size of the first bucket (MiB), small so communication starts early")
      .choice("accumulate_sync", &ParallelConfig::accumulate_sync,
              "with `grad_accum_steps` > 1: reduce gradients on the `last` micro-step only, or "
              "on `every` one")
      .choice("grad_reduce_dtype", &ParallelConfig::grad_reduce_dtype,
              "dtype gradients are reduced in; bf16/fp16 halve the bytes sent. ZeRO-3: the "
              "dtype of each block's reduce-scatter; the fp32 gradient is cast to it and the "
              "result added into the fp32 gradient shard (docs/parallelism.md)")
      .key("find_unused_parameters", &ParallelConfig::find_unused_parameters,
           "allow parameters that get no gradient in a step (they contribute a zero gradient "
           "to the reduction); without it such a step exits 2 naming them")
      .range("timeout_s", &ParallelConfig::timeout_s, 0.1, 86400, "collective timeout (seconds)")
      .key("check_collectives", &ParallelConfig::check_collectives,
           "before each collective, check that every rank issues the same one (op, dtype, "
           "count) and fail naming the ranks and what each issued, instead of hanging or "
           "reducing mismatched buffers; slow (each collective waits for every rank to issue "
           "it): for debugging a hang (docs/parallelism.md)")
      .key("zero3_accumulate_unsharded", &ParallelConfig::zero3_accumulate_unsharded,
           "ZeRO-3 with grad_accum_steps > 1: keep each block's whole gradient between "
           "micro-steps and reduce-scatter it once, at the last (one collective a block a step "
           "instead of one a micro-step, for 4 more bytes a parameter); off: every micro-step "
           "reduce-scatters (docs/parallelism.md)")
      .range("context_parallel", &ParallelConfig::context_parallel, 1, 65536,
             "context-parallel degree C: consecutive groups of C ranks split every sequence "
             "between them (each holds 1/C of its positions: longer sequences at the same memory "
             "per rank), the world size / C groups train data-parallel; must divide the world "
             "size. Language-model pre-training and sequence classification (not regression "
             "yet) of HyenaDNA, Caduceus and the transformer (docs/parallelism.md)")
      .key("share_gpus", &ParallelConfig::share_gpus,
           "allow more ranks on a node (LOCAL_WORLD_SIZE) than visible GPUs: rank r uses GPU r "
           "mod n and the ranks reduce over gloo/mpi through host memory (NCCL cannot put two "
           "ranks on one GPU). Without it that case exits 2 naming both numbers");
}

void checkpoint_keys(std::vector<KeyDesc>& out) {
  SectionKeys<CheckpointConfig>(out, "checkpoint", &Config::checkpoint)
      .key("dir", &CheckpointConfig::dir,
           "checked at start when the run writes checkpoints (not empty, not overlong, a "
           "writable directory, created if missing; exit 2 otherwise); owned by one job at a "
           "time (`<dir>/.dnallm-lock`, a second job exits 2 naming the holder)")
      .range("save_steps", &CheckpointConfig::save_steps, 0, kInf,
             "save every this many steps; 0 disables checkpoints")
      .range("keep_last", &CheckpointConfig::keep_last, 0, kInf,
             "committed checkpoints kept; 0 keeps all")
      .range("keep_every", &CheckpointConfig::keep_every, 0, kInf,
             "also keep every K-th step; 0 off")
      .resume("resume", &CheckpointConfig::resume,
              "`\"auto\"`: the newest committed checkpoint in `dir`, if any; `\"none\"`: start "
              "fresh; else a step directory to resume from")
      .choice("compression", &CheckpointConfig::compression, "compression of shard chunks")
      .range("compression_level", &CheckpointConfig::compression_level, 1, 19, "zstd level")
      .range("chunk_mb", &CheckpointConfig::chunk_mb, 0.0625, 1024,
             "chunk size of shard files (MiB)")
      .key("async", &CheckpointConfig::async, "write on a background thread")
      .key("save_final", &CheckpointConfig::save_final, "export `<dir>/final` at the end")
      .choice("best_metric", &CheckpointConfig::best_metric,
              "export the model to `<dir>/best` (with `best.json`: step, metric, value) at each "
              "evaluation that improves this metric (loss and bits_per_base: lower is better; "
              "accuracy, mcc, f1: higher); needs training.eval_steps > 0. The Hugging Face "
              "Trainer's load_best_model_at_end: evaluate `<dir>/best` on the test set");
}

// Read by dnallm-launch and dnallm-coordinator, not by the workers: see
// Note [Elastic settings] in core/config.hpp.
void elastic_keys(std::vector<KeyDesc>& out) {
  SectionKeys<ElasticConfig>(out, "elastic", &Config::elastic)
      .range("min_nodes", &ElasticConfig::min_nodes, 1, 1 << 20,
             "elastic job: fewest nodes a rendezvous round closes with (`dnallm-launch --nnodes "
             "MIN:MAX`, `dnallm-coordinator --min-nodes`); equal to a `max_nodes` other than 1: "
             "the node count of a static `dnallm-launch` job, as `--nnodes N`")
      .range("max_nodes", &ElasticConfig::max_nodes, 1, 1 << 20,
             "elastic job: most nodes in a generation; `min_nodes` < `max_nodes` makes a "
             "`dnallm-launch` job elastic, as `--nnodes MIN:MAX` does")
      .range("max_restarts", &ElasticConfig::max_restarts, 0, 1 << 20,
             "worker failures (and hangs) tolerated for the whole job before it fails: "
             "dnallm-launch restarts the worker group up to this many times "
             "(`--max-restarts`)")
      .range("max_membership_changes", &ElasticConfig::max_membership_changes, 0, 1 << 20,
             "elastic job: node deaths and late joins tolerated for the whole job "
             "(`--max-membership-changes`)")
      .range("heartbeat_interval_s", &ElasticConfig::heartbeat_interval_s, 0.01, 3600,
             "elastic job: seconds between an agent's heartbeats, which carry its workers' "
             "progress (`dnallm-launch --monitor-interval`)")
      .range("heartbeat_timeout_s", &ElasticConfig::heartbeat_timeout_s, 0.1, 86400,
             "elastic job: a node silent this long is declared dead; an agent gives up on a "
             "coordinator silent this long (`--heartbeat-timeout`)")
      .range("step_timeout_s", &ElasticConfig::step_timeout_s, 1, 864000,
             "elastic job: a rank whose step has not advanced for this long is a hang "
             "(`--hang-timeout`)")
      .range("settle_s", &ElasticConfig::settle_s, 0, 3600,
             "elastic job: seconds without a new join before a round with at least "
             "`min_nodes` closes (`--rdzv-settle`)")
      .range("join_timeout_s", &ElasticConfig::join_timeout_s, 1, 864000,
             "elastic job: seconds a round may stay below `min_nodes` before the job fails "
             "(`--join-timeout`)");
}

void logging_keys(std::vector<KeyDesc>& out) {
  SectionKeys<LoggingConfig>(out, "logging", &Config::logging)
      .key("metrics_file", &LoggingConfig::metrics_file,
           "JSON Lines from rank 0; a run that resumes from a checkpoint appends, a fresh run "
           "truncates")
      .key("tensorboard_dir", &LoggingConfig::tensorboard_dir,
           "TensorBoard event files (rank 0): every number of the metrics lines as a scalar, "
           "tagged `train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`, "
           "`eval/loss`, `eval/bits_per_base`, `eval/accuracy`, `checkpoint/stall_s`, "
           "`summary/...`; view with `tensorboard --logdir DIR`")
      .choice("level", &LoggingConfig::level, "least severe log lines written (stderr)")
      .range("peak_tflops", &LoggingConfig::peak_tflops, 0, 1e6,
             "one device's peak dense TFLOP/s for `mfu`; 0: known GPUs by name (H100, H200: "
             "989; A100: 312, bf16), no MFU on CPU");
}

const std::vector<KeyDesc>& schema() {
  static const std::vector<KeyDesc> keys = [] {
    std::vector<KeyDesc> out;
    model_keys(out);
    lora_keys(out);
    tokenizer_keys(out);
    data_keys(out);
    training_optimizer_keys(out);
    training_run_keys(out);
    parallel_keys(out);
    checkpoint_keys(out);
    elastic_keys(out);
    logging_keys(out);
    return out;
  }();
  return keys;
}

const std::vector<std::string>& section_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& k : schema()) {
      if (std::find(out.begin(), out.end(), k.section) == out.end()) out.push_back(k.section);
    }
    return out;
  }();
  return names;
}

const KeyDesc* find_key(const std::string& section, const std::string& name) {
  for (const auto& k : schema()) {
    if (section == k.section && name == k.name) return &k;
  }
  return nullptr;
}

// Hugging Face / DNALLM spellings that map one to one onto our keys. Accepted at the top
// level of a file, inside any section, and in --set (with or without a section).
struct Alias {
  const char* name;
  const char* section;  // canonical key
  const char* key;
};
const std::vector<Alias>& aliases() {
  static const std::vector<Alias> list = {
      {"per_device_train_batch_size", "training", "micro_batch_size"},
      {"gradient_accumulation_steps", "training", "grad_accum_steps"},
      {"learning_rate", "training", "lr"},
      {"weight_decay", "training", "weight_decay"},
      {"warmup_ratio", "training", "warmup_ratio"},
      {"warmup_steps", "training", "warmup_steps"},
      {"lr_scheduler_type", "training", "lr_scheduler"},
      {"max_grad_norm", "training", "max_grad_norm"},
      {"bf16", "training", "precision"},  // bool: true -> "bf16"
      {"fp16", "training", "precision"},  // bool: true -> "fp16"
      {"tf32", "training", "tf32"},
      {"gradient_checkpointing", "model", "gradient_checkpointing"},
      {"save_steps", "checkpoint", "save_steps"},
      {"save_total_limit", "checkpoint", "keep_last"},
      {"metric_for_best_model", "checkpoint", "best_metric"},
      {"rc_augment", "data", "reverse_complement"},
      {"eval_steps", "training", "eval_steps"},
      {"logging_steps", "training", "logging_steps"},
      {"max_steps", "training", "max_steps"},
      {"num_train_epochs", "training", "num_train_epochs"},
      {"seed", "training", "seed"},
      {"dataloader_num_workers", "data", "dataloader_num_workers"},
      {"dataloader_pin_memory", "data", "pin_memory"},
      {"group_by_length", "data", "group_by_length"},
      {"max_seq_length", "model", "max_seq_length"},
  };
  return list;
}

const Alias* find_alias(const std::string& name) {
  for (const auto& a : aliases()) {
    if (name == a.name) return &a;
  }
  return nullptr;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// The nearest valid key to `section.name` (canonical keys and aliases), or "".
std::string suggest_key(const std::string& section, const std::string& name) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  auto consider = [&](const std::string& candidate_leaf, const std::string& candidate_full,
                      size_t bonus) {
    size_t d = edit_distance(name, candidate_leaf) * 2 + bonus;
    if (d < best_d) {
      best_d = d;
      best = candidate_full;
    }
  };
  for (const auto& k : schema()) consider(k.name, k.full(), section == k.section ? 0 : 1);
  for (const auto& a : aliases()) consider(a.name, a.name, 1);
  // Only suggest when reasonably close: at most about a third of the name edited.
  size_t limit = std::max<size_t>(4, name.size()) * 2 / 3 + 1;
  return best_d <= limit * 2 ? best : "";
}

std::string suggest_section(const std::string& name) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& s : section_names()) {
    size_t d = edit_distance(name, s);
    if (d < best_d) {
      best_d = d;
      best = s;
    }
  }
  return best_d <= 3 ? best : "";
}

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i].empty() ? "\"\"" : "\"" + items[i] + "\"";
  }
  return out;
}

std::string where(const std::string& origin, const toml::source_region& src) {
  if (src.begin.line == 0) return origin;
  return fmt::format("{}:{}", origin, src.begin.line);
}

std::string range_text(const KeyDesc& k) {
  auto num = [&](double v) {
    return k.kind == Kind::kInt ? fmt::format("{}", static_cast<int64_t>(v)) : fmt::format("{}", v);
  };
  bool lo = std::isfinite(k.min), hi = std::isfinite(k.max);
  if (lo && hi) return fmt::format("between {} and {}", num(k.min), num(k.max));
  if (lo) return fmt::format("at least {}", num(k.min));
  if (hi) return fmt::format("at most {}", num(k.max));
  return "any value";
}

[[noreturn]] void type_error(const KeyDesc& k, const std::string& at) {
  fail(ExitCode::kUsage, "{}: key '{}' must be {}{}; fix the value", at, k.full(),
       kind_name(k.kind), k.allowed.empty() ? std::string() : " (one of " + join(k.allowed) + ")");
}

void check_range(const KeyDesc& k, double v, const std::string& shown, const std::string& at) {
  if (!std::isfinite(v) || v < k.min || v > k.max) {
    fail(ExitCode::kUsage, "{}: key '{}' is {}, must be {}", at, k.full(), shown, range_text(k));
  }
}

int64_t read_int(const KeyDesc& k, const toml::node& node, const std::string& at) {
  auto v = node.value_exact<int64_t>();
  if (!v) type_error(k, at);
  check_range(k, static_cast<double>(*v), fmt::format("{}", *v), at);
  return *v;
}

double read_double(const KeyDesc& k, const toml::node& node, const std::string& at) {
  std::optional<double> v;
  if (node.is_floating_point()) v = node.value_exact<double>();
  if (node.is_integer()) v = static_cast<double>(*node.value_exact<int64_t>());
  if (!v) type_error(k, at);
  check_range(k, *v, fmt::format("{}", *v), at);
  return *v;
}

std::string read_string(const KeyDesc& k, const toml::node& node, const std::string& at) {
  auto v = node.value_exact<std::string>();
  if (!v) type_error(k, at);
  if (!k.allowed.empty() && std::find(k.allowed.begin(), k.allowed.end(), *v) == k.allowed.end()) {
    fail(ExitCode::kUsage, "{}: key '{}' is \"{}\", allowed values are {}", at, k.full(), *v,
         join(k.allowed));
  }
  return *v;
}

// A list of strings; a single string is a list of one.
std::vector<std::string> read_string_list(const KeyDesc& k, const toml::node& node,
                                          const std::string& at) {
  if (auto s = node.value_exact<std::string>()) return {*s};
  const auto* arr = node.as_array();
  if (arr == nullptr) type_error(k, at);
  std::vector<std::string> out;
  for (const auto& el : *arr) {
    auto s = el.value_exact<std::string>();
    if (!s) type_error(k, at);
    out.push_back(*s);
  }
  return out;
}

// data.seq_len_warmup: an array of {steps, seq_len} tables (a single table is a list of one).
// The order of the stages and their lengths against model.max_seq_length are checked by
// validate(), once every key is set.
std::vector<SeqLenStage> read_stage_list(const KeyDesc& k, const toml::node& node,
                                         const std::string& at) {
  std::vector<const toml::table*> tables;
  if (const auto* t = node.as_table()) {
    tables.push_back(t);
  } else if (const auto* arr = node.as_array()) {
    for (const auto& el : *arr) {
      if (!el.is_table()) type_error(k, at);
      tables.push_back(el.as_table());
    }
  } else {
    type_error(k, at);
  }
  std::vector<SeqLenStage> out;
  for (size_t i = 0; i < tables.size(); ++i) {
    const std::string stage = fmt::format("{}[{}]", k.full(), i);
    SeqLenStage s;
    bool has_steps = false, has_len = false;
    for (const auto& [key, value] : *tables[i]) {
      const std::string name(key.str());
      auto v = value.value_exact<int64_t>();
      if (name != "steps" && name != "seq_len") {
        fail(ExitCode::kUsage,
             "{}: {} has an unknown key '{}'; a stage is {{steps = N, seq_len = N}}", at, stage,
             name);
      }
      if (!v) fail(ExitCode::kUsage, "{}: {}.{} must be an integer", at, stage, name);
      if (name == "steps") {
        if (*v < 1) fail(ExitCode::kUsage, "{}: {}.steps is {}, must be at least 1", at, stage, *v);
        s.steps = *v;
        has_steps = true;
      } else {
        if (*v < 4 || *v > (1 << 20)) {
          fail(ExitCode::kUsage, "{}: {}.seq_len is {}, must be between 4 and {}", at, stage, *v,
               1 << 20);
        }
        s.seq_len = *v;
        has_len = true;
      }
    }
    if (!has_steps || !has_len) {
      fail(ExitCode::kUsage, "{}: {} needs both keys: {{steps = N, seq_len = N}}", at, stage);
    }
    out.push_back(s);
  }
  return out;
}

// Reads `node` into the field described by `k`; `at` is "file:line" or "--set key=value".
void assign(Config& c, const KeyDesc& k, const toml::node& node, const std::string& at) {
  void* field = k.ptr(c);
  switch (k.kind) {
    case Kind::kInt:
      *static_cast<int64_t*>(field) = read_int(k, node, at);
      break;
    case Kind::kDouble:
      *static_cast<double*>(field) = read_double(k, node, at);
      break;
    case Kind::kBool: {
      auto v = node.value_exact<bool>();
      if (!v) type_error(k, at);
      *static_cast<bool*>(field) = *v;
      break;
    }
    case Kind::kString:
      if (k.set_text) {
        k.set_text(c, read_string(k, node, at));
      } else {
        *static_cast<std::string*>(field) = read_string(k, node, at);
      }
      break;
    case Kind::kStringList:
      *static_cast<std::vector<std::string>*>(field) = read_string_list(k, node, at);
      break;
    case Kind::kStageList:
      *static_cast<std::vector<SeqLenStage>*>(field) = read_stage_list(k, node, at);
      break;
  }
}

// Applies an alias. `bf16`/`fp16` are booleans that select a precision.
void assign_alias(Config& c, const Alias& a, const toml::node& node, const std::string& at) {
  std::string name = a.name;
  if (name == "bf16" || name == "fp16") {
    auto v = node.value_exact<bool>();
    if (!v) fail(ExitCode::kUsage, "{}: key '{}' must be true or false", at, name);
    const Precision selected = name == "bf16" ? Precision::kBf16 : Precision::kFp16;
    if (*v) {
      c.training.precision = selected;
    } else if (c.training.precision == selected) {
      c.training.precision = Precision::kFp32;
    }
    return;
  }
  assign(c, *find_key(a.section, a.key), node, at);
}

// Sets `section.name` (or an alias) from `node`; unknown keys fail with a suggestion.
void set_key(Config& c, const std::string& section, const std::string& name, const toml::node& node,
             const std::string& at) {
  if (const KeyDesc* k = find_key(section, name)) {
    assign(c, *k, node, at);
    return;
  }
  if (const Alias* a = find_alias(name)) {
    assign_alias(c, *a, node, at);
    return;
  }
  std::string full = section.empty() ? name : section + "." + name;
  std::string hint = suggest_key(section, name);
  fail(ExitCode::kUsage, "{}: unknown key '{}'{}; see docs/config.md for the valid keys", at, full,
       hint.empty() ? std::string() : "; did you mean '" + hint + "'?");
}

// Note [Sequence-length warm-up] (worker/data/data_loader.hpp): the stages grow toward
// model.max_seq_length, and each length divides it (a window of the full length is cut into
// max_seq_length / seq_len pieces, so tokens per step stay constant).
template <typename Bad>
void validate_seq_len_warmup(const Config& c, Bad&& bad) {
  const auto& stages = c.data.seq_len_warmup;
  const int64_t max_len = c.model.max_seq_length;
  for (size_t i = 0; i < stages.size(); ++i) {
    const int64_t len = stages[i].seq_len;
    const std::string key = fmt::format("data.seq_len_warmup[{}].seq_len = {}", i, len);
    if (i > 0 && len <= stages[i - 1].seq_len) {
      bad(
          fmt::format("{} must be longer than the stage before it ({}): the stages grow toward "
                      "model.max_seq_length",
                      key, stages[i - 1].seq_len));
    }
    if (len >= max_len) {
      bad(
          fmt::format("{} must be shorter than model.max_seq_length = {}, the length training "
                      "continues at after the warm-up; raise model.max_seq_length or drop the "
                      "stage",
                      key, max_len));
    }
    if (max_len % len != 0) {
      bad(
          fmt::format("{} must divide model.max_seq_length = {}: a stage's micro-batch holds "
                      "micro_batch_size x {} / seq_len rows, so that tokens per step stay "
                      "constant (e.g. {})",
                      key, max_len, max_len, max_len / 2));
    }
  }
  if (!stages.empty() && c.model.task != Task::kPretrain) {
    bad(
        fmt::format("data.seq_len_warmup is for pre-training, but model.task = \"{}\": a "
                    "labelled record cannot be cut into pieces; remove the warm-up",
                    spelling(c.model.task)));
  }
}

void validate(const Config& c, const std::string& origin) {
  auto bad = [&](const std::string& what) {
    fail(ExitCode::kUsage, "{}: {}", origin.empty() ? "configuration" : origin, what);
  };
  if (c.model.hidden % c.model.heads != 0) {
    bad(fmt::format("model.hidden ({}) must be divisible by model.heads ({})", c.model.hidden,
                    c.model.heads));
  }
  if (c.model.kv_heads > 0 && c.model.heads % c.model.kv_heads != 0) {
    bad(fmt::format("model.heads ({}) must be divisible by model.kv_heads ({})", c.model.heads,
                    c.model.kv_heads));
  }
  if (c.elastic.min_nodes > c.elastic.max_nodes) {
    bad(fmt::format("elastic.min_nodes ({}) must not exceed elastic.max_nodes ({})",
                    c.elastic.min_nodes, c.elastic.max_nodes));
  }
  if (c.training.max_steps == 0 && c.training.num_train_epochs <= 0) {
    bad("set training.max_steps or training.num_train_epochs (both are 0)");
  }
  if (c.tokenizer.kind == TokenizerKind::kKmer && c.tokenizer.stride > c.tokenizer.k) {
    bad(fmt::format("tokenizer.stride ({}) must not exceed tokenizer.k ({})", c.tokenizer.stride,
                    c.tokenizer.k));
  }
  const BestMetric best = c.checkpoint.best_metric;
  if (best != BestMetric::kNone && c.training.eval_steps <= 0) {
    bad(
        fmt::format("checkpoint.best_metric = \"{}\" needs evaluations: set training.eval_steps "
                    "> 0 and data.eval_files (or data.eval_fraction)",
                    spelling(best)));
  }
  const bool classifier_metric =
      best == BestMetric::kAccuracy || best == BestMetric::kMcc || best == BestMetric::kF1;
  if (classifier_metric && c.model.task != Task::kClassification) {
    bad(
        fmt::format("checkpoint.best_metric = \"{}\" scores a classifier but model.task = \"{}\"; "
                    "use \"loss\"",
                    spelling(best), spelling(c.model.task)));
  }
  if (best == BestMetric::kBitsPerBase && c.model.task != Task::kPretrain) {
    bad(
        fmt::format("checkpoint.best_metric = \"bits_per_base\" scores a language model but "
                    "model.task = \"{}\"; use \"loss\"",
                    spelling(c.model.task)));
  }
  if (c.training.precision == Precision::kFp16 && c.training.device == cfg::Device::kCpu) {
    bad("training.precision = \"fp16\" needs a GPU; use \"bf16\" or \"fp32\" on CPU");
  }
  validate_seq_len_warmup(c, bad);
}

// The canonical "section.key" that `name` sets in a table of `section` ("" when it names
// none, or for the bf16/fp16 selectors, which may both appear: see assign_alias).
std::string canonical_key(const std::string& section, const std::string& name) {
  if (find_key(section, name) != nullptr) return section + "." + name;
  if (const Alias* a = find_alias(name)) {
    const std::string n = a->name;
    if (n == "bf16" || n == "fp16") return "";
    return std::string(a->section) + "." + a->key;
  }
  return "";
}

// Note [One spelling a table]: `lr` and its alias `learning_rate` (any key and an alias of
// it) in one table would leave the value to whichever comes later; refused, naming both.
void check_one_spelling(const toml::table& table, const std::string& section,
                        const std::string& origin) {
  std::map<std::string, std::pair<std::string, toml::source_region>> seen;
  for (const auto& [key, node] : table) {
    if (node.is_table()) continue;
    const std::string name(key.str());
    const std::string canonical = canonical_key(section, name);
    if (canonical.empty()) continue;
    const auto region = key.source().begin.line ? key.source() : node.source();
    auto [it, fresh] = seen.emplace(canonical, std::make_pair(name, region));
    if (fresh) continue;
    // (toml++ iterates keys in name order: the message names the later line first.)
    auto later = std::make_pair(name, region), earlier = it->second;
    if (later.second.begin.line < earlier.second.begin.line) std::swap(later, earlier);
    fail(ExitCode::kUsage,
         "{}: '{}' and '{}' ({}) both set {} in one table, so one would silently win: keep one "
         "of them",
         where(origin, later.second), later.first, earlier.first, where(origin, earlier.second),
         canonical);
  }
}

void apply_table(Config& c, const toml::table& root, const std::string& origin) {
  check_one_spelling(root, "", origin);
  for (const auto& [key, node] : root) {
    if (const auto* table = node.as_table())
      check_one_spelling(*table, std::string(key.str()), origin);
  }
  for (const auto& [key, node] : root) {
    std::string name(key.str());
    std::string at = where(origin, key.source().begin.line ? key.source() : node.source());
    if (const auto* table = node.as_table()) {
      bool known =
          std::find(section_names().begin(), section_names().end(), name) != section_names().end();
      if (!known) {
        std::string hint = suggest_section(name);
        fail(ExitCode::kUsage, "{}: unknown section [{}]{}; valid sections are [{}]", at, name,
             hint.empty() ? std::string() : "; did you mean [" + hint + "]?",
             fmt::format("{}", fmt::join(section_names(), "] [")));
      }
      for (const auto& [sub, subnode] : *table) {
        std::string sub_at =
            where(origin, sub.source().begin.line ? sub.source() : subnode.source());
        set_key(c, name, std::string(sub.str()), subnode, sub_at);
      }
    } else {
      set_key(c, "", name, node, at);  // top level: only aliases are valid
    }
  }
}

// Sets `path` ("section.key", or an alias) from `value`: TOML, or a bare word taken as a
// string. `at` names where the value came from in messages.
void set_from_text(Config& c, const std::string& path, const std::string& value,
                   const std::string& at) {
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", value}};  // bare word: a string
  }
  if (parsed.size() != 1 || !parsed.contains("v")) parsed = toml::table{{"v", value}};
  const toml::node& node = *parsed.get("v");
  auto dot = path.find('.');
  if (dot == std::string::npos) {
    set_key(c, "", path, node, at);
    return;
  }
  std::string section = path.substr(0, dot);
  if (std::find(section_names().begin(), section_names().end(), section) == section_names().end()) {
    std::string hint = suggest_section(section);
    fail(ExitCode::kUsage, "{}: unknown section '{}'{}", at, section,
         hint.empty() ? std::string() : "; did you mean '" + hint + "'?");
  }
  set_key(c, section, path.substr(dot + 1), node, at);
}

// `--set section.key=value`.
void apply_override(Config& c, const std::string& spec) {
  auto eq = spec.find('=');
  if (eq == std::string::npos || eq == 0) {
    fail(ExitCode::kUsage, "--set '{}': expected section.key=value (e.g. training.lr=3e-4)", spec);
  }
  set_from_text(c, spec.substr(0, eq), spec.substr(eq + 1), fmt::format("--set {}", spec));
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<int>(ch));
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

std::string toml_double(double v) {
  // Shortest text that reads back to the same double, always with a '.' or exponent.
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string value_text(Config& c, const KeyDesc& k) {
  void* f = k.ptr(c);
  switch (k.kind) {
    case Kind::kInt:
      return fmt::format("{}", *static_cast<int64_t*>(f));
    case Kind::kDouble:
      return toml_double(*static_cast<double*>(f));
    case Kind::kBool:
      return *static_cast<bool*>(f) ? "true" : "false";
    case Kind::kString:
      return toml_string(k.get_text ? k.get_text(c) : *static_cast<std::string*>(f));
    case Kind::kStringList: {
      std::vector<std::string> parts;
      for (const auto& s : *static_cast<std::vector<std::string>*>(f))
        parts.push_back(toml_string(s));
      return "[" + fmt::format("{}", fmt::join(parts, ", ")) + "]";
    }
    case Kind::kStageList: {
      std::vector<std::string> parts;
      for (const auto& st : *static_cast<std::vector<SeqLenStage>*>(f))
        parts.push_back(fmt::format("{{steps = {}, seq_len = {}}}", st.steps, st.seq_len));
      return "[" + fmt::format("{}", fmt::join(parts, ", ")) + "]";
    }
  }
  return "";
}

// `omit_at_default`: keys left out while they hold their default value (see
// model_config_hash).
std::string sections_toml(const Config& config, const std::vector<std::string>& only,
                          const std::vector<std::string>& omit_at_default = {}) {
  Config c = config;  // value_text needs a mutable Config for the field accessors
  Config defaults;
  std::string out;
  std::string current;
  for (const auto& k : schema()) {
    if (!only.empty() && std::find(only.begin(), only.end(), k.section) == only.end()) continue;
    if (std::find(omit_at_default.begin(), omit_at_default.end(), k.full()) !=
            omit_at_default.end() &&
        value_text(c, k) == value_text(defaults, k))
      continue;
    if (current != k.section) {
      if (!current.empty()) out += "\n";
      out += fmt::format("[{}]\n", k.section);
      current = k.section;
    }
    out += fmt::format("{} = {}\n", k.name, value_text(c, k));
  }
  return out;
}

// A Markdown table cell: '|' would end it.
std::string cell(const std::string& text) {
  std::string out;
  for (char ch : text) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}

// What a key accepts, for the reference's "allowed" column.
std::string allowed_text(const KeyDesc& k) {
  if (!k.allowed.empty()) {
    std::vector<std::string> quoted;
    for (const auto& a : k.allowed) quoted.push_back("`\"" + a + "\"`");
    return fmt::format("{}", fmt::join(quoted, " | "));
  }
  switch (k.kind) {
    case Kind::kInt:
      return "integer, " + range_text(k);
    case Kind::kDouble:
      return "number, " + range_text(k);
    case Kind::kBool:
      return "`true`, `false`";
    case Kind::kString:
      return "string";
    case Kind::kStringList:
      return "list of strings";
    case Kind::kStageList:
      return "list of `{steps, seq_len}` tables";
  }
  return "";
}

// One table per section: key, default, allowed values, meaning.
std::string keys_markdown() {
  Config defaults;
  std::string out;
  std::string current;
  for (const auto& k : schema()) {
    if (current != k.section) {
      out += fmt::format(
          "{}### [{}]\n\n| key | default | allowed | meaning |\n"
          "| --- | --- | --- | --- |\n",
          current.empty() ? "" : "\n", k.section);
      current = k.section;
    }
    out += fmt::format("| `{}` | `{}` | {} | {} |\n", k.name, value_text(defaults, k),
                       cell(allowed_text(k)), cell(k.doc));
  }
  return out;
}

std::string aliases_markdown() {
  std::string out = "| alias | key |\n| --- | --- |\n";
  for (const auto& a : aliases()) {
    const std::string name = a.name;
    const std::string key = fmt::format("`{}.{}`", a.section, a.key);
    if (name == "bf16" || name == "fp16") {  // see assign_alias
      out += fmt::format("| `{0} = true` | {1} = `\"{0}\"` (`false`: back to `\"fp32\"`) |\n", name,
                         key);
    } else {
      out += fmt::format("| `{}` | {} |\n", name, key);
    }
  }
  return out;
}

void replace_marker(std::string& text, const std::string& marker, const std::string& with) {
  const auto at = text.find(marker);
  DNALLM_CHECK(at != std::string::npos, ExitCode::kUsage,
               "the configuration reference template has no {} marker", marker);
  text.replace(at, marker.size(), with);
}

}  // namespace

Config parse_config(const std::string& toml_text, const std::string& origin,
                    const std::vector<std::string>& overrides) {
  Config c;
  c.source_file = origin;
  if (!toml_text.empty()) {
    toml::table root;
    try {
      root = toml::parse(toml_text, origin);
    } catch (const toml::parse_error& e) {
      fail(ExitCode::kUsage, "{}:{}:{}: malformed TOML: {}", origin, e.source().begin.line,
           e.source().begin.column, e.description());
    }
    apply_table(c, root, origin);
  }
  for (const auto& o : overrides) apply_override(c, o);
  validate(c, origin);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return parse_config("", "", overrides);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail(ExitCode::kUsage, "--config '{}' is a directory; name a TOML file (e.g. {}/run.toml)",
         path, path);
  std::string text = read_bounded_file(path, kMaxConfigFileBytes, ExitCode::kUsage, "--config");
  if (text.empty()) text = "\n";  // an empty file is valid: defaults
  return parse_config(text, path, overrides);
}

std::string to_toml(const Config& config) { return sections_toml(config, {}); }

uint64_t model_config_hash(const Config& config) {
  // Note [Model hash across releases]: checkpoints store this hash and resume refuses another
  // one, so a [model]/[lora]/[tokenizer] key added after checkpoints exist joins the hash only
  // when it is set to something other than its default; list such keys here.
  static const std::vector<std::string> kAddedLater = {
      "lora.quantize_base",    "model.kv_heads",        "model.mlp",
      "model.post_layer_norm", "model.chunk_positions", "model.chunk_channels"};
  std::string text = sections_toml(config, {"model", "lora", "tokenizer"}, kAddedLater);
  return XXH64(text.data(), text.size(), 0);
}

std::vector<std::string> config_keys() {
  std::vector<std::string> out;
  for (const auto& k : schema()) out.push_back(k.full());
  return out;
}

bool operator==(const Config& a, const Config& b) { return to_toml(a) == to_toml(b); }

void apply_key_overrides(Config& config, const std::vector<KeyOverride>& overrides) {
  for (const auto& o : overrides) set_from_text(config, o.key, o.value, o.origin);
  validate(config, config.source_file);
}

std::string config_default(const std::string& key) {
  Config defaults;
  for (const auto& k : schema()) {
    if (k.full() == key) return value_text(defaults, k);
  }
  fail(ExitCode::kFailure, "config_default: no key '{}'", key);
}

std::string config_reference(const std::string& page_template) {
  std::string page = page_template;
  replace_marker(page, "{{aliases}}", aliases_markdown());
  replace_marker(page, "{{keys}}", keys_markdown());
  return page;
}

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
