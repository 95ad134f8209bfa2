// The metrics of a run, written from one structured event at a time.
//
// Every event is one JSON object (the fields of each kind: docs/metrics.md, the one place
// they are defined). write() appends it as one line to the JSON Lines file
// (logging.metrics_file / --metrics-file) and, with logging.tensorboard_dir, adds every
// number in it as a TensorBoard scalar tagged "<event>/<key>" at the event's step: an object
// without "event" is a training step ("train/loss", "train/lr", ...), "step" itself is not a
// scalar, and an event without a step (the summary) takes the step of the last event that had
// one. Strings, booleans and nested objects stay in the JSON Lines file only.
//
// Only rank 0 writes. Not thread-safe: one thread (the training loop) calls write().
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensorboard.hpp"

namespace dnallm {

struct MetricsOptions {
  std::string jsonl_path;       // "" = no JSON Lines file
  bool append = false;          // append to jsonl_path (a resumed run) instead of truncating
  std::string tensorboard_dir;  // "" = no TensorBoard events
};

// The scalars TensorBoard gets from `event`: ("<event>/<key>", value) for every number but
// "step", in the object's order.
std::vector<std::pair<std::string, double>> tensorboard_scalars(
    const nlohmann::ordered_json& event);

class MetricsWriter {
 public:
  // Opens what `options` names (creating parent directories). Throws Error(kUsage) naming
  // the path when it cannot be written.
  explicit MetricsWriter(const MetricsOptions& options);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // One event: a line in the JSON Lines file (flushed) and one TensorBoard record.
  void write(const nlohmann::ordered_json& event);
  // The TensorBoard event file ("" when none).
  std::string tensorboard_path() const;

 private:
  std::string jsonl_path_;
  std::ofstream jsonl_;
  std::unique_ptr<EventFileWriter> tensorboard_;
  int64_t tensorboard_step_ = 0;  // step of the last event that had one
};

}  // namespace dnallm
