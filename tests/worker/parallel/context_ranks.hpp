// The harness of the context-parallel tests: real Gloo groups of C ranks in one process
// (threads, one in-memory store), and the comparisons against one rank's whole sequence.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/make_communicator.hpp"
#include "coordinator/store.hpp"

namespace dnallm::parallel::context_test {

// Runs `body(rank, group)` on `world` threads, each rank with its own gloo communicator.
// Returns each rank's error ("" when none).
inline std::vector<std::string> run_on_ranks(
    int world, const std::string& name, const std::function<void(int, comm::Communicator&)>& body) {
  auto store = std::make_shared<coordinator::InMemoryStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        comm::CommOptions o;
        o.backend = "gloo";
        o.rank = r;
        o.world_size = world;
        o.store = store;
        o.loopback = true;
        o.timeout = std::chrono::seconds(20);
        o.name = name;
        auto group = comm::make_communicator(o);
        body(r, *group);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        if (errors[static_cast<size_t>(r)].empty())
          errors[static_cast<size_t>(r)] = "(empty error)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// max |a - b| / max |b| (normwise: elementwise ratios are meaningless near zero).
inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  const double scale = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

// relative_error(got, want) <= tolerance, printed as a measured figure.
inline void expect_close(const torch::Tensor& got, const torch::Tensor& want,
                         const std::string& what, double tolerance) {
  const double err = relative_error(got, want);
  std::cout << "[ measured ] " << what << ": max relative error " << err << "\n";
  EXPECT_LE(err, tolerance) << what;
}

inline torch::Tensor shard_of(const torch::Tensor& whole, int64_t dim, int world, int rank) {
  const int64_t n = whole.size(dim) / world;
  return whole.slice(dim, rank * n, (rank + 1) * n);
}

// A leaf copy of `t` that records gradients.
inline torch::Tensor leaf(const torch::Tensor& t) {
  return t.detach().clone().requires_grad_(true);
}

inline bool gloo_available() { return comm::backend_available("gloo"); }

}  // namespace dnallm::parallel::context_test
