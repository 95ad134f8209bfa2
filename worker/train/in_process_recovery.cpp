#include "worker/train/in_process_recovery.hpp"

#include <fstream>
#include <future>
#include <thread>

#include <unistd.h>

#include <spdlog/spdlog.h>

#include "coordinator/store.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/parallel/process_group.hpp"
#include "worker/tensor_buffer.hpp"
#include "worker/train/preemption.hpp"

namespace dnallm::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void wait_all(comm::WorkPtr work) { work->wait(); }

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

// Broadcasts `t` (contiguous, the same numel on every rank) from `root` in place, in chunks.
// `t` (contiguous, of a wire dtype) in views of at most kRecoveryChunkElements elements, so
// that no transfer needs a second copy of a large buffer.
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

// A client of the job's coordinator store (a spare's own, before it has a process group).
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

// Waits up to kWaitSlice for `key` (the server answers as soon as it is set): true when it
// exists. Short slices, so that the caller sees a stop signal or its deadline in time.
constexpr auto kWaitSlice = std::chrono::milliseconds(100);
bool wait_a_while(coordinator::Store& store, const std::string& key) {
  try {
    store.wait({key}, kWaitSlice);
    return true;
  } catch (const Error&) {
    return store.check({key});  // a timeout; a lost coordinator throws from here
  }
}

// The last step of a metrics line (not an event) in `path`; 0 when there is none.
int64_t last_logged_step(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  int64_t last = 0;
  while (std::getline(f, line)) {
    try {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("event") && j.contains("step"))
        last = std::max(last, j["step"].get<int64_t>());
    } catch (const std::exception&) {
      // a line cut short by the death of the rank that wrote it
    }
  }
  return last;
}

}  // namespace

std::optional<SparePlace> wait_for_place(const WorkerEnv& env) {
  DNALLM_CHECK(env.spare_id && env.generation && env.master_addr && env.master_port,
               ExitCode::kUsage,
               "DNALLM_SPARE_ID needs DNALLM_GENERATION, MASTER_ADDR and MASTER_PORT (a spare is "
               "started by dnallm-launch --spare-workers)");
  auto client = coordinator_client(*env.master_addr, *env.master_port, env.job_token);
  coordinator::Store& store = *client;
  const std::string key = coordinator::spare_key(*env.generation, *env.spare_id);
  // Note [Shrink and grow]: a spare started in a dead rank's stead is given its place back
  // only once it is ready.
  store.set(coordinator::spare_ready_key(*env.generation, *env.spare_id),
            coordinator::to_bytes(std::to_string(::getpid())));
  spdlog::info("spare {}: ready; waiting for a rank's place (generation {})", *env.spare_id,
               *env.generation);
  while (Preemption::signal_received() == 0) {
    if (!wait_a_while(store, key)) continue;
    if (auto v = store.try_get(key)) {
      const auto assigned = Clock::now();
      const int64_t n = std::stoll(coordinator::to_string(*v));
      const std::string record_key = coordinator::recovery_key(*env.generation, n);
      SparePlace place;
      place.record = coordinator::RecoveryRecord::from_json(
          coordinator::to_string(store.get(record_key, std::chrono::seconds(10))), record_key);
      place.assigned = assigned;
      place.initial_world = env.world_size.value_or(1);
      place.membership =
          coordinator::membership_after(store, *env.generation, place.initial_world, n);
      return place;
    }
  }
  spdlog::info("spare {}: stopped before it was needed", *env.spare_id);
  return std::nullopt;
}

namespace {

// Note [Shrink and grow]: `env` and `config` at the place's rank in `m`.
void move_to_place(const SparePlace& spare, const coordinator::Membership& m, WorkerEnv& env,
                   Config& config) {
  const int rank = m.rank_of(spare.record.rank);
  DNALLM_CHECK(rank >= 0, ExitCode::kPeerFailed,
               "recovery {} gives place {} to this spare, but the group after it has no such "
               "place (a bug; please report it)",
               spare.record.number, spare.record.rank);
  env.rank = rank;
  env.world_size = m.world();
  config.training.grad_accum_steps =
      coordinator::accum_for_world(spare.initial_accum, spare.initial_world, m.world());
}

}  // namespace

