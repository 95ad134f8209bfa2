// The run configuration: typed sections with defaults, loaded from TOML and `--set` overrides.
// The defaults are the member initialisers below; what each key means, and what values it
// takes, is its entry in the schema (core/config/keys/<section>.toml), from which docs/config.md
// is generated (config_reference()).
//
// Precedence: `--set section.key=value` > file > defaults. Keys and sections follow
// DESIGN.md; Hugging Face / DNALLM spellings are accepted as aliases (see docs/config.md).
// Every error is an Error(kUsage) naming the key, the file:line and what is allowed.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.hpp"

namespace dnallm {

// Note [Config choices]: every key with a closed set of values is an enum below; its spellings
// are one table in core/config/spellings.hpp, used to parse (an unknown spelling is exit 2
// naming the key, the value and the allowed spellings), to print (to_toml(), docs/config.md,
// the model hash) and by spelling() for messages. Code outside the schema compares enum values,
// never strings (tests/lint/config_choices.sh checks it).
namespace cfg {

enum class Arch { kBert, kGpt, kHyena, kCaduceus, kCaduceusPs };      // model.arch
enum class Task { kPretrain, kClassification, kRegression };          // model.task
enum class Position { kLearned, kRotary, kAlibi };                    // model.position
enum class Mlp { kGelu, kGeglu };                                     // model.mlp
enum class AttnImplementation { kAuto, kSdpa, kEager };               // model.attn_implementation
enum class Pooling { kCls, kMean };                                   // model.pooling
enum class QuantizeBase { kNone, kNf4 };                              // lora.quantize_base
enum class TokenizerKind { kChar, kKmer, kNt, kBpe, kHf };            // tokenizer.kind
enum class DataFormat { kAuto, kFasta, kFastq, kCsv, kTsv, kJsonl };  // data.format
enum class OnBadRecord { kError, kSkip };                             // data.on_bad_record
enum class Sampling { kRandom, kTile };                               // data.sampling
enum class NPolicy { kSkip, kMask };                                  // data.n_policy
enum class BatchSize { kMicroBatch, kAuto };             // training.batch_size "" | "auto"
enum class LrScheduler { kConstant, kLinear, kCosine };  // training.lr_scheduler
// training.precision and parallel.grad_reduce_dtype.
enum class Precision { kFp32, kBf16, kFp16 };
enum class SyncFree { kAuto, kOn, kOff };          // training.sync_free
enum class Device { kAuto, kCpu, kCuda };          // training.device
enum class Backend { kAuto, kGloo, kMpi, kNccl };  // parallel.backend
enum class AccumulateSync { kLast, kEvery };       // parallel.accumulate_sync
enum class Compression { kZstd, kNone };           // checkpoint.compression
// checkpoint.best_metric (Note [Best checkpoint] in worker/train/trainer.hpp).
enum class BestMetric { kNone, kLoss, kBitsPerBase, kAccuracy, kMcc, kF1 };
// logging.level.
enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kCritical, kOff };

// checkpoint.resume: "auto", "none", or any other text: a path.
struct Resume {
  enum class Kind { kAuto, kNone, kPath };
  Kind kind = Kind::kAuto;
  std::string path;  // kPath only

  static Resume automatic() { return {}; }
  static Resume none() { return {Kind::kNone, {}}; }
  static Resume from_path(std::string p) { return {Kind::kPath, std::move(p)}; }
};

// The spelling of a value, as the configuration writes it ("bert", "bf16", "" for
// BatchSize::kMicroBatch).
const char* spelling(Arch v);
const char* spelling(Task v);
const char* spelling(Position v);
const char* spelling(Mlp v);
const char* spelling(AttnImplementation v);
const char* spelling(Pooling v);
const char* spelling(QuantizeBase v);
const char* spelling(TokenizerKind v);
const char* spelling(DataFormat v);
const char* spelling(OnBadRecord v);
const char* spelling(Sampling v);
const char* spelling(NPolicy v);
const char* spelling(BatchSize v);
const char* spelling(LrScheduler v);
const char* spelling(Precision v);
const char* spelling(SyncFree v);
const char* spelling(Device v);
const char* spelling(Backend v);
const char* spelling(AccumulateSync v);
const char* spelling(Compression v);
const char* spelling(BestMetric v);
const char* spelling(LogLevel v);
// "auto", "none" or the path.
std::string spelling(const Resume& v);

// The element type of a precision: the one place it is decoded.
DType dtype_of(Precision v);

}  // namespace cfg

