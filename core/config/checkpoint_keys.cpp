// [checkpoint]: the keys of CheckpointConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

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

}  // namespace dnallm::config_detail
