#include "checkpoint/commit.hpp"

#include <thread>

#include <nlohmann/json.hpp>

#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::checkpoint {

std::optional<std::vector<std::string>> CommitRegistry::shard_durable(const ShardReport& r) {
  DNALLM_CHECK(!r.root.empty(), ExitCode::kUsage, "shard report without a checkpoint root");
  DNALLM_CHECK(r.world_size >= 1 && r.world_size <= kMaxCheckpointRanks, ExitCode::kUsage,
               "shard report of step {}: world size {} out of range 1..{}", r.step, r.world_size,
               kMaxCheckpointRanks);
  DNALLM_CHECK(r.rank >= 0 && r.rank < r.world_size, ExitCode::kUsage,
               "shard report of step {}: rank {} outside world size {}", r.step, r.rank,
               r.world_size);
  DNALLM_CHECK(r.step >= 0, ExitCode::kUsage, "shard report of negative step {}", r.step);
  Root& root = roots_[r.root];
  PendingStep& pending = root.pending[r.step];
  DNALLM_CHECK(r.generation >= pending.generation, ExitCode::kUsage,
               "shard report of step {} from generation {}, which generation {} replaced", r.step,
               r.generation, pending.generation);
  if (r.generation > pending.generation) pending = PendingStep{r.generation, 0, {}};
  if (pending.descriptors.empty()) pending.world_size = r.world_size;
  DNALLM_CHECK(pending.world_size == r.world_size, ExitCode::kUsage,
               "shard report of step {} under {}: rank {} says world size {}, earlier ranks {}",
               r.step, r.root, r.rank, r.world_size, pending.world_size);
  pending.descriptors[r.rank] = r.descriptor;
  if (static_cast<int64_t>(pending.descriptors.size()) < pending.world_size) return std::nullopt;
  std::vector<std::string> out;
  for (const auto& [rank, d] : pending.descriptors) out.push_back(d);
  return out;
}

std::vector<int64_t> CommitRegistry::committed(const CommittedReport& r) {
  DNALLM_CHECK(!r.root.empty() && r.step >= 0, ExitCode::kUsage,
               "commit report without a root or with a negative step");
  Root& root = roots_[r.root];
  root.committed.insert(r.step);
  root.committed.insert(r.on_disk.begin(), r.on_disk.end());
  // Shards of this step and older ones are settled (committed, or never will be).
  root.pending.erase(root.pending.begin(), root.pending.upper_bound(r.step));
  RetentionPolicy policy{static_cast<int>(r.keep_last), r.keep_every};
  auto opt = [](int64_t s) { return s >= 0 ? std::optional<int64_t>(s) : std::nullopt; };
  std::vector<int64_t> steps(root.committed.begin(), root.committed.end());
  auto doomed = steps_to_delete(steps, policy, opt(r.protected_step), opt(r.latest_step));
  for (int64_t s : doomed) root.committed.erase(s);
  return doomed;
}

std::vector<int64_t> CommitRegistry::committed_steps(const std::string& root) const {
  auto it = roots_.find(root);
  if (it == roots_.end()) return {};
  return {it->second.committed.begin(), it->second.committed.end()};
}

std::optional<std::vector<std::string>> LocalCommitChannel::shard_durable(
    const ShardReport& report) {
  std::lock_guard<std::mutex> lock(mu_);
  return registry_.shard_durable(report);
}

std::vector<int64_t> LocalCommitChannel::committed(const CommittedReport& report) {
  std::lock_guard<std::mutex> lock(mu_);
  return registry_.committed(report);
}

namespace {

// Steps 1-2: reports `report` until the step is complete; nullopt when aborted or (ranks
// other than 0) after the first report.
std::optional<std::vector<std::string>> await_all_shards(CommitChannel& channel,
                                                         const ShardReport& report,
                                                         const ShardCommit& c) {
  using Clock = std::chrono::steady_clock;
  auto all = channel.shard_durable(report);
  if (c.rank != 0) return std::nullopt;
  const auto deadline = Clock::now() + c.timeout;
  while (!all) {
    if (c.abort != nullptr && c.abort->load()) return std::nullopt;
    DNALLM_CHECK(Clock::now() < deadline, ExitCode::kPeerFailed,
                 "checkpoint of step {}: {} did not see every rank's shard within {} s; the "
                 "step stays uncommitted (check the other ranks' logs)",
                 report.step, channel.describe(), c.timeout.count() / 1000);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    all = channel.shard_durable(report);
  }
  return all;
}

// Steps 4-5: the registry's retention answer, carried out.
std::vector<int64_t> retain(CommitChannel& channel, const ShardCommit& c) {
  CommittedReport done;
  done.root = c.root.string();
  done.step = c.info.step;
  for (const auto& entry : list_committed(c.root)) done.on_disk.push_back(entry.first);
  done.keep_last = c.retention.keep_last;
  done.keep_every = c.retention.keep_every;
  done.protected_step = c.protected_step.value_or(-1);
  done.latest_step = c.info.step;  // commit_step just pointed LATEST here
  const auto doomed = channel.committed(done);
  for (int64_t s : doomed) remove_checkpoint(c.root, s);
  if (!doomed.empty()) {
    spdlog::info("retention (decided by {}): deleted {} checkpoint(s), oldest step {}",
                 channel.describe(), doomed.size(), doomed.front());
  }
  return doomed;
}

}  // namespace

CommitOutcome commit_shard(CommitChannel& channel, const ShardDescriptor& own,
                           const ShardCommit& c) {
  ShardReport report;
  report.root = c.root.string();
  report.step = c.info.step;
  report.rank = c.rank;
  report.world_size = c.info.world_size;
  report.descriptor = descriptor_to_json(own).dump();
  const auto all = await_all_shards(channel, report, c);
  CommitOutcome out;
  if (!all) return out;
  std::vector<ShardDescriptor> shards;
  for (const auto& d : *all) {
    shards.push_back(descriptor_from_json(nlohmann::json::parse(d)));
    out.bytes += shards.back().bytes;
  }
  commit_step(c.root, c.info, std::move(shards));
  out.committed = true;
  out.deleted = retain(channel, c);
  return out;
}

ShardDescriptor save_single(const std::filesystem::path& root, const CommitInfo& info,
                            const std::vector<TensorSlice>& slices, const CodecOptions& codec) {
  DNALLM_CHECK(info.world_size == 1, ExitCode::kUsage, "save_single is for world size 1, got {}",
               info.world_size);
  ShardDescriptor d = write_shard(root / step_dir_name(info.step), 0, slices, codec);
  LocalCommitChannel channel;
  ShardCommit commit;
  commit.root = root;
  commit.info = info;
  commit_shard(channel, d, commit);
  return d;
}

}  // namespace dnallm::checkpoint