struct ModelConfig {
  cfg::Arch arch = cfg::Arch::kBert;
  cfg::Task task = cfg::Task::kPretrain;
  int64_t hidden = 256;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t kv_heads = 0;
  int64_t ffn = 1024;
  int64_t max_seq_length = 512;
  cfg::Position position = cfg::Position::kLearned;
  cfg::Mlp mlp = cfg::Mlp::kGelu;
  bool post_layer_norm = false;
  cfg::AttnImplementation attn_implementation = cfg::AttnImplementation::kAuto;
  double dropout = 0.0;
  bool gradient_checkpointing = false;
  int64_t chunk_positions = 0;  // HyenaDNA: Note [Hyena chunked block]
  int64_t chunk_channels = 0;
  int64_t num_labels = 2;
  cfg::Pooling pooling = cfg::Pooling::kCls;
  std::string init_from = "";
};

struct LoraConfig {
  int64_t r = 0;
  double alpha = 16.0;
  double dropout = 0.0;
  std::vector<std::string> target_modules = {"query", "value"};
  cfg::QuantizeBase quantize_base = cfg::QuantizeBase::kNone;
};

struct TokenizerConfig {
  cfg::TokenizerKind kind = cfg::TokenizerKind::kChar;
  int64_t k = 6;
  int64_t stride = 1;
  int64_t vocab_size = 4096;
  std::string path = "";
};

// One stage of data.seq_len_warmup (Note [Sequence-length warm-up], worker/data/data_loader.hpp).
struct SeqLenStage {
  int64_t steps = 0;    // optimizer steps at this length
  int64_t seq_len = 0;  // tokens per row, framing included
  bool operator==(const SeqLenStage& o) const { return steps == o.steps && seq_len == o.seq_len; }
};

struct DataConfig {
  std::vector<std::string> train_files;
  std::vector<std::string> eval_files;
  cfg::DataFormat format = cfg::DataFormat::kAuto;
  cfg::OnBadRecord on_bad_record = cfg::OnBadRecord::kError;
  cfg::Sampling sampling = cfg::Sampling::kRandom;
  int64_t window_stride = 0;
  cfg::NPolicy n_policy = cfg::NPolicy::kSkip;
  double max_n_fraction = 0.0;
  double reverse_complement = 0.0;
  double eval_fraction = 0.0;
  std::string train_regions = "";    // BED; Note [Genome regions] (worker/data/genome_dataset.hpp)
  std::string eval_regions = "";     // BED
  std::string exclude_regions = "";  // BED
  int64_t samples_per_epoch = 0;
  // Note [Genome weights] (worker/data/genome_dataset.hpp)
  std::vector<double> weights;  // one per training file; empty: by size
  double sampling_temperature = 1.0;
  std::string sequence_column = "sequence";
  std::string label_column = "label";
  double mlm_probability = 0.15;
  int64_t dataloader_num_workers = 1;
  int64_t prefetch_factor = 2;
  bool pin_memory = true;
  bool group_by_length = false;
  bool packing = false;
  std::string cache_dir = "";
  int64_t pack_threshold_bases = 1'000'000'000;  // Note [Genome cache]; 0: never
  std::vector<SeqLenStage> seq_len_warmup;       // empty: every step at model.max_seq_length
};

struct TrainingConfig {
  int64_t max_steps = 100;
  double num_train_epochs = 0.0;
  cfg::BatchSize batch_size = cfg::BatchSize::kMicroBatch;
  int64_t micro_batch_size = 8;
  int64_t grad_accum_steps = 1;
  double auto_batch_memory_mb = 0.0;
  double memory_limit_gb = 0.0;  // 0: available memory / ranks on the node
  double lr = 3e-4;
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  cfg::LrScheduler lr_scheduler = cfg::LrScheduler::kLinear;
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;
  double max_grad_norm = 1.0;
  cfg::Precision precision = cfg::Precision::kFp32;
  bool tf32 = false;
  cfg::SyncFree sync_free = cfg::SyncFree::kAuto;
  bool optimizer_offload = false;
  bool keep_global_batch = true;
  int64_t seed = 42;
  int64_t eval_steps = 0;
  int64_t eval_batches = 8;
  int64_t logging_steps = 10;
  cfg::Device device = cfg::Device::kAuto;
  std::string output_dir = "";
};

