#include "coordinator/recovery.hpp"

#include <algorithm>
#include <chrono>

#include <nlohmann/json.hpp>

#include "coordinator/store.hpp"
#include "core/config.hpp"
#include "core/enum_names.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {

std::string in_process_recovery_unsupported(const Config& config) {
  if (config.training.batch_size == cfg::BatchSize::kAuto) {
    return "training.batch_size = \"auto\": a spare cannot take part in the search the ranks "
           "made at their start; set training.micro_batch_size";
  }
  if (config.parallel.backend == cfg::Backend::kMpi) {
    return "parallel.backend = \"mpi\": MPI cannot abort a collective";
  }
  return "";
}

namespace {

// Note [Enum tables] (core/enum_names.hpp).
constexpr EnumName<RecoveryKind> kRecoveryKinds[] = {{RecoveryKind::kSpare, "spare"},
                                                     {RecoveryKind::kShrink, "shrink"},
                                                     {RecoveryKind::kGrow, "grow"}};
static_assert(lists_each_in_order<RecoveryKind::kGrow>(kRecoveryKinds));

RecoveryKind parse_recovery_kind(const std::string& text, const std::string& key) {
  if (const auto kind = value_named(kRecoveryKinds, text)) return *kind;
  fail(ExitCode::kPeerFailed,
       "the recovery record at store key {} has kind \"{}\" (spare, shrink or grow expected): "
       "the launcher and dnallm-train are of different versions",
       key, text);
}

}  // namespace

const char* recovery_kind_name(RecoveryKind kind) { return name_of(kRecoveryKinds, kind, "?"); }

std::string shrink_unsupported(const Config& config) {
  if (const auto why = in_process_recovery_unsupported(config); !why.empty()) return why;
  if (config.parallel.zero_stage > 0) {
    return fmt::format(
        "parallel.zero_stage = {}: the dead rank's shard would have to be split among the "
        "survivors, which is not done in process (spares keep ZeRO runs in process)",
        static_cast<int>(config.parallel.zero_stage));
  }
  if (config.parallel.context_parallel > 1) {
    return "parallel.context_parallel > 1: the context groups would change shape (spares keep "
           "such runs in process)";
  }
  return "";
}

std::string RecoveryRecord::to_json() const {
  nlohmann::ordered_json j;
  j["number"] = number;
  j["kind"] = recovery_kind_name(kind);
  j["rank"] = rank;
  j["local_rank"] = local_rank;
  j["host"] = host;
  j["reason"] = reason;
  j["spare_id"] = spare_id;
  j["progress_file"] = progress_file;
  j["detected_unix_ms"] = detected_unix_ms;
  return j.dump();
}

RecoveryRecord RecoveryRecord::from_json(const std::string& text, const std::string& key) {
  try {
    const auto j = nlohmann::json::parse(text);
    RecoveryRecord r;
    r.number = j.at("number").get<int64_t>();
    r.kind = parse_recovery_kind(j.value("kind", std::string("spare")), key);
    r.rank = j.at("rank").get<int>();
    r.local_rank = j.at("local_rank").get<int>();
    r.host = j.at("host").get<std::string>();
    r.reason = j.at("reason").get<std::string>();
    r.spare_id = j.at("spare_id").get<int>();
    r.progress_file = j.at("progress_file").get<std::string>();
    r.detected_unix_ms = j.at("detected_unix_ms").get<int64_t>();
    return r;
  } catch (const nlohmann::json::exception& e) {
    fail(ExitCode::kPeerFailed, "the recovery record at store key {} is unreadable: {}", key,
         e.what());
  }
}

std::string recovery_key(int64_t generation, int64_t number) {
  return "recover/g" + std::to_string(generation) + "/" + std::to_string(number);
}

std::string recovery_count_key(int64_t generation) {
  return "recover/g" + std::to_string(generation) + "/count";
}

std::string spare_key(int64_t generation, int spare_id) {
  return "recover/g" + std::to_string(generation) + "/spare/" + std::to_string(spare_id);
}

std::string spare_ready_key(int64_t generation, int spare_id) {
  return "recover/g" + std::to_string(generation) + "/ready/" + std::to_string(spare_id);
}

