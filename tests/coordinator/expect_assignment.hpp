// A node's assignment (coordinator/elastic_state.hpp) against the one a test expects, for
// elastic_service_test.cpp and wire_test.cpp: every field compared, each on its own line, so
// that a failure names the field.
#pragma once

#include <gtest/gtest.h>

#include "coordinator/elastic_state.hpp"

namespace dnallm::coordinator::testing {

inline void expect_assignment(const NodeAssignment& got, const NodeAssignment& want) {
  EXPECT_EQ(got.generation, want.generation);
  EXPECT_EQ(got.node_rank, want.node_rank);
  EXPECT_EQ(got.nnodes, want.nnodes);
  EXPECT_EQ(got.world_size, want.world_size);
  EXPECT_EQ(got.rank_offset, want.rank_offset);
  EXPECT_EQ(got.local_world_size, want.local_world_size);
}

}  // namespace dnallm::coordinator::testing
