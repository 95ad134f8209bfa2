#include "comm/checked_communicator.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "coordinator/store.hpp"
#include "core/error.hpp"

namespace dnallm::comm {
namespace {

// Fingerprints through the wrapped communicator (no store): fixed-size, NUL-padded.
constexpr size_t kFingerprintBytes = 128;

coordinator::Bytes to_bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string to_string(const coordinator::Bytes& b) { return {b.begin(), b.end()}; }

// "#<seq> <description>": the value published for collective seq.
std::string published(uint64_t seq, const std::string& description) {
  return fmt::format("#{} {}", seq, description);
}

}  // namespace

std::string CollectiveFingerprint::describe() const {
  std::string s = op;
  if (!detail.empty()) s += " " + detail;
  if (typed) s += fmt::format(" {}", dtype_name(dtype));
  if (count >= 0) s += fmt::format(" x{}", count);
  return s;
}

std::string describe_mismatch(const std::string& name, uint64_t seq,
                              const std::vector<std::string>& issued) {
  // Ranks grouped by what they issued, groups in the order of their first rank.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < issued.size(); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == issued[r]; });
    if (it == groups.end()) {
      groups.emplace_back(issued[r], std::vector<int>{});
      it = groups.end() - 1;
    }
    it->second.push_back(static_cast<int>(r));
  }
  std::string parts;
  for (const auto& [what, ranks] : groups) {
    if (!parts.empty()) parts += "; ";
    parts += fmt::format("rank(s) {} issued {}", fmt::join(ranks, ", "), what);
  }
  return fmt::format(
      "collective #{} of communicator '{}' differs across ranks: {} (every rank must issue the "
      "same collectives in the same order; Note [Collective check] in "
      "comm/checked_communicator.hpp)",
      seq, name, parts);
}

CheckedCommunicator::CheckedCommunicator(std::unique_ptr<Communicator> inner,
                                         std::shared_ptr<coordinator::Store> store,
                                         std::string name, std::chrono::milliseconds timeout)
    : inner_(std::move(inner)),
      store_(std::move(store)),
      name_(std::move(name)),
      timeout_(timeout) {
  DNALLM_CHECK(inner_ != nullptr, ExitCode::kFailure, "CheckedCommunicator needs a communicator");
}

CheckedCommunicator::~CheckedCommunicator() {
  if (seq_ > 0) {
    spdlog::info(
        "communicator '{}': {} collectives checked across ranks, every one the same on "
        "every rank (parallel.check_collectives)",
        name_, seq_);
  }
}

uint64_t CheckedCommunicator::checked() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seq_;
}

std::string CheckedCommunicator::key(uint64_t seq, int rank) const {
  return fmt::format("comm/{}/check/{}/{}", name_, seq, rank);
}

void CheckedCommunicator::check(const CollectiveFingerprint& fp) {
  const uint64_t seq = seq_ + 1;
  const std::string mine = published(seq, fp.describe());
  if (store_) {
    check_through_store(mine);
  } else {
    const std::vector<std::string> all = exchange_through_inner(mine);
    if (std::any_of(all.begin(), all.end(), [&](const std::string& s) { return s != mine; })) {
      std::vector<std::string> issued;
      for (const auto& s : all) issued.push_back(s.substr(s.find(' ') + 1));
      fail(ExitCode::kFailure, "{}", describe_mismatch(name_, seq, issued));
    }
  }
  seq_ = seq;
  last_ = fp.describe();
}