std::string grow_step_key(int64_t generation, int64_t number) {
  return recovery_key(generation, number) + "/at";
}

std::string recovery_comm_name(int64_t generation, int64_t number) {
  return "g" + std::to_string(generation) + ".r" + std::to_string(number);
}

int64_t latest_recovery(Store& store, int64_t generation) {
  const auto count = store.try_get(recovery_count_key(generation));
  return count ? std::stoll(to_string(*count)) : 0;
}

RecoveryRecord read_recovery(Store& store, int64_t generation, int64_t number,
                             std::chrono::milliseconds timeout) {
  const std::string key = recovery_key(generation, number);
  return RecoveryRecord::from_json(to_string(store.get(key, timeout)), key);
}

std::optional<RecoveryRecord> try_read_recovery(Store& store, int64_t generation, int64_t number) {
  const std::string key = recovery_key(generation, number);
  const auto text = store.try_get(key);
  if (!text) return std::nullopt;
  return RecoveryRecord::from_json(to_string(*text), key);
}

int Membership::rank_of(int place) const {
  const auto it = std::find(places.begin(), places.end(), place);
  return it == places.end() ? -1 : static_cast<int>(it - places.begin());
}

Membership membership_after(Store& store, int64_t generation, int initial_world, int64_t n) {
  Membership m;
  for (int r = 0; r < initial_world; ++r) m.places.push_back(r);
  for (int64_t i = 1; i <= n; ++i) {
    const auto record = read_recovery(store, generation, i);
    const auto at = std::find(m.places.begin(), m.places.end(), record.rank);
    if (record.kind == RecoveryKind::kShrink && at != m.places.end()) m.places.erase(at);
    if (record.kind == RecoveryKind::kGrow && at == m.places.end()) m.places.push_back(record.rank);
  }
  return m;
}

int64_t accum_for_world(int64_t accum, int initial_world, int world) {
  const int64_t global = accum * initial_world;
  return world > 0 && global % world == 0 ? global / world : accum;
}

int64_t announce_recovery(Store& store, int64_t generation, RecoveryRecord record) {
  record.number = store.add(recovery_count_key(generation), 1);
  store.set(recovery_key(generation, record.number), to_bytes(record.to_json()));
  store.set(spare_key(generation, record.spare_id), to_bytes(std::to_string(record.number)));
  return record.number;
}

namespace {

class UntilNextRecovery final : public Store {
 public:
  UntilNextRecovery(std::shared_ptr<Store> inner, int64_t generation, int64_t number)
      : inner_(std::move(inner)), generation_(generation), number_(number) {}

  void set(const std::string& key, const Bytes& value) override { inner_->set(key, value); }
  void set_owned(const std::string& key, const Bytes& value) override {
    inner_->set_owned(key, value);
  }
  std::optional<Bytes> try_get(const std::string& key) override { return inner_->try_get(key); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_->add(key, delta); }
  Bytes compare_and_set(const std::string& key, const Bytes& expected,
                        const Bytes& desired) override {
    return inner_->compare_and_set(key, expected, desired);
  }
  bool remove(const std::string& key) override { return inner_->remove(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t num_keys() override { return inner_->num_keys(); }

  // In slices, looking between them for a later recovery.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    constexpr std::chrono::milliseconds kSlice{100};
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      try {
        inner_->wait(keys, std::clamp(left, std::chrono::milliseconds(1), kSlice));
        return;
      } catch (const Error&) {
        if (inner_->check(keys)) return;
        if (std::chrono::steady_clock::now() >= deadline) throw;
      }
      const int64_t latest = latest_recovery(*inner_, generation_);
      if (latest > number_) {
        throw Error(ExitCode::kPeerFailed,
                    fmt::format("recovery {} of generation {} gave way to recovery {} (a rank "
                                "died while the group formed)",
                                number_, generation_, latest));
      }
    }
  }

 private:
  std::shared_ptr<Store> inner_;
  int64_t generation_, number_;
};

}  // namespace

std::shared_ptr<Store> until_next_recovery(std::shared_ptr<Store> store, int64_t generation,
                                           int64_t number) {
  return std::make_shared<UntilNextRecovery>(std::move(store), generation, number);
}

int64_t unix_ms_now() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace dnallm::coordinator
