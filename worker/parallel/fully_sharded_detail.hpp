// Internal to FullyShardedSync (fully_sharded.cpp, fully_sharded_place.cpp): the unit buffers'
// layout and storage helpers both files use. Not part of the interface.
#pragma once

#include <c10/core/StorageImpl.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <set>
#include <vector>

#include "worker/models/block_hooks.hpp"
#include "worker/models/lora_linear.hpp"
#include "worker/parallel/fully_sharded.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::parallel::detail {

inline constexpr int64_t kAlign =
    16;  // elements: each parameter starts 64 bytes in, as DDP's layout

inline int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The elements a tensor takes in a unit's fp32 buffer: a floating-point one its own (a parameter,
// or a QLoRA base's fp32 scales), an integer one its bytes in 4-byte words (a QLoRA base's NF4
// codes and int8 block scales: Note [Fully sharded quantized base]).
inline int64_t slots(const torch::Tensor& t) {
  if (t.is_floating_point()) return t.numel();
  return (t.numel() * static_cast<int64_t>(t.element_size()) + 3) / 4;
}

// `t`'s place in an fp32 unit buffer at `offset`: a floating-point tensor's elements, an integer
// one's bytes, with its dtype and shape (an all-gather copies bytes, whatever dtype it is told).
inline torch::Tensor slot_view(const torch::Tensor& buffer, int64_t offset,
                               const torch::Tensor& t) {
  auto words = buffer.narrow(0, offset, slots(t));
  if (t.is_floating_point()) return words.view(t.sizes());
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  return words.view(torch::kUInt8).narrow(0, 0, bytes).view(t.scalar_type()).view(t.sizes());
}

// Each of `params`' offset in its unit's flat buffer (16-element aligned, in order) and the
// buffer's length: the one layout of a unit's trainable and of its frozen parameters, and what
// the streamed build lays out before place() (Note [Streamed build]).
inline int64_t aligned_offsets(const std::vector<torch::Tensor>& params,
                               std::vector<int64_t>& offsets) {
  offsets.clear();
  int64_t n = 0;
  for (const auto& p : params) {
    offsets.push_back(n);
    n += align_up(slots(p));
  }
  return n;
}

// Note [Fully sharded]: a gathered buffer's storage goes to 0 bytes and comes back in place,
// so every view (the parameters, what autograd saved) follows it.
inline void release_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

inline void allocate_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (impl->nbytes() == bytes) return;
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

// Note [Streamed build]: whether place() found the parameters the sink took as the block was
// built: the same TensorImpls in the same order.
inline bool same_tensors(const std::vector<torch::Tensor>& taken,
                         const std::vector<torch::Tensor>& placed) {
  if (taken.size() != placed.size()) return false;
  for (size_t k = 0; k < taken.size(); ++k) {
    if (taken[k].unsafeGetTensorImpl() != placed[k].unsafeGetTensorImpl()) return false;
  }
  return true;
}

// A block's frozen tensors in its unit's order (Note [Fully sharded frozen base], Note [Fully
// sharded quantized base]): its fp32 parameters that do not train, each once (`seen`: those an
// earlier block took), then its quantized base's codes and scales. The streamed build and place()
// both lay a block out through it, so they agree.
inline std::vector<torch::Tensor> frozen_of(
    torch::nn::Module& block, std::set<const void*>& seen,
    const std::function<bool(const torch::Tensor&)>& trains) {
  std::vector<torch::Tensor> frozen;
  for (const auto& p : block.parameters()) {
    if (trains(p) || p.scalar_type() != torch::kFloat32 ||
        !seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    frozen.push_back(p);
  }
  for (auto& t : models::quantized_storage(block)) frozen.push_back(std::move(t));
  return frozen;
}

inline BufferView view_of(const torch::Tensor& t, int64_t begin, int64_t count) {
  return buffer_view(t, begin, count, *dtype_of(t.scalar_type()));
}

inline int64_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace dnallm::parallel::detail

namespace dnallm::parallel {

// The model's BlockHooks: forwards to the sync while it lives (the model may outlive it).
class FullyShardedSync::Hooks final : public models::BlockHooks {
 public:
  explicit Hooks(FullyShardedSync* owner) : owner_(owner) {}
  void before_block(size_t index) override {
    if (owner_) owner_->before_block(index);
  }
  torch::Tensor after_block(size_t index, torch::Tensor output) override {
    return owner_ ? owner_->after_block(index, std::move(output)) : output;
  }
  void detach() { owner_ = nullptr; }

 private:
  FullyShardedSync* owner_;
};

}  // namespace dnallm::parallel
