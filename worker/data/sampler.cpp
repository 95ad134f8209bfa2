#include "worker/data/sampler.hpp"

#include "core/error.hpp"
#include "worker/data/rng.hpp"

namespace dnallm::data {

uint64_t permute_index(uint64_t i, uint64_t n, uint64_t seed, uint64_t epoch) {
  if (n <= 1) return 0;
  int bits = 64 - __builtin_clzll(n - 1);
  int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  const uint64_t key = hash_combine(hash_combine(seed, epoch), 0x5A3D1E);
  uint64_t x = i;
  do {  // cycle walking: re-encrypt until the value falls inside [0, n)
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t f = mix64(right ^ hash_combine(key, round)) & mask;
      uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

nlohmann::json SamplerState::to_json() const {
  return nlohmann::json{{"version", 1},
                        {"seed", seed},
                        {"dataset_size", dataset_size},
                        {"consumed_samples", consumed_samples},
                        {"epoch", epoch()},
                        {"shuffle", shuffle}};
}

SamplerState SamplerState::from_json(const nlohmann::json& j) {
  try {
    SamplerState s;
    if (j.at("version").get<int>() != 1) {
      fail(ExitCode::kUsage, "sampler state version {} is not supported (1)",
           j.at("version").get<int>());
    }
    s.seed = j.at("seed").get<uint64_t>();
    s.dataset_size = j.at("dataset_size").get<uint64_t>();
    s.consumed_samples = j.at("consumed_samples").get<uint64_t>();
    s.shuffle = j.at("shuffle").get<bool>();
    return s;
  } catch (const nlohmann::json::exception& e) {
    fail(ExitCode::kUsage, "sampler state JSON is malformed: {}", e.what());
  }
}

DistributedSampler::DistributedSampler(SamplerOptions options) : options_(options) {
  if (options_.world_size <= 0 || options_.rank < 0 || options_.rank >= options_.world_size) {
    fail(ExitCode::kUsage, "rank {} is outside world size {}", options_.rank, options_.world_size);
  }
  if (options_.micro_batch_size <= 0) {
    fail(ExitCode::kUsage, "training.micro_batch_size = {} must be positive",
         options_.micro_batch_size);
  }
  if (options_.grad_accum_steps <= 0) {
    fail(ExitCode::kUsage, "training.grad_accum_steps = {} must be positive",
         options_.grad_accum_steps);
  }
  if (options_.dataset_size == 0) fail(ExitCode::kBadData, "the dataset is empty");
  global_batch_ = static_cast<uint64_t>(options_.micro_batch_size * options_.grad_accum_steps *
                                        options_.world_size);
}

SamplePosition DistributedSampler::resolve(uint64_t position) const {
  const uint64_t n = options_.dataset_size;
  SamplePosition p{position, position / n, position % n};
  if (options_.shuffle) p.index = permute_index(p.index, n, options_.seed, p.epoch);
  return p;
}

uint64_t DistributedSampler::slice_offset(int64_t micro_step) const {
  return static_cast<uint64_t>((options_.rank * options_.grad_accum_steps + micro_step) *
                               options_.micro_batch_size);
}

std::vector<uint64_t> DistributedSampler::micro_batch_positions(uint64_t cursor,
                                                                int64_t micro_step) const {
  std::vector<uint64_t> out(static_cast<size_t>(options_.micro_batch_size));
  const uint64_t first = cursor + slice_offset(micro_step);
  for (size_t k = 0; k < out.size(); ++k) out[k] = first + k;
  return out;
}

}  // namespace dnallm::data