void take_place(const SparePlace& spare, std::map<std::string, std::string>& process_env,
                WorkerEnv& env, Config& config) {
  const auto& record = spare.record;
  move_to_place(spare, spare.membership, env, config);
  env.local_rank = record.local_rank;
  env.progress_file = record.progress_file;
  env.spare_id.reset();
  process_env.erase("DNALLM_SPARE_ID");
  env.to_environment(process_env);
}

namespace {

// Step 4's group for recovery `number`. Connecting can block where no store wait sees a later
// recovery (gloo retries a dead spare's published address until its timeout), so it runs on a
// thread of its own; when a later recovery is announced first, this one gives way (Error
// kPeerFailed) and leaves that thread to end on its own (its connection fails: a member died).
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

}  // namespace

comm::ProcessGroup join_as_spare(Config& config, WorkerEnv& env, cluster::Topology& topo,
                                 const parallel::RankDevice& device, SparePlace& spare) {
  coordinator::RecoveryRecord& record = spare.record;
  std::shared_ptr<coordinator::Store> store =
      coordinator_client(topo.master_addr, topo.master_port, env.job_token);
  const int64_t generation = *env.generation;
  comm::ProcessGroup group;
  group.store = store;
  while (true) {
    const std::string name = coordinator::recovery_comm_name(generation, record.number);
    try {
      group.comm = connect_recovery_group(config, env, topo, device, store, record.number);
      spdlog::info("rank {} of {} ({} backend on {}): joined {}", topo.rank, topo.world_size,
                   group.comm->backend(), device.device.str(), name);
      return group;
    } catch (const Error& e) {
      const int64_t newest = coordinator::latest_recovery(*store, generation);
      if (newest <= record.number) throw;
      spdlog::warn("spare: {} ({}); joining recovery {}", name, e.what(), newest);
      record.number = newest;
      spare.membership =
          coordinator::membership_after(*store, generation, spare.initial_world, newest);
      move_to_place(spare, spare.membership, env, config);
      topo.rank = *env.rank;
      topo.world_size = *env.world_size;
    }
  }
}

InProcessRecovery::InProcessRecovery(RecoveryOptions options) : o_(std::move(options)) {
  DNALLM_CHECK(o_.config && o_.store && o_.comm && o_.loader && o_.env.generation,
               ExitCode::kFailure,
               "in-process recovery without its group (a bug; please report it)");
  step_start_ = o_.loader->state();
  sharded_ = o_.config->parallel.zero_stage > 0;
}

void InProcessRecovery::install(TrainerOptions& options) {
  options.before_step.push_back([this](Trainer& t, int64_t) {
    step_start_ = o_.loader->state();
    marked_step_ = t.step();
    // Note [Buddy copies]: the state the run starts from is the first commit.
    if (sharded_ && committed_ < 0) commit(t);
    if (o_.comm->world_size() < o_.initial_world) maybe_grow(t);
  });
  options.recover = [this](Trainer& t) { return recover(t); };
  options.after_step.push_back(
      [this](Trainer& t, const StepResult& r) { return after_step(t, r); });
}

std::optional<coordinator::RecoveryRecord> InProcessRecovery::wait_for_record() {
  const int64_t generation = *o_.env.generation;
  const auto deadline =
      Clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(o_.config->parallel.timeout_s * 1000.0));
  while (Clock::now() < deadline && Preemption::signal_received() == 0) {
    // The newest announced recovery: after two deaths at once, the last one names every place.
    const int64_t n = coordinator::latest_recovery(*o_.store, generation);
    const std::string key = coordinator::recovery_key(generation, n);
    if (n > recoveries_ && o_.store->check({key})) {
      return coordinator::RecoveryRecord::from_json(coordinator::to_string(*o_.store->try_get(key)),
                                                    key);
    }
    wait_a_while(*o_.store, coordinator::recovery_key(generation, recoveries_ + 1));
  }
  return std::nullopt;
}

