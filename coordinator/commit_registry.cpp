#include "coordinator/commit_registry.hpp"

#include <spdlog/spdlog.h>

#include "core/error.hpp"

namespace dnallm::coordinator {

using checkpoint::CommittedReport;
using checkpoint::kMaxCheckpointRanks;
using checkpoint::ShardReport;

void register_commit_ops(StoreServer& server) {
  // Handlers run on the server's io thread only: the registry needs no lock.
  auto registry = std::make_shared<checkpoint::CommitRegistry>();
  server.register_handler(static_cast<uint8_t>(Op::kCkptShardDurable),
                          [registry](FrameReader& args, Responder reply) {
                            const auto all = registry->shard_durable(decode_shard_durable(args));
                            FrameWriter w;
                            w.u8(all ? 1 : 0).keys(all ? *all : std::vector<std::string>{});
                            reply.send(Status::kOk, w);
                          });
  server.register_handler(
      static_cast<uint8_t>(Op::kCkptCommitted), [registry](FrameReader& args, Responder reply) {
        const CommittedReport report = decode_committed(args);
        const std::vector<int64_t> doomed = registry->committed(report);
        spdlog::info("commit registry: step {} committed under {}; retention deletes {} step(s){}",
                     report.step, report.root, doomed.size(),
                     doomed.empty() ? "" : fmt::format(" (oldest {})", doomed.front()));
        FrameWriter w;
        w.u32(static_cast<uint32_t>(doomed.size()));
        for (int64_t s : doomed) w.i64(s);
        reply.send(Status::kOk, w);
      });
}

std::shared_ptr<checkpoint::CommitChannel> commit_channel_for(const std::shared_ptr<Store>& store,
                                                              int64_t generation) {
  auto tcp = std::dynamic_pointer_cast<TcpStoreClient>(store);
  if (!tcp) return nullptr;
  return std::make_shared<CommitClient>(std::move(tcp), generation);
}

// The same words as before the channels existed: logs and scripts look for
// "retention (decided by the coordinator)".
std::string CommitClient::describe() const { return "the coordinator"; }

namespace {

FrameReader checked_reply(TcpStoreClient& store, const FrameWriter& req,
                          const TcpStoreClient::Response& r) {
  DNALLM_CHECK(r.status == Status::kOk, ExitCode::kPeerFailed,
               "coordinator {} answered '{}' with status {} (is it an elastic coordinator?)",
               store.address(), op_name(req.body()[0]), static_cast<int>(r.status));
  return FrameReader(r.body.data(), r.body.size());
}

}  // namespace

std::optional<std::vector<std::string>> CommitClient::shard_durable(const ShardReport& report) {
  ShardReport stamped = report;
  stamped.generation = generation_;
  const FrameWriter req = encode_shard_durable(stamped);
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
