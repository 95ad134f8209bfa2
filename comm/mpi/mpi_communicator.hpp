// The mpi backend: OpenMPI collectives for processes started by mpirun (a static world).
//
// - MPI_Init_thread(MPI_THREAD_SERIALIZED) at construction unless MPI is already
//   initialised; MPI_Finalize at destruction if this object initialised it. Hence one mpi
//   communicator per process (MPI cannot be initialised twice).
// - Rank and world size come from MPI (MPI_COMM_WORLD, duplicated); CommOptions::rank /
//   world_size are ignored.
// - Collectives are the blocking MPI calls (the tuned algorithms raw MPI users get) on
//   the QueuedCommunicator worker thread, in issue order.
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
