#include "checkpoint/codec.hpp"

#include <algorithm>
#include <cstring>

#include <zstd.h>

#include "core/error.hpp"

namespace dnallm::checkpoint {

CodecOptions parse_codec(const std::string& text) {
  CodecOptions o;
  if (text == "none") {
    o.codec = Codec::kNone;
    return o;
  }
  if (text == "zstd") return o;
  if (text.rfind("zstd:", 0) == 0) {
    try {
      o.level = std::stoi(text.substr(5));
    } catch (const std::exception&) {
      o.level = 0;
    }
    if (o.level >= 1 && o.level <= 19) return o;
  }
  fail(ExitCode::kUsage,
       "unknown checkpoint compression '{}'; use \"none\", \"zstd\" or \"zstd:<1..19>\"", text);
}

const char* codec_name(Codec c) { return c == Codec::kNone ? "none" : "zstd"; }

void group_bytes(const uint8_t* in, size_t count, size_t elem_size, uint8_t* out) {
  for (size_t j = 0; j < elem_size; ++j) {
    uint8_t* plane = out + j * count;
    const uint8_t* src = in + j;
    for (size_t i = 0; i < count; ++i) plane[i] = src[i * elem_size];
  }
}

void ungroup_bytes(const uint8_t* in, size_t count, size_t elem_size, uint8_t* out) {
  for (size_t j = 0; j < elem_size; ++j) {
    const uint8_t* plane = in + j * count;
    uint8_t* dst = out + j;
    for (size_t i = 0; i < count; ++i) dst[i * elem_size] = plane[i];
  }
}

namespace {
template <typename U>
void rotate(uint8_t* data, size_t count, bool left) {
  constexpr int kBits = sizeof(U) * 8;
  for (size_t i = 0; i < count; ++i) {
    U u;
    std::memcpy(&u, data + i * sizeof(U), sizeof(U));
    u = left ? static_cast<U>((u << 1) | (u >> (kBits - 1)))
             : static_cast<U>((u >> 1) | (u << (kBits - 1)));
    std::memcpy(data + i * sizeof(U), &u, sizeof(U));
  }
}
void rotate_any(uint8_t* data, size_t count, DType dtype, bool left) {
  if (!dtype_is_floating(dtype)) return;
  switch (dtype_size(dtype)) {
    case 2:
      rotate<uint16_t>(data, count, left);
      break;
    case 4:
      rotate<uint32_t>(data, count, left);
      break;
    case 8:
      rotate<uint64_t>(data, count, left);
      break;
    default:
      break;
  }
}
}  // namespace

void rotate_sign_to_low_bit(uint8_t* data, size_t count, DType dtype) {
  rotate_any(data, count, dtype, true);
}
void rotate_sign_to_high_bit(uint8_t* data, size_t count, DType dtype) {
  rotate_any(data, count, dtype, false);
}

// Note [Grouped chunk layout]: a kGroupedZstd chunk is `es` little-endian u32 plane sizes
// followed by the planes. Each plane is compressed as its own zstd frame, so that a zstd
// block never mixes the exponent plane with a mantissa plane under one Huffman table
// (that costs most of the gain on small tensors). A plane whose frame would not be
// smaller than the plane is stored raw: stored size == plane size means raw.
namespace {
ChunkEncoding encode_grouped(const uint8_t* raw, size_t raw_size, DType dtype, int level,
                             std::vector<uint8_t>& out) {
  const size_t es = dtype_size(dtype);
  const size_t count = raw_size / es;
  std::vector<uint8_t> rotated(raw, raw + raw_size), planes(raw_size);
  rotate_sign_to_low_bit(rotated.data(), count, dtype);
  group_bytes(rotated.data(), count, es, planes.data());
  out.assign(4 * es, 0);
  std::vector<uint8_t> frame(ZSTD_compressBound(count));
  for (size_t j = 0; j < es; ++j) {
    const uint8_t* plane = planes.data() + j * count;
    size_t n = ZSTD_compress(frame.data(), frame.size(), plane, count, level);
    DNALLM_CHECK(!ZSTD_isError(n), ExitCode::kFailure, "ZSTD_compress failed: {}",
                 ZSTD_getErrorName(n));
    const uint8_t* src = n < count ? frame.data() : plane;
    n = std::min(n, count);
    for (int b = 0; b < 4; ++b) out[4 * j + b] = static_cast<uint8_t>(n >> (8 * b));
    out.insert(out.end(), src, src + n);
  }
  if (out.size() >= raw_size) {
    out.assign(raw, raw + raw_size);
    return ChunkEncoding::kRaw;
  }
  return ChunkEncoding::kGroupedZstd;
}

}  // namespace

ChunkEncoding encode_chunk(const uint8_t* raw, size_t raw_size, DType dtype,
                           const CodecOptions& opts, std::vector<uint8_t>& out) {
  if (opts.codec == Codec::kNone || raw_size == 0) {
    out.assign(raw, raw + raw_size);
    return ChunkEncoding::kRaw;
  }
  const size_t es = dtype_size(dtype);
  const bool grouped = opts.byte_grouping && dtype_is_floating(dtype) && es > 1;
  if (grouped) return encode_grouped(raw, raw_size, dtype, opts.level, out);
  out.resize(ZSTD_compressBound(raw_size));
  size_t n = ZSTD_compress(out.data(), out.size(), raw, raw_size, opts.level);
  DNALLM_CHECK(!ZSTD_isError(n), ExitCode::kFailure, "ZSTD_compress failed: {}",
               ZSTD_getErrorName(n));
  if (n >= raw_size) {
    out.assign(raw, raw + raw_size);
    return ChunkEncoding::kRaw;
  }
  out.resize(n);
  return ChunkEncoding::kZstd;
}

void decode_chunk(const uint8_t* stored, size_t stored_size, ChunkEncoding enc, DType dtype,
                  uint8_t* out, size_t raw_size, const std::string& where) {
  switch (enc) {
    case ChunkEncoding::kRaw:
      if (stored_size != raw_size)
        fail(ExitCode::kCheckpointCorrupt, "{}: raw chunk holds {} bytes, expected {}", where,
             stored_size, raw_size);
      std::memcpy(out, stored, raw_size);
      return;
    case ChunkEncoding::kZstd: {
      size_t n = ZSTD_decompress(out, raw_size, stored, stored_size);
      if (ZSTD_isError(n) || n != raw_size)
        fail(ExitCode::kCheckpointCorrupt, "{}: zstd chunk does not decode to {} bytes ({})", where,
             raw_size, ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short");
      return;
    }
    case ChunkEncoding::kGroupedZstd: {  // See Note [Grouped chunk layout]
      const size_t es = dtype_size(dtype);
      const size_t count = raw_size / es;
      if (stored_size < 4 * es)
        fail(ExitCode::kCheckpointCorrupt, "{}: grouped chunk too short", where);
      std::vector<uint8_t> planes(raw_size);
      size_t at = 4 * es;
      for (size_t j = 0; j < es; ++j) {
        size_t n = 0;
        for (int b = 0; b < 4; ++b) n |= static_cast<size_t>(stored[4 * j + b]) << (8 * b);
        if (n > count || at + n > stored_size)
          fail(ExitCode::kCheckpointCorrupt, "{}: grouped chunk plane {} overruns the chunk", where,
               j);
        uint8_t* plane = planes.data() + j * count;
        if (n == count) {
          std::memcpy(plane, stored + at, n);
        } else {
          size_t got = ZSTD_decompress(plane, count, stored + at, n);
          if (ZSTD_isError(got) || got != count)
            fail(ExitCode::kCheckpointCorrupt, "{}: plane {} does not decode to {} bytes ({})",
                 where, j, count, ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short");
        }
        at += n;
      }
      if (at != stored_size)
        fail(ExitCode::kCheckpointCorrupt, "{}: grouped chunk has {} trailing bytes", where,
             stored_size - at);
      ungroup_bytes(planes.data(), count, es, out);
      rotate_sign_to_high_bit(out, count, dtype);
      return;
    }
  }
  fail(ExitCode::kCheckpointCorrupt, "{}: unknown chunk encoding {}", where, static_cast<int>(enc));
}

}  // namespace dnallm::checkpoint
