#include "worker/train/recovery_detail.hpp"

#include <fstream>
#include <future>
#include <thread>

#include <nlohmann/json.hpp>

#include "coordinator/recovery.hpp"
#include "coordinator/store.hpp"
#include "worker/parallel/process_group.hpp"
#include "worker/train/in_process_recovery.hpp"

namespace dnallm::train::recovery_detail {

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void for_each_chunk(const torch::Tensor& t, const std::function<void(BufferView)>& fn) {
  if (!t.defined() || t.numel() == 0) return;
  const auto dtype = dtype_of(t.scalar_type());
  DNALLM_CHECK(dtype.has_value() && t.is_contiguous(), ExitCode::kFailure,
               "in-process recovery cannot send a {} tensor (a bug; please report it)",
               std::string(c10::toString(t.scalar_type())));
  for (int64_t begin = 0; begin < t.numel(); begin += kRecoveryChunkElements) {
    fn(buffer_view(t, begin, std::min(kRecoveryChunkElements, t.numel() - begin), *dtype));
  }
}

int64_t broadcast_tensor(comm::Communicator& comm, const torch::Tensor& t, int root) {
  for_each_chunk(t, [&](BufferView view) { wait_all(comm.broadcast(view, root)); });
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

std::shared_ptr<coordinator::TcpStoreClient> coordinator_client(const std::string& host, int port,
                                                                const std::string& token) {
  coordinator::TcpStoreClientOptions co;
  co.host = host;
  co.port = static_cast<uint16_t>(port);
  co.token = token;
  return std::make_shared<coordinator::TcpStoreClient>(co);
}

double allreduce_max(comm::Communicator& comm, double value) {
  auto t = torch::full({1}, value, torch::kFloat64);
  wait_all(comm.allreduce(buffer_view(t, 0, 1, DType::kFloat64), comm::ReduceOp::kMax));
  return t.item<double>();
}

bool wait_a_while(coordinator::Store& store, const std::string& key) {
  try {
    store.wait({key}, kWaitSlice);
    return true;
  } catch (const Error&) {
    return store.check({key});  // a timeout; a lost coordinator throws from here
  }
}

std::map<std::string, int64_t> last_logged_steps(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::map<std::string, int64_t> last;
  while (std::getline(f, line)) {
    try {
      const auto j = nlohmann::json::parse(line);
      const std::string kind = j.value("event", "");
      if (kind != "restart" && j.contains("step") && j["step"].is_number_integer()) {
        last[kind] = std::max(last[kind], j["step"].get<int64_t>());
      }
    } catch (const std::exception&) {
      // a line cut short by the death of the rank that wrote it
    }
  }
  return last;
}

std::unique_ptr<comm::Communicator> connect_recovery_group(
    const Config& config, const WorkerEnv& env, const cluster::Topology& topo,
    const parallel::RankDevice& device, const std::shared_ptr<coordinator::Store>& store,
    int64_t number) {
  const int64_t generation = *env.generation;
  const std::string name = coordinator::recovery_comm_name(generation, number);
  auto result = std::make_shared<std::promise<std::unique_ptr<comm::Communicator>>>();
  auto connected = result->get_future();
  std::thread([config, env, topo, device, name, result,
               watched = coordinator::until_next_recovery(store, generation, number)] {
    try {
      result->set_value(parallel::rejoin_process_group(config, env, topo, device, watched, name));
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }).detach();
  while (connected.wait_for(kWaitSlice) != std::future_status::ready) {
    const int64_t newest = coordinator::latest_recovery(*store, generation);
    if (newest > number) {
      throw Error(ExitCode::kPeerFailed,
                  fmt::format("recovery {} of generation {} gave way to recovery {} (a rank died "
                              "while the group connected)",
                              number, generation, newest));
    }
  }
  return connected.get();
}

}  // namespace dnallm::train::recovery_detail
