// The mpi backend: OpenMPI collectives for processes started by mpirun (a static world).
//
// - MPI_Init_thread(MPI_THREAD_MULTIPLE) at construction unless MPI is already
//   initialised; MPI_Finalize when this communicator and every sub-group split from it are
//   destroyed, if it initialised MPI. Hence one mpi communicator per process made by
//   make_communicator (MPI cannot be initialised twice); split() makes more.
// - Rank and world size come from MPI (MPI_COMM_WORLD, duplicated); CommOptions::rank /
//   world_size are ignored.
// - Collectives are the blocking MPI calls (the tuned algorithms raw MPI users get) on
//   the QueuedCommunicator worker thread, in issue order: all_to_all = MPI_Alltoallv,
//   split = MPI_Comm_split (the sub-group gets its own worker thread). send / recv are
//   MPI_Isend / MPI_Irecv posted by the worker and polled (MPI_Test) by the completion
//   thread (Note [Posted transfers]); tags up to MPI_TAG_UB. split, send and recv need
//   MPI_THREAD_MULTIPLE (Open MPI provides it); without it they throw Error(kUsage).
// - Timeouts: MPI cannot cancel a collective. Work::wait(timeout) throws
//   Error(kPeerFailed) when it expires (naming ranks if a store was given, Note [Peer
//   failure]); the stuck call is abandoned and the destructor then calls MPI_Abort
//   instead of MPI_Finalize. Under mpirun a dead rank normally makes mpirun end the job.
// - fp16 and bf16 reduce with user MPI_Ops (Note [Half-precision reduction]).
#pragma once

#include <memory>

#include "comm/communicator.hpp"

namespace dnallm::comm {

std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& options);

}  // namespace dnallm::comm
