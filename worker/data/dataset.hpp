// A dataset is a fixed-size, indexable collection of samples for one epoch.
//
// get(index, rng) is const and thread-safe: loader workers call it concurrently. Every
// random choice it makes comes from `rng` (see Note [Sample seeding] in rng.hpp), so the
// same (index, rng seed) always gives the same sample.
#pragma once

#include <cstdint>
#include <string>

#include "worker/data/rng.hpp"

namespace dnallm::data {

struct Sample {
  std::string bases;        // upper-case A C G T N
  int64_t label = -1;       // classification class; -1 when the dataset has none
  float target = 0.0F;      // regression value
  bool has_target = false;  // a regression target is present
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual uint64_t size() const = 0;  // samples per epoch, > 0
  virtual Sample get(uint64_t index, SampleRng& rng) const = 0;
  // Records dropped under on_bad_record = "skip" (0 under "error").
  virtual int64_t skipped_records() const = 0;
  // A short description for logs ("genome: 1 record, 4.6 Mbases, 9072 windows of 510").
  virtual std::string describe() const = 0;
};

}  // namespace dnallm::data
