// Internal to worker/train's in-process recovery (Note [In-process recovery],
// worker/train/in_process_recovery.hpp): what the survivors' side (in_process_recovery.cpp),
// the spares' (spare_place.cpp) and the buddy copies (buddy_copies.cpp) share.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "cluster/topology.hpp"
#include "comm/communicator.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/worker_env.hpp"
#include "worker/parallel/device_group.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::train::recovery_detail {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b);

inline void wait_all(comm::WorkPtr work) { work->wait(); }

// The state the source broadcasts beside the tensors (step 5 of the Note), as doubles: every
// count is far below 2^53.
struct StateHeader {
  enum : int64_t {
    kStep,
    kAdamSteps,
    kRawScale,
    kCleanSteps,
    kSkipped,
    kBest,
    kCursor,
    kAccum,  // checked: a spare must accumulate as the survivors do
    kLoss,   // the source's last step, for a rank 0 that did not log it
    kLr,
    kGradNorm,
    kCount
  };
};

// Note [Buddy copies]: no rank holds a copy of a dead rank's shard (its buddy died with it):
// the recovery gives up at once and the generation restarts from its last checkpoint.
class StateLost : public Error {
 public:
  using Error::Error;
};

// `t` (contiguous, of a wire dtype) in views of at most kRecoveryChunkElements elements, so
// that no transfer needs a second copy of a large buffer.
void for_each_chunk(const torch::Tensor& t, const std::function<void(BufferView)>& fn);

// Broadcasts `t` (contiguous, the same numel on every rank) from `root` in place, in chunks;
// returns its bytes.
int64_t broadcast_tensor(comm::Communicator& comm, const torch::Tensor& t, int root);

// A client of the job's coordinator store (a spare's own, before it has a process group).
std::shared_ptr<coordinator::TcpStoreClient> coordinator_client(const std::string& host, int port,
                                                                const std::string& token);

double allreduce_max(comm::Communicator& comm, double value);

// Waits up to kWaitSlice for `key` (the server answers as soon as it is set): true when it
// exists. Short slices, so that the caller sees a stop signal or its deadline in time.
inline constexpr auto kWaitSlice = std::chrono::milliseconds(100);
bool wait_a_while(coordinator::Store& store, const std::string& key);

// The last step of each kind of line in the metrics file `path` ("" for step lines, else the
// event; restart events are not counted).
std::map<std::string, int64_t> last_logged_steps(const std::string& path);

// Step 4's group for recovery `number`. Connecting can block where no store wait sees a later
// recovery (gloo retries a dead spare's published address until its timeout), so it runs on a
// thread of its own; when a later recovery is announced first, this one gives way (Error
// kPeerFailed) and leaves that thread to end on its own (its connection fails: a member died).
std::unique_ptr<comm::Communicator> connect_recovery_group(
    const Config& config, const WorkerEnv& env, const cluster::Topology& topo,
    const parallel::RankDevice& device, const std::shared_ptr<coordinator::Store>& store,
    int64_t number);

}  // namespace dnallm::train::recovery_detail
