// What a model needs to know to run on a context shard (issue 26): the context group and which
// positions of the whole sequence this rank holds. See Note [Context parallelism in a model]
// (worker/models/language_model.hpp) for the model's side and docs/parallelism.md for the mesh.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace dnallm::comm {
class Communicator;
}  // namespace dnallm::comm

namespace dnallm::models {

struct ContextParallel {
  comm::Communicator* group = nullptr;  // the context group (C ranks), outlives the model's use
  int64_t full_length = 0;              // T of the whole (padded) sequence
  // Global position of each local position [T / C] (int64, ascending within each chunk):
  // contiguous ([r T/C, (r+1) T/C)) for the convolution / scan families, zig-zag chunks
  // (r and 2C-1-r of 2C) for causal attention.
  torch::Tensor positions;
};

// Which positions of a sequence a family wants on each rank of a context group (ModelSpec::
// context_layout): kContiguous, one chunk [r T/C, (r+1) T/C) (long convolutions, scans: a rank
// needs only its predecessor's boundary); kZigZag, chunks r and 2C-1-r of 2C (causal attention:
// every rank gets the same amount of work).
enum class ContextLayout { kContiguous, kZigZag };

}  // namespace dnallm::models
