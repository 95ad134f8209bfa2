#include "worker/data/table_dataset.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"

namespace dnallm::data {
namespace {
TEST(TableDataset, Placeholder) { SUCCEED(); }
}  // namespace
}  // namespace dnallm::data
