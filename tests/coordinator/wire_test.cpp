// Every coordinator op's encode/decode pair: the request (and reply) bytes equal the layout
// documented in coordinator/protocol.hpp, store_wire.hpp, elastic_wire.hpp and
// commit_registry.hpp (written here field by field with FrameWriter), and decoding them
// gives back what was encoded. Plus the decoders' refusals: malformed bodies throw
// ProtocolError, values out of range Error(kUsage).
#include <gtest/gtest.h>

#include "coordinator/commit_registry.hpp"
#include "coordinator/elastic_wire.hpp"
#include "coordinator/store_wire.hpp"
#include "core/error.hpp"
#include "expect_assignment.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::coordinator {
namespace {

using dnallm::testing::expect_error;

using Body = std::vector<uint8_t>;

FrameWriter op(Op o) {
  FrameWriter w;
  w.u8(static_cast<uint8_t>(o));
  return w;
}

// Checks `encoded` against the documented layout, then decodes it after its op byte.
template <class Decode>
auto decode_request(const FrameWriter& encoded, const FrameWriter& documented, Op o,
                    Decode decode) {
  EXPECT_EQ(encoded.body(), documented.body()) << op_name(static_cast<uint8_t>(o));
  FrameReader r(encoded.body().data(), encoded.body().size());
  EXPECT_EQ(r.u8(), static_cast<uint8_t>(o));
  return decode(r);
}

template <class M>
M decode_store_request(const FrameWriter& encoded, const FrameWriter& documented, Op o) {
  return decode_request(encoded, documented, o,
                        [](FrameReader& r) { return decode_message<M>(r); });
}

// ---------------------------------------------------------------- store ops

TEST(StoreWire, HelloRoundTrips) {
  HelloRequest m{kProtocolVersion, "tok"};
  auto d = decode_store_request<HelloRequest>(
      encode_request(Op::kHello, m), op(Op::kHello).u32(kProtocolVersion).str("tok"), Op::kHello);
  EXPECT_EQ(d.version, kProtocolVersion);
  EXPECT_EQ(d.token, "tok");
}

TEST(StoreWire, SetAndSetOwnedRoundTrip) {
  for (Op o : {Op::kSet, Op::kSetOwned}) {
    KeyValueRequest m{"k", {0, 1, 255}};
    auto d = decode_store_request<KeyValueRequest>(encode_request(o, m),
                                                   op(o).str("k").blob(m.value), o);
    EXPECT_EQ(d.key, "k");
    EXPECT_EQ(d.value, m.value);
  }
}

TEST(StoreWire, GetAndDeleteRoundTrip) {
  for (Op o : {Op::kGet, Op::kDelete}) {
    auto d =
        decode_store_request<KeyRequest>(encode_request(o, KeyRequest{"key"}), op(o).str("key"), o);
    EXPECT_EQ(d.key, "key");
  }
}

TEST(StoreWire, WaitRoundTrips) {
  WaitRequest m{{"a", "bb"}, 1234};
  auto d = decode_store_request<WaitRequest>(encode_request(Op::kWait, m),
                                             op(Op::kWait).keys(m.keys).i64(1234), Op::kWait);
  EXPECT_EQ(d.keys, m.keys);
  EXPECT_EQ(d.timeout_ms, 1234);
}

TEST(StoreWire, AddRoundTrips) {
  auto d = decode_store_request<AddRequest>(encode_request(Op::kAdd, AddRequest{"c", -7}),
                                            op(Op::kAdd).str("c").i64(-7), Op::kAdd);
  EXPECT_EQ(d.key, "c");
  EXPECT_EQ(d.delta, -7);
}

TEST(StoreWire, CompareSetRoundTrips) {
  CompareSetRequest m{"k", {}, {9, 8}};
  auto d = decode_store_request<CompareSetRequest>(
      encode_request(Op::kCompareSet, m), op(Op::kCompareSet).str("k").blob({}).blob({9, 8}),
      Op::kCompareSet);
  EXPECT_EQ(d.key, "k");
  EXPECT_TRUE(d.expected.empty());
  EXPECT_EQ(d.desired, (Body{9, 8}));
}

TEST(StoreWire, CheckRoundTrips) {
  KeysRequest m{{"x", "", "z"}};
  auto d = decode_store_request<KeysRequest>(encode_request(Op::kCheck, m),
                                             op(Op::kCheck).keys(m.keys), Op::kCheck);
  EXPECT_EQ(d.keys, m.keys);
}

TEST(StoreWire, NumKeysAndPingHaveNoFields) {
  for (Op o : {Op::kNumKeys, Op::kPing}) {
    decode_store_request<NoFields>(encode_request(o, NoFields{}), op(o), o);
  }
}

TEST(StoreWire, RepliesRoundTrip) {
  EXPECT_EQ(encode_reply(ValueReply{{1, 2}}).body(), FrameWriter().blob({1, 2}).body());
  EXPECT_EQ(decode_message<ValueReply>(encode_reply(ValueReply{{1, 2}}).body()).value,
            (Body{1, 2}));
  EXPECT_EQ(encode_reply(CountReply{-3}).body(), FrameWriter().i64(-3).body());
  EXPECT_EQ(decode_message<CountReply>(encode_reply(CountReply{-3}).body()).value, -3);
  EXPECT_EQ(encode_reply(FlagReply{true}).body(), FrameWriter().u8(1).body());
  EXPECT_TRUE(decode_message<FlagReply>(encode_reply(FlagReply{true}).body()).value);
  EXPECT_FALSE(decode_message<FlagReply>(encode_reply(FlagReply{false}).body()).value);
  const Body reason = encode_reason("why").body();
  EXPECT_EQ(reason, FrameWriter().str("why").body());
  EXPECT_EQ(decode_reason(reason.data(), reason.size()), "why");
  EXPECT_EQ(decode_reason(nullptr, 0), "");        // no reason given
  EXPECT_EQ(decode_reason(reason.data(), 2), "");  // truncated: reported without one
}

TEST(StoreWire, MalformedBodiesThrowProtocolError) {
  const Body trailing = FrameWriter().str("k").u8(7).body();
  EXPECT_THROW(decode_message<KeyRequest>(trailing), ProtocolError);
  const Body truncated = FrameWriter().u32(1000).body();
  EXPECT_THROW(decode_message<KeyRequest>(truncated), ProtocolError);
  const Body huge_count = FrameWriter().u32(0xffffffff).body();
  EXPECT_THROW(decode_message<KeysRequest>(huge_count), ProtocolError);
  std::vector<int64_t> steps;
  FrameReader r(huge_count.data(), huge_count.size());
  EXPECT_THROW(read_field(r, steps), ProtocolError);
}

// ---------------------------------------------------------------- elastic ops

TEST(ElasticWire, JoinRoundTrips) {
  JoinRequest m{{"node-1", "host1", 4}, 3};
  auto d =
      decode_request(encode_join(m), op(Op::kElasticJoin).str("node-1").str("host1").i64(4).i64(3),
                     Op::kElasticJoin, decode_join);
  EXPECT_EQ(d.node.node_id, "node-1");
  EXPECT_EQ(d.node.host, "host1");
  EXPECT_EQ(d.node.nproc, 4);
  EXPECT_EQ(d.known_generation, 3);
}

TEST(ElasticWire, HeartbeatRoundTripsWithAndWithoutStoppedFlags) {
  HeartbeatRequest m{"n", 2, {5, -1}, {}};
  auto plain = decode_request(encode_heartbeat(m),
                              op(Op::kElasticHeartbeat).str("n").i64(2).u32(2).i64(5).i64(-1),
                              Op::kElasticHeartbeat, decode_heartbeat);
  EXPECT_EQ(plain.node_id, "n");
  EXPECT_EQ(plain.generation, 2);
  EXPECT_EQ(plain.steps, m.steps);
  EXPECT_TRUE(plain.stopped.empty());

  m.stopped = {false, true};
  auto flagged = decode_request(
      encode_heartbeat(m),
      op(Op::kElasticHeartbeat).str("n").i64(2).u32(2).i64(5).i64(-1).u32(2).u8(0).u8(1),
      Op::kElasticHeartbeat, decode_heartbeat);
  EXPECT_EQ(flagged.steps, m.steps);
  EXPECT_EQ(flagged.stopped, m.stopped);

  m.stopped = {true};  // not one flag per step: not sent
  EXPECT_EQ(encode_heartbeat(m).body(),
            op(Op::kElasticHeartbeat).str("n").i64(2).u32(2).i64(5).i64(-1).body());
}

TEST(ElasticWire, ReportFailureRoundTripsAndClipsItsLines) {
  FailureReport m;
  m.node_id = "n";
  m.host = "h";
  m.rank = 3;
  m.exit_code = 137;
  m.signal = 9;
  m.reason = "killed";
  m.last_lines = {"one", std::string(kMaxLastLineBytes + 5, 'x')};
  m.generation = 4;
  const std::vector<std::string> clipped = {"one", std::string(kMaxLastLineBytes, 'x')};
  auto d = decode_request(encode_report_failure(m),
                          op(Op::kElasticReportFailure)
                              .str("n")
                              .str("h")
                              .i64(3)
                              .i64(137)
                              .i64(9)
                              .str("killed")
                              .keys(clipped)
                              .i64(4),
                          Op::kElasticReportFailure, decode_report_failure);
  EXPECT_EQ(d.node_id, "n");
  EXPECT_EQ(d.host, "h");
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.exit_code, 137);
  EXPECT_EQ(d.signal, 9);
  EXPECT_EQ(d.reason, "killed");
  EXPECT_EQ(d.last_lines, clipped);
  EXPECT_EQ(d.generation, 4);
}

