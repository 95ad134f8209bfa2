// The coordinator's elastic policy from the configuration's [elastic] section: one mapping for
// every binary that hosts the coordinator (dnallm-launch, dnallm-coordinator), so a key means
// the same wherever it is read (Note [Elastic settings], core/config.hpp).
#pragma once

#include <chrono>

#include "coordinator/elastic_state.hpp"
#include "core/config.hpp"

namespace dnallm::coordinator {

// Node range, budgets and timeouts (seconds become milliseconds, rounded down).
ElasticOptions elastic_options(const ElasticConfig& config);

// `seconds` as whole milliseconds, rounded down.
std::chrono::milliseconds to_millis(double seconds);

}  // namespace dnallm::coordinator
