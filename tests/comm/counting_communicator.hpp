// A fake Communicator for the wrappers' own logic (Note [Stream-ordered wait]): every
// collective completes at once (allgather copies this rank's shard into its place, the other
// collectives leave the buffers as they are), and every Work it hands out counts how it was
// waited for: on the host (wait) or by the device stream (wait_stream). backend() is what the
// test says, so a wrapper that treats "nccl" apart can be driven without NCCL.
#pragma once

#include <atomic>
#include <cstring>
#include <memory>
#include <string>

#include "comm/communicator.hpp"

namespace dnallm::comm::testing {

struct WaitCounts {
  std::atomic<int> host{0};    // wait() and wait(timeout)
  std::atomic<int> stream{0};  // wait_stream()
  std::atomic<int> issued{0};  // Works handed out
};

class CountingWork final : public Work {
 public:
  explicit CountingWork(std::shared_ptr<WaitCounts> counts) : counts_(std::move(counts)) {}
  bool is_completed() override { return true; }
  void wait(std::chrono::milliseconds) override { ++counts_->host; }
  void wait() override { ++counts_->host; }
  void wait_stream() override { ++counts_->stream; }

 private:
  std::shared_ptr<WaitCounts> counts_;
};

class CountingCommunicator final : public Communicator {
 public:
  CountingCommunicator(std::string backend, int rank, int world_size)
      : backend_(std::move(backend)), rank_(rank), world_(world_size) {}

  std::shared_ptr<WaitCounts> counts() const { return counts_; }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return backend_.c_str(); }

  WorkPtr allreduce(BufferView, BufferView, ReduceOp) override { return work(); }
  using Communicator::allreduce;
  WorkPtr reduce_scatter(BufferView, BufferView, ReduceOp) override { return work(); }
  WorkPtr allgather(BufferView in, BufferView out) override {
    // Host memory only (the tests' CUDA-labelled views are never dereferenced here).
    if (!in.device.is_cuda() && !out.device.is_cuda()) {
      const auto s = shard_range(out.count, world_, rank_);
      const size_t es = dtype_size(out.dtype);
      std::memmove(static_cast<char*>(out.data) + s.offset * es, in.data, s.count * es);
    }
    return work();
  }
  WorkPtr broadcast(BufferView, int) override { return work(); }
  WorkPtr barrier() override { return work(); }

 private:
  WorkPtr work() {
    ++counts_->issued;
    return std::make_shared<CountingWork>(counts_);
  }

  std::string backend_;
  int rank_;
  int world_;
  std::shared_ptr<WaitCounts> counts_ = std::make_shared<WaitCounts>();
};

}  // namespace dnallm::comm::testing