TEST(ElasticWire, ReportSuccessAndStateRoundTrip) {
  auto s =
      decode_request(encode_report_success({"n", 7}), op(Op::kElasticReportSuccess).str("n").i64(7),
                     Op::kElasticReportSuccess, decode_report_success);
  EXPECT_EQ(s.node_id, "n");
  EXPECT_EQ(s.generation, 7);
  auto q = decode_request(encode_state({"m"}), op(Op::kElasticState).str("m"), Op::kElasticState,
                          decode_state);
  EXPECT_EQ(q.node_id, "m");
}

TEST(ElasticWire, JobViewRoundTripsWithAndWithoutAnAssignment) {
  JobView v;
  v.phase = JobPhase::kFailed;
  v.generation = 2;
  v.generation_open = 3;
  v.restarts_used = 1;
  v.membership_changes_used = 4;
  v.round_reason = "why";
  v.root_cause = "rank 1";
  v.exit_code = 3;
  FrameWriter documented;
  documented.u8(3).i64(2).i64(3).i64(1).i64(4).u8(0).str("why").str("rank 1").i64(3);
  EXPECT_EQ(encode_job_view(v).body(), documented.body());
  Body body = encode_job_view(v).body();
  FrameReader r(body.data(), body.size());
  JobView d = decode_job_view(r);
  EXPECT_EQ(d.phase, JobPhase::kFailed);
  EXPECT_EQ(d.generation, 2);
  EXPECT_EQ(d.generation_open, 3);
  EXPECT_EQ(d.restarts_used, 1);
  EXPECT_EQ(d.membership_changes_used, 4);
  EXPECT_FALSE(d.assignment.has_value());
  EXPECT_EQ(d.round_reason, "why");
  EXPECT_EQ(d.root_cause, "rank 1");
  EXPECT_EQ(d.exit_code, 3);

  v.phase = JobPhase::kRunning;
  v.assignment = NodeAssignment{2, 1, 2, 8, 4, 4};
  FrameWriter with;
  with.u8(1).i64(2).i64(3).i64(1).i64(4).u8(1);
  with.i64(2).i64(1).i64(2).i64(8).i64(4).i64(4).str("why").str("rank 1").i64(3);
  EXPECT_EQ(encode_job_view(v).body(), with.body());
  body = encode_job_view(v).body();
  FrameReader r2(body.data(), body.size());
  d = decode_job_view(r2);
  ASSERT_TRUE(d.assignment.has_value());
  testing::expect_assignment(*d.assignment, *v.assignment);
}