struct ParallelConfig {
  cfg::Backend backend = cfg::Backend::kAuto;
  int64_t zero_stage = 0;
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  cfg::AccumulateSync accumulate_sync = cfg::AccumulateSync::kLast;
  cfg::Precision grad_reduce_dtype = cfg::Precision::kFp32;
  bool find_unused_parameters = false;
  double timeout_s = 300.0;
  bool share_gpus = false;
  bool zero3_accumulate_unsharded = false;
  bool check_collectives = false;
  int64_t context_parallel = 1;
};

struct CheckpointConfig {
  std::string dir = "checkpoints";
  int64_t save_steps = 0;
  int64_t keep_last = 3;
  int64_t keep_every = 0;
  cfg::Resume resume;  // "auto"
  cfg::Compression compression = cfg::Compression::kZstd;
  int64_t compression_level = 3;
  double chunk_mb = 4.0;
  bool async = true;
  bool save_final = true;
  // Note [Best checkpoint] (worker/train/trainer.hpp): none, or the evaluation metric whose
  // best value so far keeps an export in <dir>/best.
  cfg::BestMetric best_metric = cfg::BestMetric::kNone;
};

// Note [Elastic settings]: [elastic] is read by dnallm-launch (from its own --config and
// --set, the ones it passes to the workers) and by dnallm-coordinator (--config), never by the
// workers. A flag of theirs given on the command line (--max-restarts, --nnodes,
// --heartbeat-timeout, ...) overrides the key; an absent flag leaves the configuration's value,
// so these defaults are the flags' defaults too.
struct ElasticConfig {
  int64_t min_nodes = 1;
  int64_t max_nodes = 1;
  int64_t max_restarts = 0;
  int64_t max_membership_changes = 10;
  double heartbeat_interval_s = 1.0;
  double heartbeat_timeout_s = 10.0;
  double step_timeout_s = 300.0;
  double settle_s = 2.0;
  double join_timeout_s = 600.0;
  int64_t spare_workers = 0;  // Note [In-process recovery]
  bool shrink = false;        // Note [Shrink and grow]
};

struct LoggingConfig {
  std::string metrics_file = "";
  std::string tensorboard_dir = "";
  cfg::LogLevel level = cfg::LogLevel::kInfo;
  double peak_tflops = 0.0;
};

struct Config {
  ModelConfig model;
  LoraConfig lora;
  TokenizerConfig tokenizer;
  DataConfig data;
  TrainingConfig training;
  ParallelConfig parallel;
  CheckpointConfig checkpoint;
  ElasticConfig elastic;
  LoggingConfig logging;

  // Where the configuration came from (for messages); "" for defaults only.
  std::string source_file;
};

// Loads `path` (may be empty: defaults) and applies `overrides` ("section.key=value", TOML
// value or bare word). Relative data paths stay as written (relative to the working dir).
// Throws Error(kUsage) with key, file:line and allowed values on any problem.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Parses a TOML document held in memory (`origin` names it in messages).
Config parse_config(const std::string& toml_text, const std::string& origin,
                    const std::vector<std::string>& overrides = {});

// The resolved configuration as TOML that parse_config() loads back to an equal Config.
std::string to_toml(const Config& config);

// A stable 64-bit hash of to_toml(config) restricted to what shapes the model and data
// (model, lora, tokenizer): checkpoints record it to refuse a mismatched resume.
uint64_t model_config_hash(const Config& config);

// Every valid key "section.key", in declaration order (for help and suggestions).
std::vector<std::string> config_keys();

bool operator==(const Config& a, const Config& b);

// One key set from outside the configuration, e.g. by a command-line flag that stands for it
// (dnallm-launch --max-restarts 3 = {"elastic.max_restarts", "3", "--max-restarts 3"}).
struct KeyOverride {
  std::string key;     // "section.key"
  std::string value;   // TOML value or bare word, as in --set
  std::string origin;  // names the value in messages
};

// Sets each key as --set would (same checks, messages naming `origin`), then checks the
// whole configuration again. Throws Error(kUsage).
void apply_key_overrides(Config& config, const std::vector<KeyOverride>& overrides);

// The default of "section.key" as TOML text ("0", "\"auto\"", "2.0"), e.g. for help texts.
std::string config_default(const std::string& key);

// docs/config.md: `page_template` (docs/config.md.in) with "{{aliases}}" replaced by the
// table of accepted Hugging Face / DNALLM spellings and "{{keys}}" by one table per section
// (key, default, allowed values, meaning), all rendered from the schema. Regenerate the page
// with `cmake --build build --target config-reference`. Throws Error(kUsage) when a marker is
// missing.
std::string config_reference(const std::string& page_template);

}  // namespace dnallm
