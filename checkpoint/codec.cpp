#include "checkpoint/codec.hpp"

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

ChunkEncoding encode_chunk(const uint8_t* raw, size_t raw_size, DType dtype,
                           const CodecOptions& opts, std::vector<uint8_t>& out) {
  if (opts.codec == Codec::kNone || raw_size == 0) {
    out.assign(raw, raw + raw_size);
    return ChunkEncoding::kRaw;
  }
  const size_t es = dtype_size(dtype);
  const bool grouped = opts.byte_grouping && dtype_is_floating(dtype) && es > 1;
  std::vector<uint8_t> planes;
  const uint8_t* src = raw;
  if (grouped) {
    planes.resize(raw_size);
    group_bytes(raw, raw_size / es, es, planes.data());
    src = planes.data();
  }
  out.resize(ZSTD_compressBound(raw_size));
  size_t n = ZSTD_compress(out.data(), out.size(), src, raw_size, opts.level);
  DNALLM_CHECK(!ZSTD_isError(n), ExitCode::kFailure, "ZSTD_compress failed: {}",
               ZSTD_getErrorName(n));
  if (n >= raw_size) {
    out.assign(raw, raw + raw_size);
    return ChunkEncoding::kRaw;
  }
  out.resize(n);
  return grouped ? ChunkEncoding::kGroupedZstd : ChunkEncoding::kZstd;
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
    case ChunkEncoding::kZstd:
    case ChunkEncoding::kGroupedZstd: {
      std::vector<uint8_t> planes;
      uint8_t* dst = out;
      if (enc == ChunkEncoding::kGroupedZstd) {
        planes.resize(raw_size);
        dst = planes.data();
      }
      size_t n = ZSTD_decompress(dst, raw_size, stored, stored_size);
      if (ZSTD_isError(n) || n != raw_size)
        fail(ExitCode::kCheckpointCorrupt, "{}: zstd chunk does not decode to {} bytes ({})", where,
             raw_size, ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short");
      if (enc == ChunkEncoding::kGroupedZstd) {
        const size_t es = dtype_size(dtype);
        ungroup_bytes(planes.data(), raw_size / es, es, out);
      }
      return;
    }
  }
  fail(ExitCode::kCheckpointCorrupt, "{}: unknown chunk encoding {}", where, static_cast<int>(enc));
}

}  // namespace dnallm::checkpoint
