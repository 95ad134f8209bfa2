#include "checkpoint/async_writer.hpp"

#include <cstring>

#include "checkpoint/shard_file.hpp"
#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::checkpoint {

AsyncWriter::~AsyncWriter() {
  try {
    stop();
  } catch (...) {
  }
}

void AsyncWriter::start() {
  std::lock_guard<std::mutex> lock(mu_);
  DNALLM_CHECK(!thread_.joinable(), ExitCode::kFailure, "AsyncWriter started twice");
  stopping_ = false;
  thread_ = std::thread([this] { run(); });
}

void AsyncWriter::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

double AsyncWriter::save(const SaveRequest& request) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    DNALLM_CHECK(thread_.joinable() && !stopping_, ExitCode::kFailure,
                 "AsyncWriter::save called before start() or after stop()");
    cv_.wait(lock, [this] { return !busy_; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  // The worker is idle and only the caller's thread queues jobs: copy without the lock.
  Job job;
  job.request = request;
  if (!request.borrowed) job.buffers.resize(request.slices.size());
  for (size_t i = 0; i < job.buffers.size(); ++i) {
    TensorSlice& s = job.request.slices[i];
    auto& buf = job.buffers[i];
    buf.resize(s.bytes());
    if (s.bytes()) std::memcpy(buf.data(), s.data, s.bytes());
    s.data = buf.data();
  }
  job.stall_s = seconds_since(t0);
  const double stall = job.stall_s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    busy_ = true;
    result_.reset();
  }
  cv_.notify_all();
  return stall;
}

std::optional<SaveResult> AsyncWriter::take_locked() {
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  return result_;
}

std::optional<SaveResult> AsyncWriter::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !busy_; });
  return take_locked();
}

std::optional<SaveResult> AsyncWriter::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [this] { return !busy_; })) return std::nullopt;
  return take_locked();
}

void AsyncWriter::run() {
  for (;;) {
    std::optional<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return job_.has_value() || stopping_; });
      if (!job_) return;  // stopping with nothing queued
      job = std::move(job_);
      job_.reset();
    }
    const auto t0 = std::chrono::steady_clock::now();
    SaveResult result;
    std::exception_ptr error;
    try {
      const SaveRequest& r = job->request;
      result.step = r.step;
      result.stall_s = job->stall_s;
      if (r.ready) r.ready();
      result.shard = write_shard(r.root / step_dir_name(r.step), r.rank, r.slices, r.codec);
      if (r.on_durable) r.on_durable(result.shard);
      result.write_s = seconds_since(t0);
    } catch (const std::exception& e) {
      spdlog::error("checkpoint of step {} failed: {}", job->request.step, e.what());
      error = std::current_exception();
    }
    job.reset();  // free the snapshot before reporting idle
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error)
        error_ = error;
      else
        result_ = std::move(result);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

}  // namespace dnallm::checkpoint
