// make_communicator: the factory that builds a Communicator for CommOptions, choosing and
// checking the backend (gloo, mpi, or a plugin's: nccl) and wrapping it in a
// CheckedCommunicator when asked. Apart from comm/communicator.hpp (the interface), because
// it includes every backend, and every backend includes the interface.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.hpp"

namespace dnallm::comm {

// Builds and connects the communicator (collective over all ranks: blocks until every
// rank has joined, up to `timeout`). Throws Error(kUsage) for an unknown or unbuilt
// backend, Error(kPeerFailed) when peers do not join in time.
std::unique_ptr<Communicator> make_communicator(const CommOptions& options);

// Which backend "auto" resolves to here (for logs and the bench).
std::string resolve_backend(const CommOptions& options);
// Whether a backend can be made here: gloo and mpi when compiled in; nccl when the CUDA
// plugin provides it, which asking loads (Note [Lazy CUDA] in core/cuda_plugin.hpp).
bool backend_available(const std::string& name);

// Backends that plugins provide (nccl, from libdnallm_cuda.so): the plugin registers its
// factory when it is loaded. make_communicator checks the options first.
using BackendFactory = std::unique_ptr<Communicator> (*)(const CommOptions& options);
void register_backend(const std::string& name, BackendFactory factory);

}  // namespace dnallm::comm
