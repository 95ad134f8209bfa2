// Plain descriptions shared by every part of checkpoint/: what a tensor is, which flat
// range of it a shard holds, and what a written shard looks like from the outside.
//
// Note [Flat ranges]: every tensor is addressed in its GLOBAL flat (row-major) layout.
// A shard holds, per tensor, one element range [begin, end). A DDP shard holding whole
// tensors stores [0, numel); a ZeRO shard holding a slice of a flat buffer stores the
// slice's range of that buffer (the buffer itself is one "tensor"). Readers may ask for
// any range and get it from whichever shards overlap it; that is what resharding uses.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace dnallm::checkpoint {

// A tensor of the model or optimizer layout: name, element type and shape.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;

  uint64_t numel() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
  bool operator==(const TensorSpec& o) const {
    return name == o.name && dtype == o.dtype && shape == o.shape;
  }
  bool operator!=(const TensorSpec& o) const { return !(*this == o); }
};

// What a caller hands to a save: elements [begin, end) of `spec` (see Note [Flat ranges]),
// stored contiguously at `data` ((end - begin) * dtype_size bytes). Host memory only.
struct TensorSlice {
  TensorSpec spec;
  uint64_t begin = 0;
  uint64_t end = 0;
  const void* data = nullptr;

  uint64_t count() const { return end - begin; }
  uint64_t bytes() const { return count() * dtype_size(spec.dtype); }
};

// A range of one tensor held by one shard.
struct ShardRange {
  std::string tensor;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// A durable shard file, as reported by write_shard() and recorded in the manifest.
struct ShardDescriptor {
  int rank = 0;
  std::string file;                 // file name inside the step directory
  uint64_t bytes = 0;               // file size
  uint64_t xxh64 = 0;               // hash of the whole file (see docs/checkpoint-format.md)
  std::vector<TensorSpec> tensors;  // specs of the tensors it holds a range of
  std::vector<ShardRange> ranges;   // same order as `tensors`
};

}  // namespace dnallm::checkpoint
