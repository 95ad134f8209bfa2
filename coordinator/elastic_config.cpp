#include "coordinator/elastic_config.hpp"

namespace dnallm::coordinator {

std::chrono::milliseconds to_millis(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

ElasticOptions elastic_options(const ElasticConfig& config) {
  ElasticOptions o;
  o.min_nodes = config.min_nodes;
  o.max_nodes = config.max_nodes;
  o.settle = to_millis(config.settle_s);
  o.heartbeat_timeout = to_millis(config.heartbeat_timeout_s);
  o.step_timeout = to_millis(config.step_timeout_s);
  o.join_timeout = to_millis(config.join_timeout_s);
  o.max_restarts = config.max_restarts;
  o.max_membership_changes = config.max_membership_changes;
  return o;
}

}  // namespace dnallm::coordinator