void InProcessRecovery::reform(const coordinator::RecoveryRecord& record) {
  const int64_t generation = *o_.env.generation;
  const std::string name = coordinator::recovery_comm_name(generation, record.number);
  // Note [Shrink and grow]: this place's rank in the group after the record.
  const auto m =
      coordinator::membership_after(*o_.store, generation, o_.initial_world, record.number);
  const int rank = m.rank_of(o_.place);
  DNALLM_CHECK(rank >= 0, ExitCode::kPeerFailed,
               "recovery {} of generation {} gave up this rank's place {} while it lived",
               record.number, generation, o_.place);
  resized_ = rank != o_.topo.rank || m.world() != o_.topo.world_size;
  if (resized_ && (sharded_ || o_.reform_groups)) {
    throw StateLost(
        ExitCode::kPeerFailed,
        fmt::format("in-process recovery: the group goes from {} to {} ranks, which ZeRO shards "
                    "and context groups cannot follow in process; the generation restarts from "
                    "its last checkpoint",
                    o_.topo.world_size, m.world()));
  }
  previous_rank_ = o_.topo.rank;
  o_.topo.rank = rank;
  o_.topo.world_size = m.world();
  o_.env.rank = rank;
  o_.env.world_size = m.world();
  auto backend =
      connect_recovery_group(*o_.config, o_.env, o_.topo, o_.device, o_.store, record.number);
  if (resized_) {
    o_.comm->resize(std::move(backend), name);
  } else {
    o_.comm->replace(std::move(backend), name);
  }
  if (o_.reform_groups) o_.reform_groups(*o_.comm, name);
  recoveries_ = record.number;
  reformed_at_ = Clock::now();
}

void InProcessRecovery::regroup(Trainer& t) {
  const int rank = o_.comm->rank(), world = o_.comm->world_size();
  const int64_t accum = coordinator::accum_for_world(o_.initial_accum, o_.initial_world, world);
  const int64_t micro = o_.config->training.micro_batch_size;
  if (accum * world != o_.initial_accum * o_.initial_world) {
    spdlog::warn(
        "the group now has {} ranks: no gradient accumulation keeps the global batch of {} "
        "micro-batches (it becomes {} x {} = {} sequences)",
        world, o_.initial_accum * o_.initial_world, accum * world, micro, accum * world * micro);
  }
  spdlog::warn("rank {} of {} now (was rank {}): {} micro-batch(es) a step", rank, world,
               previous_rank_, accum);
  set_log_identity(rank);
  t.regroup(accum);
  if (rank == 0 && previous_rank_ != 0) {
    // It takes over from a rank 0 that died: the lines that one wrote are not written again.
    if (!o_.config->logging.metrics_file.empty()) {
      logged_through_ =
          std::max(logged_through_, last_logged_step(o_.config->logging.metrics_file));
      t.set_logged_through(logged_through_);
    }
    if (o_.on_rank_zero) o_.on_rank_zero();
  }
}

void InProcessRecovery::maybe_grow(Trainer& t) {
  const int64_t generation = *o_.env.generation;
  const int64_t next = recoveries_ + 1;
  coordinator::Store& store = *o_.store;
  // Rank 0 picks the step (Note [Shrink and grow] step 3); one that ends the run is none.
  if (o_.comm->rank() == 0 && grow_at_ < next && t.step() + 1 < t.total_steps() &&
      coordinator::latest_recovery(store, generation) >= next) {
    const std::string key = coordinator::recovery_key(generation, next);
    if (const auto text = store.try_get(key)) {
      if (coordinator::RecoveryRecord::from_json(coordinator::to_string(*text), key).kind ==
          coordinator::RecoveryKind::kGrow) {
        store.set(coordinator::grow_step_key(generation, next),
                  coordinator::to_bytes(std::to_string(t.step() + 1)));
        grow_at_ = next;
      }
    }
  }
  const auto at = store.try_get(coordinator::grow_step_key(generation, next));
  if (!at || std::stoll(coordinator::to_string(*at)) != t.step()) return;
  const std::string key = coordinator::recovery_key(generation, next);
  const auto record = coordinator::RecoveryRecord::from_json(
      coordinator::to_string(store.get(key, std::chrono::seconds(10))), key);
  const auto announced = Clock::now();
  spdlog::info("recovery {}: {}; the group grows at step {}", record.number, record.reason,
               t.step() + 1);
  int source = 0;
  const int64_t bytes = rejoin(t, record, source);
  const auto transferred = Clock::now();
  report(t, record, source, bytes, {0.0, seconds_between(announced, transferred), 0.0},
         transferred);
}

