#include "comm/gloo/gloo_communicator.hpp"

#include <algorithm>
#include <csignal>
#include <cstring>
#include <utility>
#include <vector>

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <spdlog/spdlog.h>

#include "comm/detail/cpu_reduce.hpp"
#include "comm/detail/queued_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::comm {

namespace {

// gloo slot prefixes for what we build on unbound buffers (gloo's use 0x01..0x08).
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;
constexpr uint8_t kSendRecvSlotPrefix = 0x41;  // + the user's tag
constexpr uint8_t kAllToAllSlotPrefix = 0x42;  // + the collective's tag

// gloo waits take a relative timeout; a deadline already passed still gets 1 ms (0 would
// be gloo's "unset", i.e. the context's timeout).
std::chrono::milliseconds until(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

// A send or recv posted on an unbound buffer (Note [Posted transfers]). A zero-element
// message still travels (it matches one recv, as in MPI): gloo gets a one-byte scratch
// buffer and moves zero bytes of it.
class GlooTransfer final : public detail::QueuedCommunicator::PostedTransfer {
 public:
  GlooTransfer(gloo::Context& context, const BufferView& buf, bool is_send, int peer, uint64_t slot)
      : is_send_(is_send), peer_(peer) {
    void* data = buf.bytes() > 0 ? buf.data : &empty_;
    buffer_ = context.createUnboundBuffer(data, buf.bytes());
    if (is_send_)
      buffer_->send(peer, slot, 0, buf.bytes());
    else
      buffer_->recv(peer, slot, 0, buf.bytes());
  }
  void wait_until(std::chrono::steady_clock::time_point deadline) override {
    // gloo throws IoException on its timeout (and closes this context's pairs).
    const bool done =
        is_send_ ? buffer_->waitSend(until(deadline)) : buffer_->waitRecv(until(deadline));
    if (!done)
      throw std::runtime_error(std::string(is_send_ ? "send to" : "recv from") + " rank " +
                               std::to_string(peer_) + " was aborted");
  }

 private:
  bool is_send_;
  int peer_;
  uint8_t empty_ = 0;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
};

// Our Store seen as gloo's rendezvous store, under a key prefix, with our timeout.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(coordinator::Store& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, coordinator::Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(prefix_ + key, timeout_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_.wait(full, timeout);
  }

 private:
  coordinator::Store& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

class GlooCommunicator final : public detail::QueuedCommunicator {
 public:
  // `device`: a sub-group shares its parent's TCP device (null: create one); `parent_ranks`
  // (sub-groups) names the parent's ranks of this group's members in errors.
  explicit GlooCommunicator(const CommOptions& o,
                            std::shared_ptr<gloo::transport::Device> device = nullptr,
                            const std::vector<int>& parent_ranks = {})
      : QueuedCommunicator(o, o.rank, o.world_size, "gloo", /*spin_wait=*/true) {
    DNALLM_CHECK(o.store != nullptr, ExitCode::kUsage,
                 "the gloo backend needs a coordinator store (MASTER_ADDR/MASTER_PORT)");
    DNALLM_CHECK(o.world_size >= 1 && o.rank >= 0 && o.rank < o.world_size, ExitCode::kUsage,
                 "gloo: rank {} outside world size {}", o.rank, o.world_size);
    // gloo writes to peer sockets without MSG_NOSIGNAL: a dead peer must surface as an
    // I/O error, not kill this process with SIGPIPE. Only a default disposition is changed.
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL)
      std::signal(SIGPIPE, SIG_IGN);
    gloo::transport::tcp::attr attr;
    attr.hostname = !o.gloo_host.empty() ? o.gloo_host : (o.loopback ? "127.0.0.1" : host_name());
    try {
      device_ = device ? std::move(device) : gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
      context->setTimeout(o.timeout);
      GlooStoreAdapter adapter(*o.store, "comm/" + o.name + "/gloo/", o.timeout);
      context->connectFullMesh(adapter, device_);
      context_ = context;
    } catch (const gloo::Exception& e) {
      fail(ExitCode::kPeerFailed, "gloo: rank {} could not connect to its peers via {}: {}", o.rank,
           attr.hostname, e.what());
    }
    if (!parent_ranks.empty()) set_parent_ranks(parent_ranks);
    start_worker();
  }

  ~GlooCommunicator() override { stop_worker(); }

 protected:
  void run_allreduce(const BufferView& in, const BufferView& out, ReduceOp op, uint32_t) override {
    allreduce_bytes(in.data, out.data, in.count, in.dtype, op);
    if (op == ReduceOp::kAvg) detail::divide_elements(out.dtype, out.data, out.count, world_size());
  }

