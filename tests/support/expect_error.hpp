// The check every refusal test makes: a call throws dnallm::Error with the exit code a user
// would see and a message that names what it should (Errors in CONVENTIONS.md).
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.hpp"

namespace dnallm::testing {

// Runs `fn`, which must throw Error with `code` and a message holding every one of `parts`.
// Returns the message ("" and a test failure when nothing was thrown).
template <typename Fn>
std::string expect_error(Fn&& fn, ExitCode code, const std::vector<std::string>& parts = {}) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), code) << what;
    for (const auto& p : parts)
      EXPECT_NE(what.find(p), std::string::npos) << what << " lacks " << p;
    return what;
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

// Runs `fn`, which must throw Error(kBadData) naming every one of `parts`.
template <typename Fn>
std::string expect_bad_data(Fn&& fn, const std::vector<std::string>& parts) {
  return expect_error(fn, ExitCode::kBadData, parts);
}

}  // namespace dnallm::testing
