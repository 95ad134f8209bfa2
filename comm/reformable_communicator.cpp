#include "comm/reformable_communicator.hpp"

#include "comm/detail/queued_communicator.hpp"
#include "coordinator/store.hpp"
#include "core/error.hpp"

namespace dnallm::comm {

ReformableCommunicator::ReformableCommunicator(std::unique_ptr<Communicator> backend,
                                               std::string name)
    : backend_(std::move(backend)), name_(std::move(name)) {
  DNALLM_CHECK(backend_ != nullptr, ExitCode::kFailure,
               "ReformableCommunicator needs a backend (a bug; please report it)");
  rank_ = backend_->rank();
  world_ = backend_->world_size();
  kind_ = backend_->backend();
}

Communicator& ReformableCommunicator::live() const {
  DNALLM_CHECK(backend_ != nullptr, ExitCode::kPeerFailed,
               "communicator '{}' was aborted for in-process recovery and not re-formed yet",
               name_);
  return *backend_;
}

void ReformableCommunicator::abort() { backend_.reset(); }

bool ReformableCommunicator::backend_failed(coordinator::Store& store) const {
  if (store.check({detail::PeerMonitor::failed_key(name_, rank_)})) return true;
  // A failure seen in a split of this world (the context group) is recorded under that group's
  // name; the world's alive keys tell that one of its ranks is gone.
  for (int r = 0; r < world_; ++r) {
    if (r != rank_ && !store.check({detail::PeerMonitor::alive_key(name_, r)})) {
      return true;
    }
  }
  return false;
}

void ReformableCommunicator::replace(std::unique_ptr<Communicator> backend, std::string name) {
  DNALLM_CHECK(backend != nullptr && backend->rank() == rank_ && backend->world_size() == world_,
               ExitCode::kFailure,
               "communicator '{}' re-formed as '{}' with another rank or world size (a bug; "
               "please report it)",
               name_, name);
  resize(std::move(backend), std::move(name));
}

void ReformableCommunicator::resize(std::unique_ptr<Communicator> backend, std::string name) {
  DNALLM_CHECK(backend != nullptr, ExitCode::kFailure,
               "communicator '{}' re-formed without a backend (a bug; please report it)", name_);
  backend_.reset();  // joins the old backend's thread first: its pending work fails there
  backend_ = std::move(backend);
  name_ = std::move(name);
  rank_ = backend_->rank();
  world_ = backend_->world_size();
}

}  // namespace dnallm::comm
