// The gloo backend: libgloo's TCP transport, bootstrapped through our Store.
//
// Rendezvous: every rank creates a gloo TCP device on CommOptions::gloo_host and runs
// gloo's full-mesh connect, which exchanges addresses through the store under
// "comm/<name>/gloo/". Collectives run on the QueuedCommunicator worker thread, one at a
// time, each with gloo's own end-to-end timeout = CommOptions::timeout.
//
// Algorithms: allreduce = gloo::allreduce (ring / bcube); reduce_scatter = our ring on
// gloo's point-to-point unbound buffers (gloo's own reduce-scatter has no timeout and no
// bf16), moving the optimal (W-1)/W of the buffer; allgather = gloo::allgatherv (shards
// may differ by one element); broadcast = gloo::broadcast; barrier = gloo::barrier;
// all_to_all = our pairwise exchange on unbound buffers (every block posted at once, empty
// ones skipped); send / recv = unbound buffers in slot 0x41 + tag (Note [Posted transfers]
// in comm/detail/queued_communicator.hpp); split = an allgather of (color, key), then a new
// gloo context over the store under the new communicator's name, on the same TCP device.
// Reductions use comm/detail/cpu_reduce.hpp (bf16/fp16: see
// Note [Half-precision reduction]).
//
// Side effect: constructing one sets SIGPIPE to SIG_IGN if it was SIG_DFL (gloo writes to
// sockets without MSG_NOSIGNAL; a dead peer must be an error, not a silent death).
#pragma once

#include <memory>

#include "comm/communicator.hpp"

namespace dnallm::comm {

// Collective over all ranks: blocks until every rank joined (up to options.timeout).
std::unique_ptr<Communicator> make_gloo_communicator(const CommOptions& options);

}  // namespace dnallm::comm
