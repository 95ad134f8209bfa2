// The nccl backend (built only with DNALLM_HAVE_NCCL). NCCL and CUDA types stay in the
// .cpp: this header is all that other modules see.
//
// Bootstrap: rank 0 creates the ncclUniqueId and publishes it in the store at
// "comm/<name>/nccl/id"; the others wait for it (up to CommOptions::timeout) and all call
// ncclCommInitRank on CommOptions::device.
// Streams and completion: collectives are enqueued, in issue order, on the communicator's
// own non-blocking CUDA stream; each records a CUDA event that its Work polls
// (is_completed = cudaEventQuery, wait = polling with a deadline). Buffers must be CUDA
// memory on CommOptions::device.
// Failure: a watchdog thread (owned by the communicator, joined in its destructor)
// checks every in-flight collective; one older than CommOptions::timeout makes it call
// ncclCommAbort, after which every Work fails with Error(kPeerFailed) naming the ranks
// found dead or absent through the store (Note [Peer failure]).
// Uneven shards: reduce_scatter / allgather use ncclReduceScatter / ncclAllGather when
// the count divides by the world size, else a group of per-shard ncclReduce /
// ncclBroadcast calls.
// all_to_all: one NCCL group of ncclSend / ncclRecv per peer with a non-empty block, the
// kept block copied on the stream. send / recv: ncclSend / ncclRecv on the stream (no tags
// in NCCL: checked, then ignored; a send waits on the stream for the peer's recv).
// split: ncclCommSplit (NCCL 2.18+; older builds throw Error(kUsage)); the sub-group gets
// its own stream and watchdog. NCCL's communicator creation has no timeout of ours: the
// split blocks until every rank of the parent calls it.
#pragma once

#include <memory>

#include "comm/communicator.hpp"

namespace dnallm::comm {

std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& options);

}  // namespace dnallm::comm
