// Our logits against a Hugging Face fixture's, the reference code's (the "logits" of
// tests/data/hf-fixtures/<name>/expected.safetensors): tests/worker/hyena_test.cpp,
// tests/worker/caduceus_test.cpp.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <string>

namespace dnallm::testing {

// `logits`, ours for fixture `name`, have the shape of the reference's `want` and lie within
// 1e-4 of them; the largest difference is printed as measured.
inline void expect_reference_logits(const std::string& name, const torch::Tensor& logits,
                                    const torch::Tensor& want) {
  ASSERT_EQ(logits.sizes(), want.sizes());
  const double diff = (logits - want).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4);
  std::cout << name << ": max |ours - reference| = " << diff << "\n";
}

}  // namespace dnallm::testing