TEST(ElasticWire, DecodersRefuseValuesOutOfRange) {
  auto usage = [](const FrameWriter& w, auto decode) {
    FrameReader r(w.body().data(), w.body().size());
    expect_error([&] { decode(r); }, ExitCode::kUsage);
  };
  usage(FrameWriter().str("").str("h").i64(1).i64(0), decode_join);   // empty node id
  usage(FrameWriter().str("n").str("h").i64(0).i64(0), decode_join);  // nproc 0
  usage(FrameWriter().str("n").str("h").i64(kMaxLocalRanks + 1).i64(0), decode_join);
  usage(FrameWriter().str("n").str(std::string(kMaxNodeIdBytes + 1, 'h')).i64(1).i64(0),
        decode_join);  // host too long
  usage(FrameWriter().str("n").i64(1).u32(kMaxLocalRanks + 1), decode_heartbeat);
  usage(FrameWriter().str("n").i64(1).u32(1).i64(0).u32(2).u8(0).u8(0), decode_heartbeat);
  usage(FrameWriter()
            .str("n")
            .str("h")
            .i64(0)
            .i64(1)
            .i64(0)
            .str("r")
            .keys(std::vector<std::string>(kMaxLastLines + 1, "l"))
            .i64(1),
        decode_report_failure);
  usage(FrameWriter().str(std::string(kMaxNodeIdBytes + 1, 'n')).i64(1), decode_report_success);
  usage(FrameWriter().str(""), decode_state);

  const Body bad_phase = FrameWriter().u8(9).body();
  FrameReader r(bad_phase.data(), bad_phase.size());
  EXPECT_THROW(decode_job_view(r), ProtocolError);
}

