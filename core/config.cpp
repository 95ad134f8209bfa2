// TOML configuration: a table of key descriptors drives parsing, validation, printing and
// the "did you mean" suggestions, so a key is declared in exactly one place.
#include "core/config.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>
#include <xxhash.h>

#include "core/error.hpp"

namespace dnallm {
namespace {

enum class Kind { kInt, kDouble, kBool, kString, kStringList };

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
  }
  return "?";
}

// One configuration key. `ptr` returns the field inside a Config; the constraints are
// checked where the value is read, so the message can name the file and line.
struct KeyDesc {
  const char* section;
  const char* name;
  Kind kind;
  std::function<void*(Config&)> ptr;
  double min = -std::numeric_limits<double>::infinity();  // numbers: inclusive bounds
  double max = std::numeric_limits<double>::infinity();
  std::vector<std::string> allowed = {};  // strings: allowed values (empty: any)

  std::string full() const { return std::string(section) + "." + name; }
};

constexpr double kInf = std::numeric_limits<double>::infinity();

#define DNALLM_FIELD(sec, field) [](Config& c) -> void* { return &c.sec.field; }

const std::vector<KeyDesc>& schema() {
  static const std::vector<KeyDesc> keys = {
      // [model]
      {"model", "arch", Kind::kString, DNALLM_FIELD(model, arch), -kInf, kInf, {"bert", "gpt"}},
      {"model",
       "task",
       Kind::kString,
       DNALLM_FIELD(model, task),
       -kInf,
       kInf,
       {"pretrain", "classification", "regression"}},
      {"model", "hidden", Kind::kInt, DNALLM_FIELD(model, hidden), 1, 65536},
      {"model", "layers", Kind::kInt, DNALLM_FIELD(model, layers), 1, 1024},
      {"model", "heads", Kind::kInt, DNALLM_FIELD(model, heads), 1, 1024},
      {"model", "ffn", Kind::kInt, DNALLM_FIELD(model, ffn), 1, 1 << 20},
      {"model", "max_seq_length", Kind::kInt, DNALLM_FIELD(model, max_seq_length), 4, 1 << 20},
      {"model",
       "position",
       Kind::kString,
       DNALLM_FIELD(model, position),
       -kInf,
       kInf,
       {"learned", "rotary"}},
      {"model",
       "attn_implementation",
       Kind::kString,
       DNALLM_FIELD(model, attn_implementation),
       -kInf,
       kInf,
       {"auto", "sdpa", "eager"}},
      {"model", "dropout", Kind::kDouble, DNALLM_FIELD(model, dropout), 0, 0.99},
      {"model", "gradient_checkpointing", Kind::kBool, DNALLM_FIELD(model, gradient_checkpointing)},
      {"model", "num_labels", Kind::kInt, DNALLM_FIELD(model, num_labels), 1, 1 << 20},
      {"model",
       "pooling",
       Kind::kString,
       DNALLM_FIELD(model, pooling),
       -kInf,
       kInf,
       {"cls", "mean"}},
      {"model", "init_from", Kind::kString, DNALLM_FIELD(model, init_from)},
      // [lora]
      {"lora", "r", Kind::kInt, DNALLM_FIELD(lora, r), 0, 4096},
      {"lora", "alpha", Kind::kDouble, DNALLM_FIELD(lora, alpha), 0, kInf},
      {"lora", "dropout", Kind::kDouble, DNALLM_FIELD(lora, dropout), 0, 0.99},
      {"lora", "target_modules", Kind::kStringList, DNALLM_FIELD(lora, target_modules)},
      {"lora",
       "quantize_base",
       Kind::kString,
       DNALLM_FIELD(lora, quantize_base),
       -kInf,
       kInf,
       {"none", "nf4"}},
      // [tokenizer]
      {"tokenizer",
       "kind",
       Kind::kString,
       DNALLM_FIELD(tokenizer, kind),
       -kInf,
       kInf,
       {"char", "kmer", "nt", "bpe"}},
      {"tokenizer", "k", Kind::kInt, DNALLM_FIELD(tokenizer, k), 3, 8},
      {"tokenizer", "stride", Kind::kInt, DNALLM_FIELD(tokenizer, stride), 1, 8},
      {"tokenizer", "vocab_size", Kind::kInt, DNALLM_FIELD(tokenizer, vocab_size), 16, 1 << 20},
      {"tokenizer", "path", Kind::kString, DNALLM_FIELD(tokenizer, path)},
      // [data]
      {"data", "train_files", Kind::kStringList, DNALLM_FIELD(data, train_files)},
      {"data", "eval_files", Kind::kStringList, DNALLM_FIELD(data, eval_files)},
      {"data",
       "format",
       Kind::kString,
       DNALLM_FIELD(data, format),
       -kInf,
       kInf,
       {"auto", "fasta", "fastq", "csv", "tsv", "jsonl"}},
      {"data",
       "on_bad_record",
       Kind::kString,
       DNALLM_FIELD(data, on_bad_record),
       -kInf,
       kInf,
       {"error", "skip"}},
      {"data",
       "sampling",
       Kind::kString,
       DNALLM_FIELD(data, sampling),
       -kInf,
       kInf,
       {"random", "tile"}},
      {"data", "window_stride", Kind::kInt, DNALLM_FIELD(data, window_stride), 0, kInf},
      {"data",
       "n_policy",
       Kind::kString,
       DNALLM_FIELD(data, n_policy),
       -kInf,
       kInf,
       {"skip", "mask"}},
      {"data", "max_n_fraction", Kind::kDouble, DNALLM_FIELD(data, max_n_fraction), 0, 1},
      {"data", "reverse_complement", Kind::kDouble, DNALLM_FIELD(data, reverse_complement), 0, 1},
      {"data", "eval_fraction", Kind::kDouble, DNALLM_FIELD(data, eval_fraction), 0, 0.9},
      {"data", "samples_per_epoch", Kind::kInt, DNALLM_FIELD(data, samples_per_epoch), 0, kInf},
      {"data", "sequence_column", Kind::kString, DNALLM_FIELD(data, sequence_column)},
      {"data", "label_column", Kind::kString, DNALLM_FIELD(data, label_column)},
      {"data", "mlm_probability", Kind::kDouble, DNALLM_FIELD(data, mlm_probability), 0.001, 0.999},
      {"data", "dataloader_num_workers", Kind::kInt, DNALLM_FIELD(data, dataloader_num_workers), 0,
       64},
      {"data", "prefetch_factor", Kind::kInt, DNALLM_FIELD(data, prefetch_factor), 1, 64},
      {"data", "pin_memory", Kind::kBool, DNALLM_FIELD(data, pin_memory)},
      {"data", "group_by_length", Kind::kBool, DNALLM_FIELD(data, group_by_length)},
      {"data", "packing", Kind::kBool, DNALLM_FIELD(data, packing)},
      {"data", "cache_dir", Kind::kString, DNALLM_FIELD(data, cache_dir)},
      // [training]
      {"training", "max_steps", Kind::kInt, DNALLM_FIELD(training, max_steps), 0, kInf},
      {"training", "num_train_epochs", Kind::kDouble, DNALLM_FIELD(training, num_train_epochs), 0,
       kInf},
      {"training",
       "batch_size",
       Kind::kString,
       DNALLM_FIELD(training, batch_size),
       -kInf,
       kInf,
       {"", "auto"}},
      {"training", "micro_batch_size", Kind::kInt, DNALLM_FIELD(training, micro_batch_size), 1,
       1 << 20},
      {"training", "grad_accum_steps", Kind::kInt, DNALLM_FIELD(training, grad_accum_steps), 1,
       1 << 20},
      {"training", "auto_batch_memory_mb", Kind::kDouble,
       DNALLM_FIELD(training, auto_batch_memory_mb), 0, kInf},
      {"training", "lr", Kind::kDouble, DNALLM_FIELD(training, lr), 0, 10},
      {"training", "weight_decay", Kind::kDouble, DNALLM_FIELD(training, weight_decay), 0, 10},
      {"training", "adam_beta1", Kind::kDouble, DNALLM_FIELD(training, adam_beta1), 0, 0.999999},
      {"training", "adam_beta2", Kind::kDouble, DNALLM_FIELD(training, adam_beta2), 0, 0.999999},
      {"training", "adam_epsilon", Kind::kDouble, DNALLM_FIELD(training, adam_epsilon), 1e-12, 1},
      {"training",
       "lr_scheduler",
       Kind::kString,
       DNALLM_FIELD(training, lr_scheduler),
       -kInf,
       kInf,
       {"constant", "linear", "cosine"}},
      {"training", "warmup_steps", Kind::kInt, DNALLM_FIELD(training, warmup_steps), 0, kInf},
      {"training", "warmup_ratio", Kind::kDouble, DNALLM_FIELD(training, warmup_ratio), 0, 1},
      {"training", "max_grad_norm", Kind::kDouble, DNALLM_FIELD(training, max_grad_norm), 0, kInf},
      {"training",
       "precision",
       Kind::kString,
       DNALLM_FIELD(training, precision),
       -kInf,
       kInf,
       {"fp32", "bf16", "fp16"}},
      {"training", "tf32", Kind::kBool, DNALLM_FIELD(training, tf32)},
      {"training",
       "sync_free",
       Kind::kString,
       DNALLM_FIELD(training, sync_free),
       -kInf,
       kInf,
       {"auto", "on", "off"}},
      {"training", "optimizer_offload", Kind::kBool, DNALLM_FIELD(training, optimizer_offload)},
      {"training", "keep_global_batch", Kind::kBool, DNALLM_FIELD(training, keep_global_batch)},
      {"training", "seed", Kind::kInt, DNALLM_FIELD(training, seed), 0, kInf},
      {"training", "eval_steps", Kind::kInt, DNALLM_FIELD(training, eval_steps), 0, kInf},
      {"training", "eval_batches", Kind::kInt, DNALLM_FIELD(training, eval_batches), 1, kInf},
      {"training", "logging_steps", Kind::kInt, DNALLM_FIELD(training, logging_steps), 1, kInf},
      {"training",
       "device",
       Kind::kString,
       DNALLM_FIELD(training, device),
       -kInf,
       kInf,
       {"auto", "cpu", "cuda"}},
      {"training", "output_dir", Kind::kString, DNALLM_FIELD(training, output_dir)},
      // [parallel]
      {"parallel",
       "backend",
       Kind::kString,
       DNALLM_FIELD(parallel, backend),
       -kInf,
       kInf,
       {"auto", "gloo", "mpi", "nccl"}},
      {"parallel", "zero_stage", Kind::kInt, DNALLM_FIELD(parallel, zero_stage), 0, 2},
      {"parallel", "bucket_cap_mb", Kind::kDouble, DNALLM_FIELD(parallel, bucket_cap_mb), 0.001,
       65536},
      {"parallel", "first_bucket_mb", Kind::kDouble, DNALLM_FIELD(parallel, first_bucket_mb), 0.001,
       65536},
      {"parallel",
       "accumulate_sync",
       Kind::kString,
       DNALLM_FIELD(parallel, accumulate_sync),
       -kInf,
       kInf,
       {"last", "every"}},
      {"parallel",
       "grad_reduce_dtype",
       Kind::kString,
       DNALLM_FIELD(parallel, grad_reduce_dtype),
       -kInf,
       kInf,
       {"fp32", "bf16", "fp16"}},
      {"parallel", "find_unused_parameters", Kind::kBool,
       DNALLM_FIELD(parallel, find_unused_parameters)},
      {"parallel", "timeout_s", Kind::kDouble, DNALLM_FIELD(parallel, timeout_s), 0.1, 86400},
      {"parallel", "share_gpus", Kind::kBool, DNALLM_FIELD(parallel, share_gpus)},
      // [checkpoint]
      {"checkpoint", "dir", Kind::kString, DNALLM_FIELD(checkpoint, dir)},
      {"checkpoint", "save_steps", Kind::kInt, DNALLM_FIELD(checkpoint, save_steps), 0, kInf},
      {"checkpoint", "keep_last", Kind::kInt, DNALLM_FIELD(checkpoint, keep_last), 0, kInf},
      {"checkpoint", "keep_every", Kind::kInt, DNALLM_FIELD(checkpoint, keep_every), 0, kInf},
      {"checkpoint", "resume", Kind::kString, DNALLM_FIELD(checkpoint, resume)},
      {"checkpoint",
       "compression",
       Kind::kString,
       DNALLM_FIELD(checkpoint, compression),
       -kInf,
       kInf,
       {"zstd", "none"}},
      {"checkpoint", "compression_level", Kind::kInt, DNALLM_FIELD(checkpoint, compression_level),
       1, 19},
      {"checkpoint", "chunk_mb", Kind::kDouble, DNALLM_FIELD(checkpoint, chunk_mb), 0.0625, 1024},
      {"checkpoint", "async", Kind::kBool, DNALLM_FIELD(checkpoint, async)},
      {"checkpoint", "save_final", Kind::kBool, DNALLM_FIELD(checkpoint, save_final)},
      // [elastic]
      {"elastic", "min_nodes", Kind::kInt, DNALLM_FIELD(elastic, min_nodes), 1, 1 << 20},
      {"elastic", "max_nodes", Kind::kInt, DNALLM_FIELD(elastic, max_nodes), 1, 1 << 20},
      {"elastic", "max_restarts", Kind::kInt, DNALLM_FIELD(elastic, max_restarts), 0, 1 << 20},
      {"elastic", "max_membership_changes", Kind::kInt,
       DNALLM_FIELD(elastic, max_membership_changes), 0, 1 << 20},
      {"elastic", "heartbeat_interval_s", Kind::kDouble,
       DNALLM_FIELD(elastic, heartbeat_interval_s), 0.01, 3600},
      {"elastic", "heartbeat_timeout_s", Kind::kDouble, DNALLM_FIELD(elastic, heartbeat_timeout_s),
       0.1, 86400},
      {"elastic", "step_timeout_s", Kind::kDouble, DNALLM_FIELD(elastic, step_timeout_s), 1,
       864000},
      {"elastic", "settle_s", Kind::kDouble, DNALLM_FIELD(elastic, settle_s), 0, 3600},
      // [logging]
      {"logging", "metrics_file", Kind::kString, DNALLM_FIELD(logging, metrics_file)},
      {"logging", "tensorboard_dir", Kind::kString, DNALLM_FIELD(logging, tensorboard_dir)},
      {"logging",
       "level",
       Kind::kString,
       DNALLM_FIELD(logging, level),
       -kInf,
       kInf,
       {"trace", "debug", "info", "warn", "error", "critical", "off"}},
      {"logging", "peak_tflops", Kind::kDouble, DNALLM_FIELD(logging, peak_tflops), 0, 1e6},
  };
  return keys;
}
#undef DNALLM_FIELD

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

