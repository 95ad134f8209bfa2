// Pure planning functions for data parallelism: how parameters are laid out in the flat
// buffers, which bucket each belongs to, which flat range each rank owns under ZeRO, and how
// many bytes each rank holds. No LibTorch and no state: the engine (ddp.hpp) keeps the live
// state; these are tested exhaustively on their own (the c10d split between
// compute_bucket_assignment_by_size and the Reducer).
//
// Note [Flat layout follows bucket order]
// Gradients become ready roughly in reverse registration order during backward (the last
// layer first). Buckets are therefore formed over the parameters in reverse registration
// order, and the flat buffer is laid out in that same order, so every bucket is one
// contiguous range [begin, end) of the flat gradient buffer: a collective on a bucket is a
// collective on a slice, with no copies. Under ZeRO a rank owns a contiguous range of the
// same flat buffer; ranges may cut through a parameter, which is harmless because AdamW is
// elementwise (the weight-decay mask is flat too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace dnallm::parallel {

// Elements in a flat range [begin, end).
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const FlatRange& o) const { return begin == o.begin && end == o.end; }
};

struct BucketPlan {
  std::vector<int64_t> params;  // parameter indices (registration order numbers), launch order
  FlatRange range;              // its slice of the flat buffer
};

struct FlatLayout {
  std::vector<int64_t> offsets;     // per parameter (registration index): flat offset
  std::vector<BucketPlan> buckets;  // in launch order (bucket 0 launches first)
  int64_t total = 0;                // elements used by parameters (including alignment gaps)
  int64_t padded_total = 0;         // total rounded up to a multiple of the world size
};

struct LayoutOptions {
  int64_t element_bytes = 4;             // bytes of one gradient element
  int64_t bucket_cap_bytes = 25 << 20;   // DDP's bucket_cap_mb, in bytes
  int64_t first_bucket_bytes = 1 << 20;  // the first bucket is small so communication starts early
  int64_t align_elements = 16;  // each parameter starts at a multiple of this (64 B for fp32)
  int64_t world_size = 1;       // padded_total is a multiple of this (reduce_scatter)
};

// Lays out parameters of the given element counts (registration order) into buckets and a
// flat buffer. Buckets take parameters in reverse registration order, closing a bucket when
// adding the next parameter would exceed the cap (the first bucket uses first_bucket_bytes);
// a parameter larger than the cap gets a bucket of its own. Deterministic: every rank computes
// the same plan from the same sizes, which is what keeps the launch order identical.
// See Note [Flat layout follows bucket order].
FlatLayout plan_flat_layout(const std::vector<int64_t>& numels, const LayoutOptions& options);

// The contiguous range of a flat buffer of `padded_total` elements owned by `rank` under
// ZeRO: equal shares (padded_total is a multiple of world_size).
FlatRange shard_range(int64_t padded_total, int64_t world_size, int64_t rank);

// Intersection of two ranges (empty range at a.begin when they do not overlap).
FlatRange intersect(const FlatRange& a, const FlatRange& b);

// Note [Fully sharded layout]: ZeRO-3 cuts the global flat buffer into units (one per block
// of the model, then the root: every other trainable parameter), each a contiguous range
// [begin, begin + numel) in unit order. A unit is padded to chunk x world elements (chunk =
// ceil(numel / world)); rank r owns elements [r chunk, (r + 1) chunk) of every unit and keeps
// its chunks back to back (local_offset), so a unit's all-gather and reduce-scatter are
// equal-sized and the rank's shard is the sum of the chunks. The padding is never stored in a
// checkpoint: the owned global range is clipped to the unit.
struct UnitShard {
  int64_t begin = 0;         // the unit's first element in the global layout
  int64_t numel = 0;         // its elements (unpadded)
  int64_t chunk = 0;         // elements each rank holds: ceil(numel / world)
  int64_t local_offset = 0;  // where this rank's chunk starts in its shard buffer
  FlatRange owned;           // this rank's elements of the global layout (may be empty)
};

// Units of the given sizes, in order, laid out from global offset 0 (no gaps), for `rank` of
// `world`. See Note [Fully sharded layout].
std::vector<UnitShard> plan_unit_shards(const std::vector<int64_t>& unit_numels, int64_t world,
                                        int64_t rank);

// Bytes a rank holds for model state, by kind, per the ZeRO paper's accounting.
struct MemoryAccount {
  int64_t params = 0;     // model (compute-precision) parameters
  int64_t grads = 0;      // gradients
  int64_t optimizer = 0;  // fp32 master weights (when compute precision is not fp32) + Adam m, v
  int64_t total() const { return params + grads + optimizer; }
};

// `numel` parameters trained in `precision` (fp32, bf16, fp16) with Adam on
// `world_size` ranks under `zero_stage`. Mixed precision: DDP 2+2+12 = 16 bytes a parameter;
// stage 1: 2+2 + 12/N; stage 2: 2 + (2+12)/N; stage 3: (2+2+12)/N, plus the units gathered
// at a time (not counted here). fp32 has no separate master copy: 4+4+8.
MemoryAccount account_memory(int64_t numel, cfg::Precision precision, int64_t zero_stage,
                             int64_t world_size);

}  // namespace dnallm::parallel
