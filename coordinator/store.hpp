// The key-value store that bootstraps collectives (gloo/NCCL addresses, arrival and
// liveness keys) and that the elastic rendezvous builds on.
//
// Two implementations: InMemoryStore (this header; for unit tests of our own logic and
// single-process runs) and TcpStoreClient (tcp_store_client.hpp; talks to StoreServer).
//
// Contracts shared by every implementation:
//  - Thread-safe: any thread may call any method; calls are serialised per object.
//  - Blocking calls (`get`, `wait`) take a timeout and throw
//    Error(ExitCode::kPeerFailed) naming the missing keys when it expires.
//  - Values are opaque bytes. `add` stores its counter as decimal text, so `get` of a
//    counter key returns e.g. "3".
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dnallm::coordinator {

using Bytes = std::vector<uint8_t>;

inline Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds(300)};

  virtual ~Store() = default;

  // Sets `key` to `value`, waking anyone waiting on it.
  virtual void set(const std::string& key, const Bytes& value) = 0;

  // Sets `key` for as long as this client's session lives: the server deletes it when the
  // connection closes (a process that dies loses its keys). TcpStoreClient re-sets owned
  // keys after a reconnect. Used for liveness ("comm/<name>/alive/<rank>").
  // InMemoryStore treats it as `set` (there is no session).
  virtual void set_owned(const std::string& key, const Bytes& value) = 0;

  // Waits until `key` exists (up to `timeout`) and returns its value: wait() then try_get()
  // (a key deleted in between throws Error(kPeerFailed)). Implementations may override it.
  virtual Bytes get(const std::string& key, std::chrono::milliseconds timeout);

  // Returns the value if `key` exists now, without waiting.
  virtual std::optional<Bytes> try_get(const std::string& key) = 0;

  // Waits until every key exists; throws Error(kPeerFailed) listing the missing ones.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;

  // Atomically adds `delta` to the integer counter at `key` (missing = 0); returns the
  // new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;

  // Atomically: if `key` holds `expected` (or is missing and `expected` is empty), set it
  // to `desired`. Returns the value stored afterwards (== desired on success).
  virtual Bytes compare_and_set(const std::string& key, const Bytes& expected,
                                const Bytes& desired) = 0;

  // Deletes `key`; returns whether it existed.
  virtual bool remove(const std::string& key) = 0;

  // Whether every key exists now.
  virtual bool check(const std::vector<std::string>& keys) = 0;

  virtual int64_t num_keys() = 0;
};

// A process-local Store. Thread-safe; waiters block on a condition variable.
class InMemoryStore final : public Store {
 public:
  void set(const std::string& key, const Bytes& value) override;
  void set_owned(const std::string& key, const Bytes& value) override { set(key, value); }
  std::optional<Bytes> try_get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_and_set(const std::string& key, const Bytes& expected,
                        const Bytes& desired) override;
  bool remove(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t num_keys() override;

 private:
  std::mutex mutex_;
  std::condition_variable changed_;    // notified on every write
  std::map<std::string, Bytes> data_;  // guarded by mutex_
};

// Shared semantics of `add`, `compare_and_set`, `check` and `wait`, used by InMemoryStore
// and StoreServer (each holds its keys in such a map).
namespace detail {
using KeyValues = std::map<std::string, Bytes>;
// Parses a counter value ("" or missing = 0); throws Error(kBadData) if not an integer.
int64_t parse_counter(const Bytes& value, const std::string& key);
// `add`: stores and returns the counter at `key` plus `delta`.
int64_t add_to_counter(KeyValues& data, const std::string& key, int64_t delta);
// `compare_and_set`: returns the value stored afterwards; `*changed` says whether it set.
Bytes compare_and_set(KeyValues& data, const std::string& key, const Bytes& expected,
                      const Bytes& desired, bool* changed);
// The keys of `keys` that `data` lacks, in order.
std::vector<std::string> missing_keys(const KeyValues& data, const std::vector<std::string>& keys);
bool has_all(const KeyValues& data, const std::vector<std::string>& keys);
std::string join_keys(const std::vector<std::string>& keys);
}  // namespace detail

}  // namespace dnallm::coordinator