int64_t InProcessRecovery::rejoin(Trainer& t, const coordinator::RecoveryRecord& record,
                                  int& source) {
  reform(record);
  DNALLM_CHECK(
      t.sync().abandon_step(), ExitCode::kFailure,
      "in-process recovery: the gradient engine cannot drop a step (a bug; please report it)");
  if (resized_) regroup(t);
  const int64_t bytes = exchange_state(t, /*holds_state=*/true, source);
  if (resized_) {
    // The new rank's share of the same global batches, from the step the state is at.
    o_.loader->reshard(o_.comm->rank(), o_.comm->world_size(), t.config().training.grad_accum_steps,
                       o_.loader->state(), static_cast<uint64_t>(t.step()));
  }
  return bytes;
}

torch::Tensor InProcessRecovery::state_header(Trainer& t, int64_t steps_done) const {
  auto header = torch::zeros({StateHeader::kCount}, torch::kFloat64);
  auto h = header.accessor<double, 1>();
  h[StateHeader::kStep] = double(steps_done);
  h[StateHeader::kAdamSteps] = double(t.optimizer().steps());
  h[StateHeader::kRawScale] = t.loss_scaler().raw_scale();
  h[StateHeader::kCleanSteps] = double(t.loss_scaler().clean_steps());
  h[StateHeader::kSkipped] = double(t.loss_scaler().skipped_steps());
  h[StateHeader::kBest] = t.best_value();
  h[StateHeader::kCursor] = double(cursor_after(steps_done).consumed_samples);
  h[StateHeader::kAccum] = double(t.config().training.grad_accum_steps);
  h[StateHeader::kLoss] = t.last_step().loss;
  h[StateHeader::kLr] = t.last_step().lr;
  h[StateHeader::kGradNorm] = t.last_step().grad_norm;
  return header;
}

int64_t InProcessRecovery::exchange_state(Trainer& t, bool holds_state, int& source) {
  if (sharded_) return exchange_shards(t, holds_state, source);
  comm::Communicator& comm = *o_.comm;
  const int world = comm.world_size();
  const double newest = allreduce_max(comm, holds_state ? double(t.step()) : -1.0);
  DNALLM_CHECK(newest >= 0, ExitCode::kPeerFailed,
               "in-process recovery: no rank of the re-formed group holds a state");
  // The lowest rank at the newest step.
  const bool at_newest = holds_state && double(t.step()) == newest;
  source = world - static_cast<int>(allreduce_max(comm, at_newest ? world - comm.rank() : 0));

  auto header = comm.rank() == source ? state_header(t, t.step())
                                      : torch::zeros({StateHeader::kCount}, torch::kFloat64);
  const int64_t own_step = holds_state ? t.step() : -1;
  int64_t bytes = broadcast_tensor(comm, header, source);
  {
    torch::NoGradGuard no_grad;
    bytes += broadcast_tensor(comm, t.flat().params(), source);
    bytes += broadcast_tensor(comm, t.optimizer().exp_avg(), source);
    bytes += broadcast_tensor(comm, t.optimizer().exp_avg_sq(), source);
  }
  apply_header(t, header, own_step, source);
  return bytes;
}

