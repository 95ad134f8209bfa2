// The training state a dnallm-train checkpoint carries in its manifest ("state", see
// docs/checkpoint-format.md): typed, with its JSON form written and read in one place
// (train_state.cpp; the key names appear nowhere else).
//
// The manifest itself treats the state as opaque JSON (any producer may commit a checkpoint,
// with any state), and tools that copy a checkpoint (reshard) copy it unchanged. Two readers:
//   TrainState::from_json  a state written by dnallm-train, for resuming: strict.
//   ModelInfo::from_json   the parts that describe the model (export, compatibility
//                          checks), from a checkpoint of any producer: each may be absent.
// Both throw Error(kCheckpointCorrupt) naming the key and the manifest when a key has the
// wrong type (or, for TrainState, a required key is missing).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dnallm::checkpoint {

class CheckpointReader;  // checkpoint/reader.hpp

// Where one parameter lies in the flat parameter buffer (kFlatParameters) of the run that
// saved it: `offset` elements from the buffer start, row-major `shape`.
struct LayoutEntry {
  std::string name;
  int64_t offset = 0;
  std::vector<int64_t> shape;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  bool operator==(const LayoutEntry& o) const {
    return name == o.name && offset == o.offset && shape == o.shape;
  }
};

// The dynamic loss scaler (optim::LossScaler): raw scale, clean steps since the last
// change, skipped steps.
struct LossScalerState {
  double scale = 1.0;
  int64_t clean_steps = 0;
  int64_t skipped = 0;
};

// Note [Dropout randomness] (worker/train/trainer.hpp): the generators' state at a step
// boundary is a function of (seed, step, rank); the scheme and the seed are the RNG state.
struct RngState {
  std::string scheme;
  uint64_t seed = 0;
};

struct TrainState {
  int64_t step = 0;
  int64_t adam_steps = 0;
  LossScalerState loss_scaler;
  // The train loader's SamplerState::to_json() (opaque here); absent when the saving run had
  // no sampler state to give.
  std::optional<nlohmann::json> sampler;
  std::optional<RngState> rng;  // absent in checkpoints from before dropout was seeded
  std::string config_hash;      // model_config_hash() as 16 hex digits
  nlohmann::json tokenizer;     // Tokenizer::to_json() (opaque here; null when none)
  std::string version;          // the dnallm-train version that saved it
  int world_size = 1;
  // The saving run's batch shape (training.keep_global_batch); absent in checkpoints from
  // before it was recorded.
  std::optional<int64_t> micro_batch_size;
  std::optional<int64_t> grad_accum_steps;
  int zero_stage = 0;
  std::vector<LayoutEntry> layout;  // the flat entries in the saving run's order
  // config.json of the exported model (models::export_config); absent in checkpoints from
  // before export read it from the checkpoint.
  std::optional<nlohmann::json> config;

  // The manifest's "state" object; from_json(to_json()) gives back an equal TrainState, and
  // to_json(from_json(j)) gives back j for every state dnallm-train writes.
  nlohmann::json to_json() const;
  // `where` names the manifest in errors. Throws Error(kCheckpointCorrupt) naming the first
  // missing or wrong-typed key.
  static TrainState from_json(const nlohmann::json& state, const std::string& where);
};

// The parts of a state that describe the model, read from a checkpoint of any producer (its
// state may hold none of them). The same keys as in TrainState.
struct ModelInfo {
  std::optional<std::string> config_hash;
  std::optional<nlohmann::json> tokenizer;
  std::optional<nlohmann::json> config;
  std::optional<std::vector<LayoutEntry>> layout;

  // Throws Error(kCheckpointCorrupt) naming the key and `where` when a key present has the
  // wrong type.
  static ModelInfo from_json(const nlohmann::json& state, const std::string& where);
};

// The manifest's path as errors name it. These three read a CheckpointReader, so they are
// defined in reader.cpp: train_state does not include the reader (no include circle).
std::string manifest_path(const CheckpointReader& ckpt);
// TrainState::from_json / ModelInfo::from_json of ckpt's manifest state.
TrainState read_train_state(const CheckpointReader& ckpt);
ModelInfo read_model_info(const CheckpointReader& ckpt);

}  // namespace dnallm::checkpoint
