// [logging]: the keys of LoggingConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

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

}  // namespace dnallm::config_detail