void InProcessRecovery::apply_header(Trainer& t, const torch::Tensor& header, int64_t own_step,
                                     int source) {
  comm::Communicator& comm = *o_.comm;
  const auto h = header.accessor<double, 1>();
  DNALLM_CHECK(h[StateHeader::kAccum] == double(t.config().training.grad_accum_steps),
               ExitCode::kFailure,
               "in-process recovery: rank {} accumulates {} micro-batches a step, the source rank "
               "{} {} (training.keep_global_batch resolved otherwise); restart the job",
               comm.rank(), t.config().training.grad_accum_steps, source, h[StateHeader::kAccum]);
  const auto step = static_cast<int64_t>(h[StateHeader::kStep]);
  // Note [Buddy copies]: a rank 0 that goes back to an earlier step does not log the steps it
  // logged again (they are run again bit for bit).
  if (comm.rank() == 0 && own_step > step) {
    logged_through_ = std::max(logged_through_, own_step);
    t.set_logged_through(logged_through_);
  }
  t.set_step(step);
  t.optimizer().set_steps(static_cast<int64_t>(h[StateHeader::kAdamSteps]));
  t.loss_scaler().restore(h[StateHeader::kRawScale],
                          static_cast<int64_t>(h[StateHeader::kCleanSteps]),
                          static_cast<int64_t>(h[StateHeader::kSkipped]));
  t.set_best_value(h[StateHeader::kBest]);
  t.reload_host_params();
  data::SamplerState cursor = o_.loader->state();
  cursor.consumed_samples = static_cast<uint64_t>(h[StateHeader::kCursor]);
  o_.loader->reset(cursor, static_cast<uint64_t>(step));
  step_start_ = cursor;
  marked_step_ = step;
  // The source completed a step this rank did not: when this is rank 0, nobody logged it (a
  // rank 0 that died logged at most what the file holds: set_logged_through filters that).
  if (comm.rank() == 0 && step > own_step && step > 0 && t.logs_step(step)) {
    nlohmann::ordered_json line;
    line["step"] = step;
    line["loss"] = h[StateHeader::kLoss];
    line["lr"] = h[StateHeader::kLr];
    line["grad_norm"] = h[StateHeader::kGradNorm];
    line["recovered_from_rank"] = source;
    t.write_metrics(line);
  }
}

namespace {

// Note [Buddy copies]: the tags of a commit's two messages, and of a spare's shard.
constexpr int kHeaderTag = 41001, kShardTag = 41002, kSpareTag = 41003;

// This rank's shard of the optimizer's range: [parameters | exp_avg | exp_avg_sq].
struct ShardViews {
  torch::Tensor params, exp_avg, exp_avg_sq;
  int64_t numel() const { return params.numel(); }
};
ShardViews shard_views(Trainer& t) {
  auto& opt = t.optimizer();
  return {t.flat().params().slice(0, opt.begin(), opt.end()), opt.exp_avg(), opt.exp_avg_sq()};
}

void pack(const ShardViews& v, torch::Tensor& data) {
  const int64_t n = v.numel();
  if (!data.defined() || data.numel() != 3 * n) data = torch::empty({3 * n}, torch::kFloat32);
  data.slice(0, 0, n).copy_(v.params);
  data.slice(0, n, 2 * n).copy_(v.exp_avg);
  data.slice(0, 2 * n, 3 * n).copy_(v.exp_avg_sq);
}

void unpack(const torch::Tensor& data, const ShardViews& v) {
  const int64_t n = v.numel();
  DNALLM_CHECK(data.numel() == 3 * n, ExitCode::kFailure,
               "in-process recovery: a shard copy of {} elements for a shard of {} (a bug; please "
               "report it)",
               data.numel(), n);
  v.params.copy_(data.slice(0, 0, n));
  v.exp_avg.copy_(data.slice(0, n, 2 * n));
  v.exp_avg_sq.copy_(data.slice(0, 2 * n, 3 * n));
}

// Sends or receives `t` (fp32 or fp64, contiguous) in chunks; the works, to wait for together.
void transfer(comm::Communicator& comm, const torch::Tensor& t, int peer, int tag, bool send,
              std::vector<comm::WorkPtr>& works) {
  for_each_chunk(t, [&](BufferView view) {
    works.push_back(send ? comm.send(view, peer, tag) : comm.recv(view, peer, tag));
  });
}

void wait_each(std::vector<comm::WorkPtr>& works) {
  for (auto& w : works) w->wait();
  works.clear();
}

// Every rank's numel, gathered.
std::vector<int64_t> gather_counts(comm::Communicator& comm, int64_t own) {
  auto mine = torch::full({1}, own, torch::kInt64);
  auto all = torch::zeros({comm.world_size()}, torch::kInt64);
  wait_all(comm.allgather(buffer_view(mine, 0, 1, DType::kInt64),
                          buffer_view(all, 0, all.numel(), DType::kInt64)));
  return {all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel()};
}

}  // namespace

