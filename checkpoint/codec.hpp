// Chunk compression: optional byte grouping of floating-point elements, then zstd.
//
// Byte grouping (as ZipNN does) rewrites n elements of s bytes as s planes of n bytes:
// plane j holds byte j of every element. Floating-point elements are first rotated left
// by one bit, so that the whole exponent (8 bits for fp32/bf16) fills the top byte and
// the sign bit joins the mantissa. The exponent plane is highly redundant in trained
// weights and optimizer moments (a few bits of entropy); the mantissa planes are close
// to random and zstd stores them nearly as is. Stateless, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace dnallm::checkpoint {

enum class Codec : uint8_t { kNone = 0, kZstd = 1 };

// How a chunk is stored; written into each chunk's index entry.
enum class ChunkEncoding : uint8_t { kRaw = 0, kZstd = 1, kGroupedZstd = 2 };

struct CodecOptions {
  Codec codec = Codec::kZstd;
  int level = 1;  // zstd level, 1..19 (on this data 1 compresses as well as 3, 2x faster)
  bool byte_grouping = true;             // group bytes of floating-point dtypes
  size_t chunk_bytes = size_t{4} << 20;  // raw bytes per chunk (rounded to elements)
  int threads = 4;                       // chunks encoded / decoded in parallel
};

// "none" | "zstd" (also "zstd:<level>" sets the level); throws Error(kUsage) otherwise.
CodecOptions parse_codec(const std::string& text);
const char* codec_name(Codec c);

// Splits / joins byte planes. `out` must hold count * elem_size bytes.
void group_bytes(const uint8_t* in, size_t count, size_t elem_size, uint8_t* out);
void ungroup_bytes(const uint8_t* in, size_t count, size_t elem_size, uint8_t* out);

// Rotates every element of a floating-point dtype left (or right) by one bit, in place.
void rotate_sign_to_low_bit(uint8_t* data, size_t count, DType dtype);
void rotate_sign_to_high_bit(uint8_t* data, size_t count, DType dtype);

// Encodes one chunk; falls back to kRaw when compression does not shrink it.
ChunkEncoding encode_chunk(const uint8_t* raw, size_t raw_size, DType dtype,
                           const CodecOptions& opts, std::vector<uint8_t>& out);

// Decodes `stored` into exactly `raw_size` bytes at `out`. Throws Error(kCheckpointCorrupt)
// prefixed by `where` when the data does not decode to that size.
void decode_chunk(const uint8_t* stored, size_t stored_size, ChunkEncoding enc, DType dtype,
                  uint8_t* out, size_t raw_size, const std::string& where);

}  // namespace dnallm::checkpoint
