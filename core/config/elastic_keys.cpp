// [elastic]: the keys of ElasticConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

// Read by dnallm-launch and dnallm-coordinator, not by the workers: see
// Note [Elastic settings] in core/config.hpp.
void elastic_keys(std::vector<KeyDesc>& out) {
  SectionKeys<ElasticConfig>(out, "elastic", &Config::elastic)
      .range("min_nodes", &ElasticConfig::min_nodes, 1, 1 << 20,
             "elastic job: fewest nodes a rendezvous round closes with (`dnallm-launch --nnodes "
             "MIN:MAX`, `dnallm-coordinator --min-nodes`); equal to a `max_nodes` other than 1: "
             "the node count of a static `dnallm-launch` job, as `--nnodes N`")
      .range("max_nodes", &ElasticConfig::max_nodes, 1, 1 << 20,
             "elastic job: most nodes in a generation; `min_nodes` < `max_nodes` makes a "
             "`dnallm-launch` job elastic, as `--nnodes MIN:MAX` does")
      .range("max_restarts", &ElasticConfig::max_restarts, 0, 1 << 20,
             "worker failures (and hangs) tolerated for the whole job before it fails: "
             "dnallm-launch restarts the worker group up to this many times "
             "(`--max-restarts`)")
      .range("max_membership_changes", &ElasticConfig::max_membership_changes, 0, 1 << 20,
             "elastic job: node deaths and late joins tolerated for the whole job "
             "(`--max-membership-changes`)")
      .range("heartbeat_interval_s", &ElasticConfig::heartbeat_interval_s, 0.01, 3600,
             "elastic job: seconds between an agent's heartbeats, which carry its workers' "
             "progress (`dnallm-launch --monitor-interval`)")
      .range("heartbeat_timeout_s", &ElasticConfig::heartbeat_timeout_s, 0.1, 86400,
             "elastic job: a node silent this long is declared dead; an agent gives up on a "
             "coordinator silent this long (`--heartbeat-timeout`)")
      .range("step_timeout_s", &ElasticConfig::step_timeout_s, 1, 864000,
             "elastic job: a rank whose step has not advanced for this long is a hang "
             "(`--hang-timeout`)")
      .range("settle_s", &ElasticConfig::settle_s, 0, 3600,
             "elastic job: seconds without a new join before a round with at least "
             "`min_nodes` closes (`--rdzv-settle`)")
      .range("join_timeout_s", &ElasticConfig::join_timeout_s, 1, 864000,
             "elastic job: seconds a round may stay below `min_nodes` before the job fails "
             "(`--join-timeout`)")
      .range("spare_workers", &ElasticConfig::spare_workers, 0, 1024,
             "warm spare workers each `dnallm-launch` starts beside its ranks "
             "(`--spare-workers`): when a rank dies the survivors stay in process and a spare "
             "takes its place with a peer's state, losing no step (DDP, ZeRO-1/2/3, context "
             "parallelism; docs/elastic.md, \"In-process recovery\"); 0: a failure restarts "
             "the group from the last checkpoint")
      .key("shrink", &ElasticConfig::shrink,
           "when a rank dies and no spare is left, the survivors go on without it in process "
           "(DDP): gradient accumulation keeps the global batch where a whole number does, the "
           "data is split again, and a fresh worker started in its place rejoins at a step "
           "boundary once it is warm (docs/elastic.md, \"Shrink and grow\"); false: such a "
           "failure restarts the group from the last checkpoint");
}

}  // namespace dnallm::config_detail