void InProcessRecovery::commit(Trainer& t) {
  comm::Communicator& comm = *o_.comm;
  const int world = comm.world_size(), rank = comm.rank();
  const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  const int64_t step = t.step();
  const int slot = static_cast<int>(step % 2);
  torch::NoGradGuard no_grad;
  const ShardViews views = shard_views(t);
  StateCopy& own = own_[slot];
  StateCopy& buddy = buddy_[slot];
  own.step = -1;
  own.header = state_header(t, step);
  pack(views, own.data);
  own.step = step;
  buddy.step = -1;
  if (!buddy.header.defined()) buddy.header = torch::zeros({StateHeader::kCount}, torch::kFloat64);
  if (prev_numel_ < 0) prev_numel_ = gather_counts(comm, views.numel())[prev];
  if (!buddy.data.defined() || buddy.data.numel() != 3 * prev_numel_) {
    buddy.data = torch::empty({3 * prev_numel_}, torch::kFloat32);
  }
  std::vector<comm::WorkPtr> works;
  transfer(comm, buddy.header, prev, kHeaderTag, /*send=*/false, works);
  transfer(comm, buddy.data, prev, kShardTag, /*send=*/false, works);
  transfer(comm, own.header, next, kHeaderTag, /*send=*/true, works);
  transfer(comm, own.data, next, kShardTag, /*send=*/true, works);
  wait_each(works);
  buddy.step = step;
  // Past this barrier every rank holds its own copy of `step` and its predecessor's.
  wait_all(comm.barrier());
  committed_ = step;
}