  // A ring reduce-scatter on gloo's point-to-point buffers: W-1 steps; in step s rank r
  // sends its partial sum of shard (r-s-1) to rank r+1 and adds the partial sum of shard
  // (r-s-2) received from rank r-1, so after the last step it holds shard r reduced over
  // all ranks. Each rank moves (W-1)/W of the buffer, the optimum.
  void run_reduce_scatter(const BufferView& in, const BufferView& out, ReduceOp op,
                          uint32_t) override {
    const int world = world_size();
    const int me = rank();
    const size_t es = dtype_size(in.dtype);
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, next_tag());
    if (in.count == 0) return;
    const auto* src = static_cast<const uint8_t*>(in.data);
    scratch_.assign(src, src + in.bytes());
    recv_scratch_.resize(shard_range(in.count, world, 0).count * es);  // shard 0 is largest
    auto acc = context_->createUnboundBuffer(scratch_.data(), scratch_.size());
    auto incoming = context_->createUnboundBuffer(recv_scratch_.data(), recv_scratch_.size());
    const int right = (me + 1) % world;
    const int left = (me + world - 1) % world;
    const ReduceOp reduce = op == ReduceOp::kMax ? ReduceOp::kMax : ReduceOp::kSum;
    auto shard_of = [&](int s, int k) {
      return shard_range(in.count, world, ((me - s - k) % world + world) % world);
    };
    for (int s = 0; s < world - 1; ++s) {
      const auto send = shard_of(s, 1);
      const auto recv = shard_of(s, 2);
      if (send.count > 0) acc->send(right, slot, send.offset * es, send.count * es);
      if (recv.count > 0) incoming->recv(left, slot, 0, recv.count * es);
      if (recv.count > 0 && !incoming->waitRecv(timeout()))
        throw std::runtime_error("reduce_scatter: timed out receiving from rank " +
                                 std::to_string(left));
      if (send.count > 0 && !acc->waitSend(timeout()))
        throw std::runtime_error("reduce_scatter: timed out sending to rank " +
                                 std::to_string(right));
      uint8_t* partial = scratch_.data() + recv.offset * es;
      detail::reduce_elements(in.dtype, reduce, partial, partial, recv_scratch_.data(), recv.count);
    }
    const auto mine = shard_range(in.count, world, me);
    std::memmove(out.data, scratch_.data() + mine.offset * es, mine.count * es);
    if (op == ReduceOp::kAvg) detail::divide_elements(out.dtype, out.data, out.count, world);
  }

  void run_allgather(const BufferView& in, const BufferView& out, uint32_t) override {
    const size_t esize = dtype_size(out.dtype);
    std::vector<size_t> bytes_per_rank(static_cast<size_t>(world_size()));
    for (int r = 0; r < world_size(); ++r)
      bytes_per_rank[static_cast<size_t>(r)] =
          shard_range(out.count, world_size(), r).count * esize;
    // gloo copies the input into its slot itself; an input aliasing the output (in place)
    // is staged so that the copy never overlaps.
    const uint8_t* src = static_cast<const uint8_t*>(in.data);
    auto* dst = static_cast<uint8_t*>(out.data);
    if (src >= dst && src < dst + out.bytes()) {
      scratch_.assign(src, src + in.bytes());
      src = scratch_.data();
    }
    gloo::AllgathervOptions opts(context_);
    opts.setInput<uint8_t>(const_cast<uint8_t*>(src), in.bytes());
    opts.setOutput<uint8_t>(dst, bytes_per_rank);
    opts.setTag(next_tag());
    opts.setTimeout(timeout());
    gloo::allgatherv(opts);
  }

  void run_broadcast(const BufferView& buf, int root, uint32_t) override {
    gloo::BroadcastOptions opts(context_);
    opts.setOutput<uint8_t>(static_cast<uint8_t*>(buf.data), buf.bytes());
    opts.setRoot(root);
    opts.setTag(next_tag());
    opts.setTimeout(timeout());
    gloo::broadcast(opts);
  }

  void run_barrier(uint32_t) override {
    gloo::BarrierOptions opts(context_);
    opts.setTag(next_tag());
    opts.setTimeout(timeout());
    gloo::barrier(opts);
  }

  // Pairwise exchange on unbound buffers: every block is posted at once (a send to
  // rank+i and a recv from rank-i for i = 1..W-1, so that no two ranks wait on each
  // other in a cycle), then waited for in that order, each until the collective's
  // deadline. Empty blocks are not sent: both sides know their size. Each rank moves
  // exactly what it sends and receives, the optimum.
  void run_all_to_all(const BufferView& in, const BufferView& out, const AllToAllLayout& layout,
                      uint32_t) override {
    const int world = world_size();
    const int me = rank();
    const size_t es = dtype_size(in.dtype);
    const uint64_t slot = gloo::Slot::build(kAllToAllSlotPrefix, next_tag());
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    auto block = [&](const BufferView& b, const std::vector<size_t>& off, int p) {
      const auto u = static_cast<size_t>(p);
      return std::make_pair(static_cast<uint8_t*>(b.data) + off[u] * es,
                            (off[u + 1] - off[u]) * es);
    };
    const auto [self_src, self_bytes] = block(in, layout.in_offsets, me);
    if (self_bytes > 0) std::memcpy(block(out, layout.out_offsets, me).first, self_src, self_bytes);
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sends(world), recvs(world);
    for (int i = 1; i < world; ++i) {
      const int to = (me + i) % world;
      const int from = (me - i + world) % world;
      if (auto [p, n] = block(in, layout.in_offsets, to); n > 0) {
        sends[to] = context_->createUnboundBuffer(p, n);
        sends[to]->send(to, slot);
      }
      if (auto [p, n] = block(out, layout.out_offsets, from); n > 0) {
        recvs[from] = context_->createUnboundBuffer(p, n);
        recvs[from]->recv(from, slot);
      }
    }
    for (int i = 1; i < world; ++i) {
      const int to = (me + i) % world;
      const int from = (me - i + world) % world;
      try {
        if (recvs[from] && !recvs[from]->waitRecv(until(deadline)))
          throw std::runtime_error("aborted");
      } catch (const std::exception& e) {
        throw std::runtime_error("all_to_all: waiting for the block from rank " +
                                 std::to_string(from) + ": " + e.what());
      }
      try {
        if (sends[to] && !sends[to]->waitSend(until(deadline))) throw std::runtime_error("aborted");
      } catch (const std::exception& e) {
        throw std::runtime_error("all_to_all: sending the block to rank " + std::to_string(to) +
                                 ": " + e.what());
      }
    }
  }

  std::unique_ptr<PostedTransfer> post_send(const BufferView& buf, int peer, int tag) override {
    return std::make_unique<GlooTransfer>(*context_, buf, true, peer,
                                          gloo::Slot::build(kSendRecvSlotPrefix, tag));
  }

  std::unique_ptr<PostedTransfer> post_recv(const BufferView& buf, int peer, int tag) override {
    return std::make_unique<GlooTransfer>(*context_, buf, false, peer,
                                          gloo::Slot::build(kSendRecvSlotPrefix, tag));
  }

  // Colors and keys go round with an allgather on this context; the members then connect a
  // new gloo context (full mesh) through the store under the new communicator's name, on
  // this rank's TCP device.
  std::unique_ptr<Communicator> run_split(int color, int key, const std::string& name) override {
    const int world = world_size();
    std::vector<int64_t> mine = {color, key};
    std::vector<int64_t> all(2 * static_cast<size_t>(world));
    if (world > 1) {
      run_allgather(BufferView{mine.data(), 2, DType::kInt64, {}},
                    BufferView{all.data(), all.size(), DType::kInt64, {}}, 0);
    } else {
      all = mine;
    }
    std::vector<int> colors(static_cast<size_t>(world)), keys(static_cast<size_t>(world));
    for (size_t r = 0; r < colors.size(); ++r) {
      colors[r] = static_cast<int>(all[2 * r]);
      keys[r] = static_cast<int>(all[2 * r + 1]);
    }
    const std::vector<int> members = split_members(colors, keys, rank());
    if (members.empty()) return nullptr;
    CommOptions o = options();
    o.name = name;
    o.rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    o.world_size = static_cast<int>(members.size());
    return std::make_unique<GlooCommunicator>(o, device_, members);
  }

  void on_failure() override {
    // Peers blocked on this rank then fail at once instead of at their timeout.
    if (context_) context_->closeConnections();
  }

 private:
  uint32_t next_tag() { return tag_++; }

  void allreduce_bytes(const void* in, void* out, size_t count, DType dtype, ReduceOp op) {
    if (count == 0) return;
    const size_t esize = dtype_size(dtype);
    gloo::AllreduceOptions opts(context_);
    // gloo only needs the element size; the reduction is ours (Note [Half-precision reduction]).
    auto set = [&](auto tag_type) {
      using T = decltype(tag_type);
      if (in != out) opts.setInput<T>(static_cast<T*>(const_cast<void*>(in)), count);
      opts.setOutput<T>(static_cast<T*>(out), count);
    };
    switch (esize) {
      case 1:
        set(uint8_t{});
        break;
      case 2:
        set(uint16_t{});
        break;
      case 4:
        set(uint32_t{});
        break;
      case 8:
        set(uint64_t{});
        break;
      default:
        fail(ExitCode::kFailure, "gloo: unsupported element size {}", esize);
    }
    const ReduceOp reduce = op == ReduceOp::kMax ? ReduceOp::kMax : ReduceOp::kSum;
    opts.setReduceFunction([dtype, reduce, esize](void* o, const void* a, const void* b, size_t n) {
      // gloo passes the element count of its own type, which has our element size.
      (void)esize;
      detail::reduce_elements(dtype, reduce, o, a, b, n);
    });
    opts.setTag(next_tag());
    opts.setTimeout(timeout());
    gloo::allreduce(opts);
  }

  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t tag_ = 0;                   // worker thread only
  std::vector<uint8_t> scratch_;       // worker thread only
  std::vector<uint8_t> recv_scratch_;  // worker thread only
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const CommOptions& options) {
  return std::make_unique<GlooCommunicator>(options);
}

}  // namespace dnallm::comm