// Reads `node` into the field described by `k`; `at` is "file:line" or "--set key=value".
void assign(Config& c, const KeyDesc& k, const toml::node& node, const std::string& at) {
  void* field = k.ptr(c);
  auto type_error = [&]() -> void {
    fail(ExitCode::kUsage, "{}: key '{}' must be {}{}; fix the value", at, k.full(),
         kind_name(k.kind),
         k.allowed.empty() ? std::string() : " (one of " + join(k.allowed) + ")");
  };
  switch (k.kind) {
    case Kind::kInt: {
      auto v = node.value_exact<int64_t>();
      if (!v) type_error();
      if (static_cast<double>(*v) < k.min || static_cast<double>(*v) > k.max) {
        fail(ExitCode::kUsage, "{}: key '{}' is {}, must be {}", at, k.full(), *v, range_text(k));
      }
      *static_cast<int64_t*>(field) = *v;
      break;
    }
    case Kind::kDouble: {
      std::optional<double> v;
      if (node.is_floating_point()) v = node.value_exact<double>();
      if (node.is_integer()) v = static_cast<double>(*node.value_exact<int64_t>());
      if (!v) type_error();
      if (!std::isfinite(*v) || *v < k.min || *v > k.max) {
        fail(ExitCode::kUsage, "{}: key '{}' is {}, must be {}", at, k.full(), *v, range_text(k));
      }
      *static_cast<double*>(field) = *v;
      break;
    }
    case Kind::kBool: {
      auto v = node.value_exact<bool>();
      if (!v) type_error();
      *static_cast<bool*>(field) = *v;
      break;
    }
    case Kind::kString: {
      auto v = node.value_exact<std::string>();
      if (!v) type_error();
      if (!k.allowed.empty() &&
          std::find(k.allowed.begin(), k.allowed.end(), *v) == k.allowed.end()) {
        fail(ExitCode::kUsage, "{}: key '{}' is \"{}\", allowed values are {}", at, k.full(), *v,
             join(k.allowed));
      }
      *static_cast<std::string*>(field) = *v;
      break;
    }
    case Kind::kStringList: {
      std::vector<std::string> out;
      if (auto s = node.value_exact<std::string>()) {
        out.push_back(*s);  // a single string is a list of one
      } else if (const auto* arr = node.as_array()) {
        for (const auto& el : *arr) {
          auto s2 = el.value_exact<std::string>();
          if (!s2) type_error();
          out.push_back(*s2);
        }
      } else {
        type_error();
      }
      *static_cast<std::vector<std::string>*>(field) = std::move(out);
      break;
    }
  }
}

