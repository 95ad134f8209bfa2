// Counter-based randomness for the data pipeline.
//
// Note [Sample seeding]: every random choice made for a sample (window position, reverse
// complement, masking) draws from a SampleRng seeded by (seed, epoch, global sample index)
// only. No state is carried from one sample to the next, so any rank or worker thread can
// build any sample and get the same bytes: N ranks see exactly what 1 rank sees.
#pragma once

#include <cstdint>

namespace dnallm::data {

// SplitMix64 finaliser: a bijective 64-bit mixer with good avalanche.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

inline uint64_t hash_combine(uint64_t a, uint64_t b) { return mix64(a ^ mix64(b)); }

// Small, fast generator (SplitMix64 stream). Not thread-safe; make one per sample.
class SampleRng {
 public:
  explicit SampleRng(uint64_t state) : state_(state) {}
  SampleRng(uint64_t seed, uint64_t epoch, uint64_t sample_index, uint64_t stream = 0)
      : state_(hash_combine(hash_combine(hash_combine(seed, epoch), sample_index), stream)) {}

  uint64_t next_u64() {
    state_ += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n); n > 0. Multiply-shift (Lemire) without rejection: bias < n / 2^64.
  uint64_t uniform(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }
  // Uniform in [0, 1).
  double uniform01() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

}  // namespace dnallm::data
