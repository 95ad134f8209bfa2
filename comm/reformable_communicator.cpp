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
}

bool ReformableCommunicator::backend_failed(coordinator::Store& store) const {
  if (store.check({detail::PeerMonitor::failed_key(name_, backend_->rank())})) return true;
  // A failure seen in a split of this world (the context group) is recorded under that group's
  // name; the world's alive keys tell that one of its ranks is gone.
  for (int r = 0; r < backend_->world_size(); ++r) {
    if (r != backend_->rank() && !store.check({detail::PeerMonitor::alive_key(name_, r)})) {
      return true;
    }
  }
  return false;
}

void ReformableCommunicator::replace(std::unique_ptr<Communicator> backend, std::string name) {
  DNALLM_CHECK(backend != nullptr && backend->rank() == backend_->rank() &&
                   backend->world_size() == backend_->world_size(),
               ExitCode::kFailure,
               "communicator '{}' re-formed as '{}' with another rank or world size (a bug; "
               "please report it)",
               name_, name);
  backend_.reset();  // joins the old backend's thread first: its pending work fails there
  backend_ = std::move(backend);
  name_ = std::move(name);
}

}  // namespace dnallm::comm
