// Everything a trainer needs from checkpoint/ (see docs/checkpoint-format.md):
//   describe:  TensorSpec, TensorSlice (types.hpp), CodecOptions / parse_codec (codec.hpp)
//   save:      AsyncWriter::save / wait (async_writer.hpp), or write_shard (shard_file.hpp)
//   commit:    commit_step, descriptor_to_json / descriptor_from_json (manifest.hpp)
//   resume:    find_resume, check_compatible, CheckpointReader::read_range (reader.hpp)
//   state:     TrainState, the manifest's training state (train_state.hpp)
//   retention: apply_retention (retention.hpp)
//   export:    export_model (safetensors.hpp), reshard (reshard.hpp)
#pragma once

#include "checkpoint/async_writer.hpp"
#include "checkpoint/codec.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/reshard.hpp"
#include "checkpoint/retention.hpp"
#include "checkpoint/safetensors.hpp"
#include "checkpoint/shard_file.hpp"
#include "checkpoint/train_state.hpp"
#include "checkpoint/types.hpp"
