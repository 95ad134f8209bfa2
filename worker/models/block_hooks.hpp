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
#include <functional>
#include <string>
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

// Note [Streamed build]: a model under ZeRO-3 is never whole on any rank, not even while it is
// built. A fresh model's constructor builds its blocks one after another (the same random
// numbers in the same order as ever, so every initial value is what a whole build gives); after
// block i is complete it hands the block to the thread's BlockSink, if one is installed
// (StreamedBuild). ZeRO-3's sink (FullyShardedSync) keeps this rank's chunk of the block's
// trainable parameters (rank 0's values, broadcast, as placement did) and releases their storage
// (0 bytes, shapes kept), so the host holds the root, the block being built and the chunks:
// 4 bytes a parameter / N plus one block, instead of the whole model (4 bytes a parameter on
// every rank: 28 GB a rank for a 7B model, on each of a node's 8 ranks). Placement then takes
// the chunks instead of reading the parameters. The transformer family, started from one of our
// own model directories or from a Hugging Face one (model.init_from; Note [Lazy Hugging Face
// import]), fills each block from the file as it is built (FillingSink: tensor by tensor,
// never the whole file in memory), the rest after, and adds each block's LoRA adapters (and
// under QLoRA quantizes its base linears) before the sink takes it (Note [LoRA block by block];
// ZeRO-3 keeps the chunk of its frozen fp32 base too, and of a quantized base's codes and scales:
// Note [Fully sharded quantized base]). A model probed whole (training.batch_size = "auto"), or a
// HyenaDNA or Caduceus started from a directory or given LoRA is built whole, as before. Between
// the build and placement nothing may read a streamed block's parameters (their data pointer is
// null: a read fails at once instead of computing with garbage).
class BlockSink {
 public:
  virtual ~BlockSink() = default;
  // Block `index` (blocks() order) is complete; the sink may release its parameters' storage.
  // `path`: the block's parameters' name prefix in the model ("bert.encoder.layer.3."; empty
  // where the unit is not one module: Caduceus's two directions).
  virtual void block_built(size_t index, const std::string& path, torch::nn::Module& block) = 0;
};

// Fills each block (from a file) before the next sink takes it.
class FillingSink final : public BlockSink {
 public:
  using Fill = std::function<void(const std::string& path, torch::nn::Module& block)>;
  FillingSink(BlockSink* next, Fill fill) : next_(next), fill_(std::move(fill)) {}
  void block_built(size_t index, const std::string& path, torch::nn::Module& block) override {
    fill_(path, block);
    if (next_ != nullptr) next_->block_built(index, path, block);
  }

 private:
  BlockSink* next_;
  Fill fill_;
};

inline BlockSink*& current_block_sink() {
  thread_local BlockSink* sink = nullptr;
  return sink;
}

// While alive, the blocks a model constructor on this thread builds go to `sink` (nullptr:
// none), as torch's meta-device mode scopes a build in Python.
class StreamedBuild {
 public:
  explicit StreamedBuild(BlockSink* sink) : previous_(current_block_sink()) {
    current_block_sink() = sink;
  }
  ~StreamedBuild() { current_block_sink() = previous_; }
  StreamedBuild(const StreamedBuild&) = delete;
  StreamedBuild& operator=(const StreamedBuild&) = delete;

 private:
  BlockSink* previous_;
};

// A family's constructor calls this once block `index` is complete (Note [Streamed build]).
inline void block_built(size_t index, const std::string& path, torch::nn::Module& block) {
  if (current_block_sink() != nullptr) current_block_sink()->block_built(index, path, block);
}

}  // namespace dnallm::models