void CheckedCommunicator::check_through_store(const std::string& mine) {
  const uint64_t seq = seq_ + 1;
  const int me = rank(), world = world_size();
  store_->set(key(seq, me), to_bytes(mine));
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(key(seq, r));
  try {
    store_->wait(keys, timeout_);
  } catch (const Error&) {
    std::vector<int> missing;
    for (int r = 0; r < world; ++r) {
      if (!store_->try_get(key(seq, r))) missing.push_back(r);
    }
    if (missing.empty()) throw;  // arrived in between: the store itself failed
    const std::string last =
        seq > 1 ? fmt::format("their last was collective #{} ({}), whose fingerprint matched",
                              seq - 1, last_)
                : std::string("they issued no collective on it");
    fail(ExitCode::kPeerFailed,
         "collective check: rank(s) {} did not issue collective #{} of communicator '{}' within "
         "{} ms (rank {} issued {}); {}. A rank that skipped or repeated a collective, stopped "
         "early, or died (Note [Collective check] in comm/checked_communicator.hpp)",
         fmt::join(missing, ", "), seq, name_, timeout_.count(), me,
         mine.substr(mine.find(' ') + 1), last);
  }
  std::vector<std::string> issued(static_cast<size_t>(world));
  bool same = true;
  for (int r = 0; r < world; ++r) {
    const std::string theirs = to_string(store_->get(keys[static_cast<size_t>(r)], timeout_));
    issued[static_cast<size_t>(r)] = theirs.substr(theirs.find(' ') + 1);
    same = same && theirs == mine;
  }
  if (!same) fail(ExitCode::kFailure, "{}", describe_mismatch(name_, seq, issued));
  // Every peer has read our fingerprint of seq - 1: it published seq only after that check.
  if (seq > 1) store_->remove(key(seq - 1, me));
}

std::vector<std::string> CheckedCommunicator::exchange_through_inner(const std::string& mine) {
  const int world = world_size();
  std::vector<uint8_t> in(kFingerprintBytes, 0), out(kFingerprintBytes * size_t(world), 0);
  std::memcpy(in.data(), mine.data(), std::min(mine.size(), kFingerprintBytes - 1));
  BufferView vin{in.data(), in.size(), DType::kUInt8, Device{}};
  BufferView vout{out.data(), out.size(), DType::kUInt8, Device{}};
  inner_->allgather(vin, vout)->wait();
  std::vector<std::string> all;
  for (int r = 0; r < world; ++r) {
    const char* p = reinterpret_cast<const char*>(out.data() + kFingerprintBytes * size_t(r));
    all.emplace_back(p, strnlen(p, kFingerprintBytes));
  }
  // Compare what every rank could send: a long description is cut the same on every rank.
  const std::string cut = mine.substr(0, kFingerprintBytes - 1);
  for (auto& s : all) {
    if (s == cut) s = mine;
  }
  return all;
}

WorkPtr CheckedCommunicator::allreduce(BufferView in, BufferView out, ReduceOp op) {
  std::lock_guard<std::mutex> lock(mu_);
  check({"allreduce", reduce_op_name(op), in.dtype, static_cast<int64_t>(in.count)});
  return inner_->allreduce(in, out, op);
}

WorkPtr CheckedCommunicator::reduce_scatter(BufferView in, BufferView out, ReduceOp op) {
  std::lock_guard<std::mutex> lock(mu_);
  check({"reduce_scatter", reduce_op_name(op), in.dtype, static_cast<int64_t>(in.count)});
  return inner_->reduce_scatter(in, out, op);
}

WorkPtr CheckedCommunicator::allgather(BufferView in, BufferView out) {
  std::lock_guard<std::mutex> lock(mu_);
  check({"allgather", "", out.dtype, static_cast<int64_t>(out.count)});
  return inner_->allgather(in, out);
}

WorkPtr CheckedCommunicator::broadcast(BufferView buf, int root) {
  std::lock_guard<std::mutex> lock(mu_);
  check({"broadcast", fmt::format("root {}", root), buf.dtype, static_cast<int64_t>(buf.count)});
  return inner_->broadcast(buf, root);
}

WorkPtr CheckedCommunicator::barrier() {
  std::lock_guard<std::mutex> lock(mu_);
  check({"barrier", "", DType::kUInt8, -1, false});
  return inner_->barrier();
}

WorkPtr CheckedCommunicator::all_to_all(BufferView in, const std::vector<int64_t>& in_counts,
                                        BufferView out, const std::vector<int64_t>& out_counts) {
  std::lock_guard<std::mutex> lock(mu_);
  check({"all_to_all", "", in.dtype, -1});
  return inner_->all_to_all(in, in_counts, out, out_counts);
}

std::unique_ptr<Communicator> CheckedCommunicator::split(int color, int key) {
  std::unique_ptr<Communicator> child;
  uint64_t n = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check({"split", "", DType::kUInt8, -1, false});
    child = inner_->split(color, key);
    n = ++splits_;
  }
  if (!child) return nullptr;
  // The sub-group is checked too, under its own name (its keys apart from ours).
  return std::make_unique<CheckedCommunicator>(std::move(child), store_,
                                               split_name(name_, n, color), timeout_);
}

}  // namespace dnallm::comm
