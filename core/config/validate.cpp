// Checks across keys, once every key is set (a key's own range or choices are checked as
// it is read: core/config/parse.cpp).
#include <fmt/format.h>

#include "core/config/schema.hpp"
#include "core/error.hpp"

namespace dnallm::config_detail {
namespace {

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

}  // namespace

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
                    "> 0 and data.eval_files (or data.eval_fraction, data.eval_regions)",
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
  if (!c.data.weights.empty() && c.data.sampling_temperature != 1.0) {
    bad(
        fmt::format("data.weights and data.sampling_temperature = {} both set the mix of training "
                    "files: set one",
                    c.data.sampling_temperature));
  }
  if (c.training.precision == Precision::kFp16 && c.training.device == cfg::Device::kCpu) {
    bad("training.precision = \"fp16\" needs a GPU; use \"bf16\" or \"fp32\" on CPU");
  }
  validate_seq_len_warmup(c, bad);
}

}  // namespace dnallm::config_detail
