// The safetensors file format, written and parsed here: an 8-byte little-endian header
// length, a JSON header {"name": {"dtype", "shape", "data_offsets": [b, e]}, ...,
// "__metadata__": {string: string}}, then the raw little-endian tensor data.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/reader.hpp"
#include "checkpoint/types.hpp"

namespace dnallm::checkpoint {

// Note [Flat parameter exports]
// Trainer checkpoints store the model as one flat buffer named kFlatParameters (plus the
// optimizer moments) and record in the state's layout (TrainState::layout, read here through
// ModelInfo) each parameter's name, offset and shape.
// export_model() then writes those named parameters (Hugging Face names, as the trainer's own
// export) instead of the raw stored tensors, and no optimizer state.
inline constexpr const char* kFlatParameters = "flat.params";

// "F32", "BF16", ... for a DType.
const char* safetensors_dtype(DType t);

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

// Parses the header of `path`; throws Error(kBadData) when it is not valid safetensors.
SafetensorsFile read_safetensors_header(const std::filesystem::path& path);

// Writes every tensor of `ckpt` (names as stored, manifest order) to <out_dir>/
// model.safetensors, and, when present in the manifest state, state["config"] to
// config.json and state["tokenizer"] to tokenizer.json. Streams tensors in 64 MiB pieces.
// Returns the safetensors path.
std::filesystem::path export_model(const CheckpointReader& ckpt,
                                   const std::filesystem::path& out_dir);

}  // namespace dnallm::checkpoint