// ---------------------------------------------------------------- commit ops (37-38)

using checkpoint::CommittedReport;  // the commit registry's reports (checkpoint/commit.hpp)
using checkpoint::ShardReport;

TEST(CommitWire, ShardDurableRoundTrips) {
  ShardReport m{"/ckpt", 2, 40, 1, 4, "{\"a\":1}"};
  auto d = decode_request(
      encode_shard_durable(m),
      op(Op::kCkptShardDurable).str("/ckpt").i64(2).i64(40).i64(1).i64(4).str("{\"a\":1}"),
      Op::kCkptShardDurable, decode_shard_durable);
  EXPECT_EQ(d.root, "/ckpt");
  EXPECT_EQ(d.generation, 2);
  EXPECT_EQ(d.step, 40);
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 4);
  EXPECT_EQ(d.descriptor, "{\"a\":1}");
}

TEST(CommitWire, CommittedRoundTrips) {
  CommittedReport m{"/ckpt", 40, {20, 30}, 2, 10, 20, 30};
  auto d = decode_request(encode_committed(m),
                          op(Op::kCkptCommitted)
                              .str("/ckpt")
                              .i64(40)
                              .u32(2)
                              .i64(20)
                              .i64(30)
                              .i64(2)
                              .i64(10)
                              .i64(20)
                              .i64(30),
                          Op::kCkptCommitted, decode_committed);
  EXPECT_EQ(d.root, "/ckpt");
  EXPECT_EQ(d.step, 40);
  EXPECT_EQ(d.on_disk, (std::vector<int64_t>{20, 30}));
  EXPECT_EQ(d.keep_last, 2);
  EXPECT_EQ(d.keep_every, 10);
  EXPECT_EQ(d.protected_step, 20);
  EXPECT_EQ(d.latest_step, 30);
}

}  // namespace
}  // namespace dnallm::coordinator