int64_t InProcessRecovery::exchange_shards(Trainer& t, bool holds_state, int& source) {
  comm::Communicator& comm = *o_.comm;
  const int world = comm.world_size(), rank = comm.rank();
  torch::NoGradGuard no_grad;
  const ShardViews views = shard_views(t);
  const auto counts = gather_counts(comm, views.numel());
  prev_numel_ = counts[(rank + world - 1) % world];
  const int64_t committed =
      static_cast<int64_t>(allreduce_max(comm, holds_state ? committed_ : -1));
  if (committed < 0) {
    throw StateLost(ExitCode::kPeerFailed,
                    "in-process recovery: no rank of the re-formed group holds a committed state; "
                    "the generation restarts from its last checkpoint");
  }
  // Who holds what, for the committed step S and the one after: [holds a state, has its own
  // copy of S, has its predecessor's copy of S, the same two of S + 1].
  const auto has = [](const StateCopy(&copies)[2], int64_t step) {
    return copies[step % 2].step == step ? 1.0 : 0.0;
  };
  auto mine = torch::tensor({holds_state ? 1.0 : 0.0, has(own_, committed), has(buddy_, committed),
                             has(own_, committed + 1), has(buddy_, committed + 1)},
                            torch::kFloat64);
  constexpr int kFields = 5;
  auto table = torch::zeros({kFields * world}, torch::kFloat64);
  wait_all(comm.allgather(buffer_view(mine, 0, kFields, DType::kFloat64),
                          buffer_view(table, 0, table.numel(), DType::kFloat64)));
  const auto at = [&](int r, int k) { return table[kFields * r + k].item<double>() != 0.0; };
  // S + 1 when every shard's copy of it survived: a failure after the last step's exchange
  // (during its barrier) then costs no step at all.
  bool next_held = true;
  for (int r = 0; r < world; ++r) {
    const int buddy = (r + 1) % world;
    next_held = next_held && (at(r, 0) ? at(r, 3) : at(buddy, 0) && at(buddy, 4));
  }
  const int64_t target = next_held ? committed + 1 : committed;
  const int own_field = next_held ? 3 : 1, buddy_field = next_held ? 4 : 2;
  const int slot = static_cast<int>(target % 2);
  source = -1;
  for (int r = 0; r < world; ++r) {
    const int buddy = (r + 1) % world;
    if (at(r, 0)) {
      DNALLM_CHECK(at(r, own_field), ExitCode::kFailure,
                   "in-process recovery: rank {} holds no copy of its shard at step {} (a bug; "
                   "please report it)",
                   r, target);
      if (source < 0) source = r;
    } else {
      if (!at(buddy, 0) || !at(buddy, buddy_field)) {
        throw StateLost(
            ExitCode::kPeerFailed,
            fmt::format("in-process recovery: rank {}'s shard of step {} was held only by rank {} "
                        "(its buddy), which {}; the generation restarts from its last checkpoint",
                        r, target, buddy, at(buddy, 0) ? "has no copy of it" : "failed too"));
      }
    }
  }
  // Every place given to a spare gets its shard from its buddy, the rank after it.
  int64_t bytes = 0;
  torch::Tensor received;
  std::vector<comm::WorkPtr> works;
  for (int r = 0; r < world; ++r) {
    if (at(r, 0)) continue;
    const int buddy = (r + 1) % world;
    if (rank == buddy) {
      transfer(comm, buddy_[slot].data, r, kSpareTag, /*send=*/true, works);
    } else if (rank == r) {
      received = torch::empty({3 * views.numel()}, torch::kFloat32);
      transfer(comm, received, buddy, kSpareTag, /*send=*/false, works);
    }
    bytes += 3 * counts[r] * int64_t{4};
  }
  wait_each(works);
  unpack(holds_state ? own_[slot].data : received, views);
  auto header = rank == source ? own_[slot].header.clone()
                               : torch::zeros({StateHeader::kCount}, torch::kFloat64);
  bytes += broadcast_tensor(comm, header, source);
  const int64_t own_step = holds_state ? t.step() : -1;
  apply_header(t, header, own_step, source);
  // ZeRO-1/2: every rank's parameters whole again, from the shards.
  t.sync().after_optimizer_step(t.flat());
  // The copies of `target` again, the spares' included (a second failure finds them).
  commit(t);
  return bytes;
}

data::SamplerState InProcessRecovery::cursor_after(int64_t steps_done) const {
  // The step's batches were all taken before its first collective (Trainer::train_step), and
  // none after it: a rank whose failure came after its step (in the evaluation or a hook) has
  // the loader exactly past that step.
  if (steps_done == marked_step_) return step_start_;
  DNALLM_CHECK(steps_done == marked_step_ + 1, ExitCode::kFailure,
               "in-process recovery: step {} done, but the loader was marked at step {} (a bug; "
               "please report it)",
               steps_done, marked_step_);
  return o_.loader->state();
}

