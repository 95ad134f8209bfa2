#include "coordinator/commit_registry.hpp"

#include "checkpoint/retention.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {

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
  checkpoint::RetentionPolicy policy{static_cast<int>(r.keep_last), r.keep_every};
  auto opt = [](int64_t s) { return s >= 0 ? std::optional<int64_t>(s) : std::nullopt; };
  std::vector<int64_t> steps(root.committed.begin(), root.committed.end());
  auto doomed =
      checkpoint::steps_to_delete(steps, policy, opt(r.protected_step), opt(r.latest_step));
  for (int64_t s : doomed) root.committed.erase(s);
  return doomed;
}

std::vector<int64_t> CommitRegistry::committed_steps(const std::string& root) const {
  auto it = roots_.find(root);
  if (it == roots_.end()) return {};
  return {it->second.committed.begin(), it->second.committed.end()};
}

namespace {

FrameReader checked_reply(TcpStoreClient& store, const FrameWriter& req,
                          const TcpStoreClient::Response& r) {
  DNALLM_CHECK(r.status == Status::kOk, ExitCode::kPeerFailed,
               "coordinator {} answered '{}' with status {} (is it an elastic coordinator?)",
               store.address(), op_name(req.body()[0]), static_cast<int>(r.status));
  return FrameReader(r.body.data(), r.body.size());
}

}  // namespace

std::optional<std::vector<std::string>> CommitClient::shard_durable(ShardReport report) {
  report.generation = generation_;
  const FrameWriter req = encode_shard_durable(report);
  const auto r = store_.request(req, store_.options().op_timeout, /*idempotent=*/true);
  try {
    FrameReader reader = checked_reply(store_, req, r);
    const bool complete = reader.u8() != 0;
    auto descriptors = reader.keys();
    reader.expect_done();
    if (!complete) return std::nullopt;
    return descriptors;
  } catch (const ProtocolError& e) {
    fail(ExitCode::kPeerFailed, "malformed shard_durable reply from {}: {}", store_.address(),
         e.what());
  }
}

std::vector<int64_t> CommitClient::committed(const CommittedReport& report) {
  const FrameWriter req = encode_committed(report);
  const auto r = store_.request(req, store_.options().op_timeout, /*idempotent=*/true);
  try {
    FrameReader reader = checked_reply(store_, req, r);
    const uint32_t n = reader.u32();
    DNALLM_CHECK(n <= kMaxCheckpointRanks, ExitCode::kPeerFailed, "committed reply lists {} steps",
                 n);
    std::vector<int64_t> steps;
    for (uint32_t i = 0; i < n; ++i) steps.push_back(reader.i64());
    reader.expect_done();
    return steps;
  } catch (const ProtocolError& e) {
    fail(ExitCode::kPeerFailed, "malformed committed reply from {}: {}", store_.address(),
         e.what());
  }
}

FrameWriter encode_shard_durable(const ShardReport& r) {
  FrameWriter w;
  w.u8(static_cast<uint8_t>(Op::kCkptShardDurable))
      .str(r.root)
      .i64(r.generation)
      .i64(r.step)
      .i64(r.rank)
      .i64(r.world_size)
      .str(r.descriptor);
  return w;
}

ShardReport decode_shard_durable(FrameReader& r) {
  ShardReport s;
  s.root = r.str();
  s.generation = r.i64();
  s.step = r.i64();
  s.rank = r.i64();
  s.world_size = r.i64();
  s.descriptor = r.str();
  r.expect_done();
  return s;
}

FrameWriter encode_committed(const CommittedReport& r) {
  FrameWriter w;
  w.u8(static_cast<uint8_t>(Op::kCkptCommitted)).str(r.root).i64(r.step);
  w.u32(static_cast<uint32_t>(r.on_disk.size()));
  for (int64_t s : r.on_disk) w.i64(s);
  w.i64(r.keep_last).i64(r.keep_every).i64(r.protected_step).i64(r.latest_step);
  return w;
}

CommittedReport decode_committed(FrameReader& r) {
  CommittedReport c;
  c.root = r.str();
  c.step = r.i64();
  const uint32_t n = r.u32();
  DNALLM_CHECK(n <= kMaxCheckpointRanks, ExitCode::kUsage, "commit report lists {} steps", n);
  for (uint32_t i = 0; i < n; ++i) c.on_disk.push_back(r.i64());
  c.keep_last = r.i64();
  c.keep_every = r.i64();
  c.protected_step = r.i64();
  c.latest_step = r.i64();
  r.expect_done();
  return c;
}

}  // namespace dnallm::coordinator
