// The run configuration: typed sections with defaults, loaded from TOML and `--set` overrides.
//
// Precedence: `--set section.key=value` > file > defaults. Keys and sections follow
// DESIGN.md; Hugging Face / DNALLM spellings are accepted as aliases (see docs/config.md).
// Every error is an Error(kUsage) naming the key, the file:line and what is allowed.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dnallm {

struct ModelConfig {
  std::string arch = "bert";                 // "bert" (masked LM) | "gpt" (causal LM)
  std::string task = "pretrain";             // "pretrain" | "classification" | "regression"
  int64_t hidden = 256;                      // model width
  int64_t layers = 4;                        // transformer blocks
  int64_t heads = 4;                         // attention heads; hidden % heads == 0
  int64_t ffn = 1024;                        // feed-forward inner width
  int64_t max_seq_length = 512;              // tokens per sequence, [CLS]/[SEP] included
  std::string position = "learned";          // "learned" | "rotary"
  std::string attn_implementation = "auto";  // "auto" | "sdpa" | "eager"
  double dropout = 0.0;                      // dropout probability (0 keeps runs deterministic)
  bool gradient_checkpointing = false;
  int64_t num_labels = 2;       // classification classes (regression: 1)
  std::string pooling = "cls";  // "cls" | "mean", for classification/regression heads
  std::string init_from = "";   // exported model directory to start from (fine-tuning)
};

struct LoraConfig {
  int64_t r = 0;        // adapter rank; 0 disables LoRA
  double alpha = 16.0;  // scaling = alpha / r
  double dropout = 0.0;
  std::vector<std::string> target_modules = {"query", "value"};
  // "nf4": QLoRA, the frozen base linears of the blocks stored in 4 bits (docs/inference.md).
  std::string quantize_base = "none";
};

struct TokenizerConfig {
  std::string kind = "char";  // "char" | "kmer" | "bpe"
  int64_t k = 6;              // k-mer length (3..8)
  int64_t stride = 1;         // k-mer stride: 1 overlapping, k non-overlapping
  int64_t vocab_size = 4096;  // bpe: vocabulary size to train
  std::string path = "";      // bpe: model file to load, or where to save a trained one
};

struct DataConfig {
  std::vector<std::string> train_files;
  std::vector<std::string> eval_files;
  std::string format = "auto";          // "auto" | "fasta" | "fastq" | "csv" | "tsv" | "jsonl"
  std::string on_bad_record = "error";  // "error" | "skip"
  std::string sampling = "random";      // genomes: "random" windows | "tile" (strided)
  int64_t window_stride = 0;            // "tile": bases between window starts; 0 = window length
  std::string n_policy = "skip";        // runs of N: "skip" windows with N | "mask" them
  double max_n_fraction = 0.0;          // "skip": windows with more N than this are skipped
  double reverse_complement = 0.0;      // probability of reverse-complementing a window
  double eval_fraction = 0.0;           // hold out the last fraction of each genome for eval
  int64_t samples_per_epoch = 0;        // "random": windows per epoch; 0 = genome length / window
  std::string sequence_column = "sequence";
  std::string label_column = "label";
  double mlm_probability = 0.15;       // masked LM: fraction of tokens selected
  int64_t dataloader_num_workers = 1;  // background threads preparing batches
  int64_t prefetch_factor = 2;         // batches queued per worker
  bool pin_memory = true;              // pinned host buffers when training on CUDA
  bool group_by_length = false;        // bucket similar lengths together (tables)
  bool packing = false;                // pack short records into max_seq_length rows
  std::string cache_dir = "";          // where .fai / offset indexes go when data dir is read-only
};

struct TrainingConfig {
  int64_t max_steps = 100;  // optimizer steps; 0 = use num_train_epochs
  double num_train_epochs = 0.0;
  std::string batch_size = "";   // "" = micro_batch_size; "auto" = largest that fits
  int64_t micro_batch_size = 8;  // sequences per rank per micro-step
  int64_t grad_accum_steps = 1;
  // batch_size = "auto" on CPU: a trial micro-step fits when the process's resident memory
  // (plus the AdamW state still to come) stays within this many MiB; 0 = 80% of the memory
  // available at start divided among the node's ranks, plus what the process already holds.
  double auto_batch_memory_mb = 0.0;
  double lr = 3e-4;
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  std::string lr_scheduler = "linear";  // "constant" | "linear" | "cosine"
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;       // used when warmup_steps == 0
  double max_grad_norm = 1.0;      // 0 disables clipping
  std::string precision = "fp32";  // "fp32" | "bf16" | "fp16"
  bool tf32 = false;
  // Note [Sync-free step] (worker/train/trainer.hpp): "auto" = on for accelerators.
  std::string sync_free = "auto";  // "auto" | "on" | "off"
  // Note [Optimizer offload] (worker/train/trainer.hpp): AdamW moments in host memory.
  bool optimizer_offload = false;
  // On resume at another world size, change grad_accum_steps so the global batch stays.
  bool keep_global_batch = true;
  int64_t seed = 42;
  int64_t eval_steps = 0;    // 0 disables evaluation
  int64_t eval_batches = 8;  // micro-batches per evaluation
  int64_t logging_steps = 10;
  std::string device = "auto";  // "auto" | "cpu" | "cuda"
  std::string output_dir = "";  // exported model goes to <checkpoint.dir>/final when empty
};

struct ParallelConfig {
  std::string backend = "auto";  // "auto" | "gloo" | "mpi" | "nccl"
  int64_t zero_stage = 0;        // 0 | 1 | 2
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  std::string accumulate_sync = "last";    // "last" | "every"
  std::string grad_reduce_dtype = "fp32";  // "fp32" | "bf16" | "fp16"
  bool find_unused_parameters = false;
  double timeout_s = 300.0;  // collective timeout
  bool share_gpus = false;   // allow more ranks on a node than visible GPUs
};

struct CheckpointConfig {
  std::string dir = "checkpoints";
  int64_t save_steps = 0;            // 0 disables checkpoints
  int64_t keep_last = 3;             // 0 keeps all
  int64_t keep_every = 0;            // also keep every K-th step; 0 off
  std::string resume = "auto";       // "auto" | "none" | a step directory
  std::string compression = "zstd";  // "zstd" | "none"
  int64_t compression_level = 3;     // zstd level 1..19
  double chunk_mb = 4.0;             // chunk size of shard files
  bool async = true;                 // write on a background thread
  bool save_final = true;            // export <dir>/final at the end
};

struct ElasticConfig {
  int64_t min_nodes = 1;
  int64_t max_nodes = 1;
  int64_t max_restarts = 3;  // worker failures tolerated for the whole job
  int64_t max_membership_changes = 10;
  double heartbeat_interval_s = 1.0;
  double heartbeat_timeout_s = 10.0;
  double step_timeout_s = 300.0;  // no step progress for this long: hang
  double settle_s = 2.0;          // wait after min_nodes joined before closing a round
};

struct LoggingConfig {
  std::string metrics_file = "";
  std::string tensorboard_dir = "";  // TensorBoard event files (rank 0); "" = none
  std::string level = "info";
  // Peak dense TFLOP/s of one device for MFU; 0: known devices by name (H100/H200 989,
  // A100 312 bf16), none on CPU (then MFU is not reported).
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

}  // namespace dnallm
