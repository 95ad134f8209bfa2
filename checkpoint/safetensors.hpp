// The safetensors file format, written and parsed here and nowhere else (worker/ adapts
// tensors to it: worker/models/transformer/transformer.hpp save_safetensors/load_safetensors):
//   1. an 8-byte little-endian header length N (N a multiple of 8: the header is padded
//      with spaces so that the data section is 8-byte aligned);
//   2. N bytes of JSON: {"__metadata__": {string: string}, "name": {"dtype": "F32",
//      "shape": [..], "data_offsets": [b, e]}, ...}, offsets relative to the data section;
//   3. the raw little-endian tensor data, in header order.
// Files are written durably (checkpoint/durable_io.hpp): <path>.tmp, fsync, rename, fsync
// of the directory; a failed write leaves no file behind.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/reader.hpp"
#include "checkpoint/types.hpp"

namespace dnallm::checkpoint {

// Note [Flat parameter exports]
// Trainer checkpoints store the model as one flat buffer named kFlatParameters (plus the
// optimizer moments) and record in the state's layout (TrainState::layout, read here through
// ModelInfo) each parameter's name, offset and shape.
// export_checkpoint_model() then writes those named parameters (Hugging Face names, as the
// trainer's own export) instead of the raw stored tensors, and no optimizer state.
inline constexpr const char* kFlatParameters = "flat.params";

struct SafetensorsEntry {
  TensorSpec spec;
  uint64_t data_begin = 0;  // offsets into the data section
  uint64_t data_end = 0;
};

struct SafetensorsFile {
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // file offset of the data section
};

// Parses the header of `path`; throws Error(kCheckpointCorrupt) when it is not valid
// safetensors (not a regular file, a bad length, JSON, dtype, a negative or overflowing shape,
// data offsets that do not match the shape, lie past the end or overlap, a name twice).
SafetensorsFile read_safetensors_header(const std::filesystem::path& path);

// Reads tensors' bytes from one file. Blocks; throws Error(kCheckpointCorrupt) naming the
// file.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::filesystem::path& path);
  const SafetensorsFile& file() const { return file_; }
  // Copies the entry's data_end - data_begin bytes to `dst`.
  void read(const SafetensorsEntry& entry, void* dst);

 private:
  std::filesystem::path path_;
  SafetensorsFile file_;
  std::ifstream in_;
};

// Receives a tensor's bytes, in as many pieces as the producer likes.
using ByteSink = std::function<void(const void* data, size_t bytes)>;

// One tensor to write: `write_data` passes exactly numel(shape) * dtype_size(dtype)
// little-endian bytes to the sink (the writer checks the count).
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::function<void(const ByteSink&)> write_data;
};

// Writes `tensors` (header and data in this order) and `metadata` (omitted when empty) to
// `path` durably. Blocks; throws Error(kFailure) naming the path on an I/O error.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

class OutFile;  // checkpoint/durable_io.hpp

// Note [Safetensors in any order]: the header depends on the tensors' names, dtypes and shapes
// only, so it is written first and each tensor's bytes go to their offset whenever they are
// ready, in any order: a ZeRO-3 export writes a unit's tensors while that unit is gathered
// (models::export_live_model with a ParameterVisitor), not in the file's order, and never holds
// more than one tensor's bytes. write_safetensors() is this writer fed in the file's order.
// Durable as write_safetensors(): <path>.tmp until commit(), which fsyncs and renames it.
class SafetensorsWriter {
 public:
  // Creates <path>.tmp and writes the header of `tensors` (in this order) and `metadata`
  // (omitted when empty). Throws Error(kUsage, Note [A failed save]) on an I/O error.
  SafetensorsWriter(std::filesystem::path path, std::vector<TensorSpec> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  // Without commit(): <path>.tmp is removed, <path> untouched.
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  // Tensor `index`'s bytes: `write_data` passes exactly numel x dtype size bytes to the sink,
  // in as many pieces as it likes; they land at the tensor's offset. Once per tensor, any
  // order. Throws Error(kFailure) on a wrong count or a second write of the same tensor.
  void write(size_t index, const std::function<void(const ByteSink&)>& write_data);
  // Every tensor written (else Error(kFailure) naming the first missing one): fsync, rename
  // over <path>, fsync of the directory.
  void commit();

 private:
  std::filesystem::path path_, tmp_;
  std::vector<TensorSpec> tensors_;
  std::vector<uint64_t> offsets_;  // file offsets of each tensor's data
  std::vector<bool> written_;
  std::unique_ptr<OutFile> file_;
};

// Note [Exported model directory]
// What dnallm-eval --model, dnallm-infer and transformers (where the architecture matches)
// load, written for both exports: from a live model (models::export_live_model, the end of
// training: the same files streamed a tensor at a time, Note [Safetensors in any order]) and
// from a checkpoint (export_checkpoint_model, dnallm-ckpt export, by write_model_directory()):
//   model.safetensors          the weights under Hugging Face names
//   config.json                models::export_config() (checkpoints store it in their state)
//   tokenizer.json             when known (checkpoint state; the trainer's tokenizer hook)
//   adapter_model.safetensors  LoRA adapters alone under PEFT names (live exports with LoRA)
struct ModelDirectory {
  std::vector<SafetensorsTensor> weights;
  std::map<std::string, std::string> weights_metadata;
  std::optional<nlohmann::ordered_json> config;
  std::optional<nlohmann::ordered_json> tokenizer;
  std::vector<SafetensorsTensor> adapters;  // empty: no adapter_model.safetensors
  std::map<std::string, std::string> adapters_metadata;
};

// Creates `dir` when missing and writes every file of `model` durably. Returns the path of
// model.safetensors. Throws Error(kFailure) on an I/O error.
std::filesystem::path write_model_directory(const std::filesystem::path& dir,
                                            const ModelDirectory& model);

// The model of checkpoint `ckpt` as a model directory in `out_dir` (created when missing;
// Error(kUsage) when it names a file): the named parameters of the flat buffer (Note [Flat
// parameter exports]), else every stored tensor (names as stored, manifest order), streamed
// in 64 MiB pieces; config.json and tokenizer.json from the manifest state when present.
// Returns the safetensors path.
std::filesystem::path export_checkpoint_model(const CheckpointReader& ckpt,
                                              const std::filesystem::path& out_dir);

}  // namespace dnallm::checkpoint