bool InProcessRecovery::recover(Trainer& t) {
  const auto failed_at = Clock::now();
  bool comm_failed = false;
  try {
    comm_failed = o_.comm->backend_failed(*o_.store);
  } catch (const std::exception& e) {
    spdlog::error("in-process recovery: the coordinator cannot be reached ({})", e.what());
  }
  if (!comm_failed) return false;  // not a peer's failure: the step's own error stands
  if (t.sync_free()) {
    spdlog::error(
        "in-process recovery: sync-free steps update before their last collective, so "
        "the state of the broken step is unknown; the generation restarts");
    return false;
  }
  spdlog::warn(
      "step {} broke off: a peer failed; waiting for a spare to take its place (or, with "
      "elastic.shrink, for the group to go on without it)",
      t.step() + 1);
  if (o_.abandon_saves) o_.abandon_saves();
  // Closing this rank's connections fails at once the collectives that other survivors still
  // wait in with it (one in another group's operation, or in an earlier one, would otherwise
  // wait for its timeout while this rank waits for it in the new group).
  o_.comm->abort();
  if (o_.abort_groups) o_.abort_groups();
  // A rank that dies while the group re-forms breaks the new communicator too: its agent
  // announces another recovery, which this loop then joins.
  for (int attempt = 1;; ++attempt) {
    const auto record = wait_for_record();
    if (!record) {
      spdlog::error("in-process recovery: no spare took the failed rank's place{}",
                    Preemption::signal_received() != 0 ? " (stopped)" : " in parallel.timeout_s");
      return false;
    }
    const auto announced = Clock::now();
    try {
      int source = 0;
      const int64_t bytes = rejoin(t, *record, source);
      const auto reformed = reformed_at_;
      const auto transferred = Clock::now();
      spdlog::warn(
          "recovery {}: {}; re-formed in {:.3f} s, state of step {} from rank {} ({} bytes) in "
          "{:.3f} s",
          record->number, record->reason, seconds_between(announced, reformed), t.step(), source,
          bytes, seconds_between(reformed, transferred));
      report(t, *record, source, bytes,
             {seconds_between(failed_at, announced), seconds_between(announced, reformed),
              seconds_between(reformed, transferred)},
             transferred);
      return true;
    } catch (const StateLost& e) {
      spdlog::error("{}", e.what());
      return false;
    } catch (const std::exception& e) {
      if (attempt >= kRecoveryAttempts) throw;
      spdlog::warn("recovery {} broke off too ({}); waiting for the next", record->number,
                   e.what());
    }
  }
}

void InProcessRecovery::join(Trainer& t, const coordinator::RecoveryRecord& record,
                             Clock::time_point assigned) {
  // The spare's own process group already is the group the survivors build for this record
  // (join_process_group named it so): only the number is recorded here.
  recoveries_ = record.number;
  if (o_.comm->rank() == 0 && !o_.config->logging.metrics_file.empty()) {
    logged_through_ = last_logged_step(o_.config->logging.metrics_file);
    t.set_logged_through(logged_through_);
  }
  int source = 0;
  const int64_t bytes = exchange_state(t, /*holds_state=*/false, source);
  const auto transferred = Clock::now();
  spdlog::warn(
      "spare: took place {} as rank {} of {} ({}) at step {}: state from rank {} ({} bytes) in "
      "{:.3f} s",
      record.rank, o_.comm->rank(), o_.comm->world_size(), record.reason, t.step(), source, bytes,
      seconds_between(assigned, transferred));
  // Joined and received together: the whole of it counts as re-forming.
  report(t, record, source, bytes, {0.0, seconds_between(assigned, transferred), 0.0}, transferred);
}

void InProcessRecovery::report(const Trainer& t, const coordinator::RecoveryRecord& record,
                               int source, int64_t bytes, const Phases& phases,
                               Clock::time_point resumed) {
  if (o_.comm->rank() != 0) return;
  nlohmann::ordered_json e;
  e["event"] = "restart";
  e["kind"] = coordinator::recovery_kind_name(record.kind);
  e["generation"] = *o_.env.generation;
  e["recovery"] = record.number;
  e["dead_rank"] = record.rank;
  e["dead_host"] = record.host;
  e["reason"] = record.reason;
  e["step"] = t.step() + 1;
  e["steps_lost"] = 0;
  e["world_size"] = o_.comm->world_size();
  e["grad_accum_steps"] = t.config().training.grad_accum_steps;
  e["source_rank"] = source;
  e["bytes"] = bytes;
  e["abort_s"] = phases.abort_s;
  e["reform_s"] = phases.reform_s;
  e["transfer_s"] = phases.transfer_s;
  pending_ = Pending{std::move(e), resumed, record.detected_unix_ms};
}

StepAction InProcessRecovery::after_step(Trainer& t, const StepResult& r) {
  if (sharded_) commit(t);
  if (!pending_) return StepAction::kContinue;
  pending_->event["first_step_s"] = seconds_between(pending_->resumed, Clock::now());
  pending_->event["total_s"] =
      double(coordinator::unix_ms_now() - pending_->detected_unix_ms) / 1000.0;
  pending_->event["step"] = r.step;
  t.write_metrics(pending_->event);
  pending_.reset();
  return StepAction::kContinue;
}

}  // namespace dnallm::train
