// Background checkpoint writing: the training thread only copies its state into
// writer-owned host buffers; compression, writes, fsyncs and what follows the durable shard
// (SaveRequest::on_durable: the commit, checkpoint/commit.hpp) run on the writer's thread,
// one thread for every save.
//
// Note [One checkpoint in flight]: save() first waits for the previous save to finish,
// so memory is bounded by one snapshot. The time the caller spends in save() (waiting
// plus copying) is reported as stall_s; the time the background write took as write_s.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "checkpoint/codec.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/types.hpp"

namespace dnallm::checkpoint {

struct SaveRequest {
  std::filesystem::path root;  // the checkpoint root ([checkpoint] dir)
  int64_t step = 0;
  int rank = 0;
  std::vector<TensorSlice> slices;  // copied by save(); the caller may reuse its memory
  CodecOptions codec;
  // Runs on the writer thread once the shard is durable, with its descriptor (e.g.
  // commit_shard); what it throws is the save's error. Optional.
  std::function<void(const ShardDescriptor&)> on_durable;
  // Zero-copy hand-over (Note [Snapshot on a side stream] in worker/train/checkpointing.hpp):
  // when `borrowed` is set, save() does NOT copy the slices; the job keeps `borrowed` (the
  // owner of the memory they point into) alive until the write is done, and the writer
  // thread calls `ready()` (if set) before it reads them, e.g. to wait for a device copy.
  std::shared_ptr<void> borrowed;
  std::function<void()> ready;
};

struct SaveResult {
  int64_t step = 0;
  ShardDescriptor shard;
  double stall_s = 0;  // time the caller was blocked in save()
  double write_s = 0;  // compression + write + fsync + on_durable on the writer thread
};

class AsyncWriter {
 public:
  AsyncWriter() = default;
  ~AsyncWriter();  // stop(); never throws
  AsyncWriter(const AsyncWriter&) = delete;
  AsyncWriter& operator=(const AsyncWriter&) = delete;

  // Starts the writer thread. Called once, from the owning thread.
  void start();
  // Finishes the save in flight (if any), then joins the thread. Idempotent; a failure
  // of that last save is logged and kept for wait().
  void stop();

  // Called from the training thread. Blocks until the previous save finished (see Note
  // [One checkpoint in flight]), copies the slices (unless request.borrowed is set), queues
  // the write and returns the stall in seconds. Throws the previous save's error if wait()
  // has not reported it.
  double save(const SaveRequest& request);

  // Blocks until no save is in flight; returns the last save's result (nullopt if none
  // ran) or throws its error (once).
  std::optional<SaveResult> wait();
  // Like wait() with a timeout: nullopt when still busy after `timeout`.
  std::optional<SaveResult> wait_for(std::chrono::milliseconds timeout);

 private:
  struct Job {
    SaveRequest request;  // slices point into `buffers`
    std::vector<std::vector<uint8_t>> buffers;
    double stall_s = 0;
  };
  void run();
  std::optional<SaveResult> take_locked();

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_:
  std::optional<Job> job_;
  bool busy_ = false;
  bool stopping_ = false;
  std::optional<SaveResult> result_;
  std::exception_ptr error_;
};

}  // namespace dnallm::checkpoint
