// Note [In-process recovery] (the whole protocol is in worker/train/in_process_recovery.hpp):
// what the agent that saw a rank die tells the workers of the job, through the coordinator's
// key-value store. Torch-free: the launcher writes these keys, dnallm-train reads them.
//
// Keys of generation G (every one deleted with the generation's comm/ keys' neighbours when
// the job ends; a recovery never outlives its generation):
//   recover/g<G>/<n>          the n-th recovery of the generation (n = 1, 2, ...), a JSON
//                             RecoveryRecord: which rank died and which spare takes its place;
//                             written once, after which every rank may read it;
//   recover/g<G>/count        the number of recoveries announced so far (Store::add);
//   recover/g<G>/spare/<id>   spare <id> of the agent whose rank died: the recovery number it
//                             joins (a decimal integer), written with the record;
//   recover/g<G>/ready/<id>   spare <id> waits, warm (written by the spare; Note [Shrink and
//                             grow]: the agent gives a returning spare its place only then);
//   recover/g<G>/<n>/at       a grow's step (rank 0 writes it, Note [Shrink and grow]).
// The re-formed communicator of recovery n is named recovery_comm_name(G, n) = "g<G>.r<n>".
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dnallm {
struct Config;
}

namespace dnallm::coordinator {

class Store;

// "" when a run of `config` can recover in process; else why not (one line). dnallm-launch
// refuses --spare-workers for such a run; dnallm-train checks again. Sync-free steps are known
// only to the worker (its device), which refuses them itself.
std::string in_process_recovery_unsupported(const Config& config);

// Note [Shrink and grow] (worker/train/in_process_recovery.hpp): what a recovery does to the
// group. kSpare: a spare takes the dead place; kShrink: no spare was left, the survivors go on
// without it (elastic.shrink); kGrow: nobody died, a spare returns to a place a shrink gave up
// and the group takes it back at a step boundary.
enum class RecoveryKind { kSpare, kShrink, kGrow };
const char* recovery_kind_name(RecoveryKind kind);

// "" when a run of `config` can go on with fewer ranks (elastic.shrink); else why not.
std::string shrink_unsupported(const Config& config);

struct RecoveryRecord {
  int64_t number = 0;  // n: 1 for the generation's first recovery
  RecoveryKind kind = RecoveryKind::kSpare;
  // The place: the rank its process was started as in this generation (its slot). Without a
  // shrink before it, also its rank now; else see Membership.
  int rank = 0;
  int local_rank = 0;            // its local rank on the agent's node
  std::string host;              // where it ran
  std::string reason;            // "rank 1 was killed by signal 9 (SIGKILL)"
  int spare_id = 0;              // the spare (DNALLM_SPARE_ID) that takes the place; -1: shrink
  std::string progress_file;     // the dead rank's DNALLM_PROGRESS_FILE, which the spare writes
  int64_t detected_unix_ms = 0;  // when the agent saw the death (wall clock, ms since 1970)

  std::string to_json() const;
  // Throws Error(kPeerFailed) naming `key` when `text` is not a record.
  static RecoveryRecord from_json(const std::string& text, const std::string& key);
};

std::string recovery_key(int64_t generation, int64_t number);
std::string recovery_count_key(int64_t generation);
std::string spare_key(int64_t generation, int spare_id);
std::string spare_ready_key(int64_t generation, int spare_id);
std::string grow_step_key(int64_t generation, int64_t number);
std::string recovery_comm_name(int64_t generation, int64_t number);

// The record of recovery `number` of `generation`, waiting up to `timeout` for it (the count is
// raised before the record is written: a reader may be a moment early). Throws Error(kPeerFailed)
// when it does not come or is unreadable.
RecoveryRecord read_recovery(Store& store, int64_t generation, int64_t number,
                             std::chrono::milliseconds timeout = std::chrono::seconds(30));
// The same without waiting: nullopt while the record is not written.
std::optional<RecoveryRecord> try_read_recovery(Store& store, int64_t generation, int64_t number);

// The number of the newest recovery announced in `generation` (0: none).
int64_t latest_recovery(Store& store, int64_t generation);

// Note [Shrink and grow]: the places of a generation of `initial_world` ranks after its
// recoveries 1..n, in rank order: a shrink drops its place, a grow appends its place, a spare
// keeps the place where it was. A process's rank is the index of its place.
struct Membership {
  std::vector<int> places;
  int world() const { return static_cast<int>(places.size()); }
  // -1 when `place` is not in the group.
  int rank_of(int place) const;
};
Membership membership_after(Store& store, int64_t generation, int initial_world, int64_t n);

// Note [Shrink and grow]: the gradient accumulation that keeps the global batch of
// `accum` x `initial_world` at `world` ranks (micro-batch unchanged); `accum` itself when no
// whole number does (the global batch then changes, as a resume at another world size says).
int64_t accum_for_world(int64_t accum, int initial_world, int world);

// The agent's side: numbers the record (Store::add on the count), writes it and the spare's
// key. Returns the record's number.
int64_t announce_recovery(Store& store, int64_t generation, RecoveryRecord record);

// `store` for the group re-formed for recovery `number` of `generation`: its waits end with
// Error(kPeerFailed) as soon as a later recovery is announced (a rank died while the group
// formed: a spare killed as it joined never posts its address), instead of at their timeout.
std::shared_ptr<Store> until_next_recovery(std::shared_ptr<Store> store, int64_t generation,
                                           int64_t number);

// Milliseconds since 1970 by the wall clock (the phases of a recovery are measured across
// processes, which share no steady clock).
int64_t unix_ms_now();

}  // namespace dnallm::coordinator