// Applies an alias. `bf16`/`fp16` are booleans that select a precision.
void assign_alias(Config& c, const Alias& a, const toml::node& node, const std::string& at) {
  std::string name = a.name;
  if (name == "bf16" || name == "fp16") {
    auto v = node.value_exact<bool>();
    if (!v) fail(ExitCode::kUsage, "{}: key '{}' must be true or false", at, name);
    if (*v) {
      c.training.precision = name;
    } else if (c.training.precision == name) {
      c.training.precision = "fp32";
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

void validate(const Config& c, const std::string& origin) {
  auto bad = [&](const std::string& what) {
    fail(ExitCode::kUsage, "{}: {}", origin.empty() ? "configuration" : origin, what);
  };
  if (c.model.hidden % c.model.heads != 0) {
    bad(fmt::format("model.hidden ({}) must be divisible by model.heads ({})", c.model.hidden,
                    c.model.heads));
  }
  if (c.elastic.min_nodes > c.elastic.max_nodes) {
    bad(fmt::format("elastic.min_nodes ({}) must not exceed elastic.max_nodes ({})",
                    c.elastic.min_nodes, c.elastic.max_nodes));
  }
  if (c.training.max_steps == 0 && c.training.num_train_epochs <= 0) {
    bad("set training.max_steps or training.num_train_epochs (both are 0)");
  }
  if (c.tokenizer.kind == "kmer" && c.tokenizer.stride > c.tokenizer.k) {
    bad(fmt::format("tokenizer.stride ({}) must not exceed tokenizer.k ({})", c.tokenizer.stride,
                    c.tokenizer.k));
  }
  if (c.training.precision == "fp16" && c.training.device == "cpu") {
    bad("training.precision = \"fp16\" needs a GPU; use \"bf16\" or \"fp32\" on CPU");
  }
}

void apply_table(Config& c, const toml::table& root, const std::string& origin) {
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

// `--set section.key=value`: the value is TOML, or a bare word taken as a string.
void apply_override(Config& c, const std::string& spec) {
  auto eq = spec.find('=');
  if (eq == std::string::npos || eq == 0) {
    fail(ExitCode::kUsage, "--set '{}': expected section.key=value (e.g. training.lr=3e-4)", spec);
  }
  std::string path = spec.substr(0, eq);
  std::string value = spec.substr(eq + 1);
  std::string at = fmt::format("--set {}", spec);
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
  } else {
    std::string section = path.substr(0, dot);
    if (std::find(section_names().begin(), section_names().end(), section) ==
        section_names().end()) {
      std::string hint = suggest_section(section);
      fail(ExitCode::kUsage, "{}: unknown section '{}'{}", at, section,
           hint.empty() ? std::string() : "; did you mean '" + hint + "'?");
    }
    set_key(c, section, path.substr(dot + 1), node, at);
  }
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
      return toml_string(*static_cast<std::string*>(f));
    case Kind::kStringList: {
      std::vector<std::string> parts;
      for (const auto& s : *static_cast<std::vector<std::string>*>(f))
        parts.push_back(toml_string(s));
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
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    fail(ExitCode::kUsage, "cannot read configuration file '{}': {}; check the --config path", path,
         errno_string());
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.empty()) text = "\n";  // an empty file is valid: defaults
  return parse_config(text, path, overrides);
}

std::string to_toml(const Config& config) { return sections_toml(config, {}); }

uint64_t model_config_hash(const Config& config) {
  // Note [Model hash across releases]: checkpoints store this hash and resume refuses another
  // one, so a [model]/[lora]/[tokenizer] key added after checkpoints exist joins the hash only
  // when it is set to something other than its default; list such keys here.
  static const std::vector<std::string> kAddedLater = {"lora.quantize_base"};
  std::string text = sections_toml(config, {"model", "lora", "tokenizer"}, kAddedLater);
  return XXH64(text.data(), text.size(), 0);
}

std::vector<std::string> config_keys() {
  std::vector<std::string> out;
  for (const auto& k : schema()) out.push_back(k.full());
  return out;
}

bool operator==(const Config& a, const Config& b) { return to_toml(a) == to_toml(b); }

}  // namespace dnallm
