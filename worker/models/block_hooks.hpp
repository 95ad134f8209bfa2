// Note [Block hooks]: what a model calls around each of its blocks (the units blocks() lists),
// so that a data-parallel engine can act per block without the model knowing which: ZeRO-3
// (worker/parallel/fully_sharded.hpp) all-gathers a block's parameters before its forward,
// frees them after it and arranges their return for backward. A family runs block i as
//   h = run_block(hooks, i, [&] { return block->forward(h, ...); });
// and must touch block i's parameters only inside that call (activation checkpointing's
// recomputation happens in backward, where the hooks have gathered them again). Without
// hooks (the default) run_block is the plain call.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <utility>

namespace dnallm::models {

class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  // Before block `index`'s forward.
  virtual void before_block(size_t index) = 0;
  // After it, with the block's output; returns the tensor the model continues with (the same
  // values: a hook may attach a gradient hook to it).
  virtual torch::Tensor after_block(size_t index, torch::Tensor output) = 0;
};

template <typename Forward>
torch::Tensor run_block(BlockHooks* hooks, size_t index, Forward&& forward) {
  if (hooks == nullptr) return std::forward<Forward>(forward)();
  hooks->before_block(index);
  return hooks->after_block(index, std::forward<Forward>(forward)());
}

}  // namespace dnallm::models
