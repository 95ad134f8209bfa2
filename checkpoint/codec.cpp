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
// Rotates each element left by one bit and scatters its bytes into planes, in one pass.
template <typename U>
void split_rotated(const uint8_t* in, size_t count, uint8_t* planes) {
  constexpr size_t kS = sizeof(U);
  for (size_t i = 0; i < count; ++i) {
    U u;
    std::memcpy(&u, in + i * kS, kS);
    u = static_cast<U>((u << 1) | (u >> (kS * 8 - 1)));
    for (size_t j = 0; j < kS; ++j) planes[j * count + i] = static_cast<uint8_t>(u >> (8 * j));
  }
}
template <typename U>
void join_rotated(const uint8_t* planes, size_t count, uint8_t* out) {
  constexpr size_t kS = sizeof(U);
  for (size_t i = 0; i < count; ++i) {
    U u = 0;
    for (size_t j = 0; j < kS; ++j)
      u |= static_cast<U>(static_cast<U>(planes[j * count + i]) << (8 * j));
    u = static_cast<U>((u >> 1) | (u << (kS * 8 - 1)));
    std::memcpy(out + i * kS, &u, kS);
  }
}
void split_planes(const uint8_t* in, size_t count, DType dtype, uint8_t* planes) {
  switch (dtype_size(dtype)) {
    case 2:
      split_rotated<uint16_t>(in, count, planes);
      break;
    case 4:
      split_rotated<uint32_t>(in, count, planes);
      break;
    case 8:
      split_rotated<uint64_t>(in, count, planes);
      break;
    default:
      std::memcpy(planes, in, count * dtype_size(dtype));
  }
}
void join_planes(const uint8_t* planes, size_t count, DType dtype, uint8_t* out) {
  switch (dtype_size(dtype)) {
    case 2:
      join_rotated<uint16_t>(planes, count, out);
      break;
    case 4:
      join_rotated<uint32_t>(planes, count, out);
      break;
    case 8:
      join_rotated<uint64_t>(planes, count, out);
      break;
    default:
      std::memcpy(out, planes, count * dtype_size(dtype));
  }
}

// True when a plane looks incompressible: a 64 KiB sample does not shrink by 2%.
// Mantissa planes are; skipping them keeps grouped zstd close to memcpy speed there.
bool looks_incompressible(const uint8_t* plane, size_t size, int level,
                          std::vector<uint8_t>& scratch) {
  constexpr size_t kSample = 64 * 1024;
  if (size < 4 * kSample) return false;
  scratch.resize(ZSTD_compressBound(kSample));
  const size_t n = ZSTD_compress(scratch.data(), scratch.size(), plane + size / 2, kSample, level);
  return ZSTD_isError(n) || n >= kSample - kSample / 50;
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
  std::vector<uint8_t> planes(raw_size);
  split_planes(raw, count, dtype, planes.data());
  out.assign(4 * es, 0);
  out.reserve(raw_size + 4 * es);
  std::vector<uint8_t> frame(ZSTD_compressBound(count)), probe;
  for (size_t j = 0; j < es; ++j) {
    const uint8_t* plane = planes.data() + j * count;
    size_t n = looks_incompressible(plane, count, level, probe)
                   ? count
                   : ZSTD_compress(frame.data(), frame.size(), plane, count, level);
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
      join_planes(planes.data(), count, dtype, out);
      return;
    }
  }
  fail(ExitCode::kCheckpointCorrupt, "{}: unknown chunk encoding {}", where, static_cast<int>(enc));
}

}  // namespace dnallm::checkpoint
