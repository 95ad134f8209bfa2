// The distributed sampler: which dataset sample each rank's micro-batch holds.
//
// Note [Global sample stream]: samples form one infinite stream of positions p = 0, 1, 2,
// ... Position p belongs to epoch e = p / N (N = dataset size) and reads dataset index
// permute_index(p % N, N, seed, e) (a seeded bijection, so every epoch visits every index
// once; identity without shuffle). All random choices for the sample at p are seeded by
// (seed, e, p) (Note [Sample seeding]).
//
// Optimizer steps consume the stream in global batches of G = micro_batch_size ×
// grad_accum_steps × world_size positions: the step starting at cursor c holds
// [c, c + G). Within it, rank r's micro-step m takes the contiguous slice
// [c + (r·accum + m)·mbs, + mbs). Hence which samples a global batch holds depends only on
// (seed, epoch, cursor), never on the world size; one rank with accum = k·A sees the same
// samples as k ranks with accum = A.
//
// The state is the cursor (consumed_samples), saved at a step boundary. Restoring on any
// world size continues at that cursor: no sample is repeated or skipped, even when the new
// world size changes G.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

namespace dnallm::data {

// A pseudo-random permutation of [0, n) keyed by (seed, epoch): a 4-round Feistel network on
// the smallest even-bit power of two >= n, with cycle walking. O(1) memory, so it scales to
// any record count. Requires i < n.
uint64_t permute_index(uint64_t i, uint64_t n, uint64_t seed, uint64_t epoch);

struct SamplerState {
  uint64_t seed = 42;
  uint64_t dataset_size = 0;
  uint64_t consumed_samples = 0;  // stream cursor at a step boundary
  bool shuffle = true;

  uint64_t epoch() const { return dataset_size == 0 ? 0 : consumed_samples / dataset_size; }
  // {"version":1,"seed":..,"dataset_size":..,"consumed_samples":..,"epoch":..,"shuffle":..}
  nlohmann::json to_json() const;
  // Error(kUsage) on a malformed document.
  static SamplerState from_json(const nlohmann::json& j);
};

struct SamplerOptions {
  uint64_t dataset_size = 0;
  uint64_t seed = 42;
  bool shuffle = true;
  int64_t micro_batch_size = 8;
  int64_t grad_accum_steps = 1;
  int rank = 0;
  int world_size = 1;
};

// Where a stream position lands.
struct SamplePosition {
  uint64_t position;  // global sample index (stream position), seeds the sample's rng
  uint64_t epoch;
  uint64_t index;  // dataset index
};

class DistributedSampler {
 public:
  // Error(kUsage) on bad options (rank outside [0, world), non-positive sizes).
  explicit DistributedSampler(SamplerOptions options);

  uint64_t global_batch_size() const { return global_batch_; }
  const SamplerOptions& options() const { return options_; }

  SamplePosition resolve(uint64_t position) const;
  // Stream positions of this rank's micro-step `micro_step` of the step starting at `cursor`.
  std::vector<uint64_t> micro_batch_positions(uint64_t cursor, int64_t micro_step) const;
  // Offset within the global batch of this rank's micro-step slice.
  uint64_t slice_offset(int64_t micro_step) const;

 private:
  SamplerOptions options_;
  uint64_t global_batch_;
};

}  // namespace dnallm::data
