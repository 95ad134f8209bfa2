#include "coordinator/store.hpp"

#include <cstdlib>

#include "core/error.hpp"

namespace dnallm::coordinator {

namespace detail {

int64_t parse_counter(const Bytes& value, const std::string& key) {
  if (value.empty()) return 0;
  std::string text(value.begin(), value.end());
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  DNALLM_CHECK(errno == 0 && end == text.c_str() + text.size(), ExitCode::kBadData,
               "store key '{}' holds '{}', not an integer counter; use a fresh key for add()", key,
               text);
  return v;
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    if (!out.empty()) out += ", ";
    out += k;
  }
  return out;
}

}  // namespace detail

void InMemoryStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

Bytes InMemoryStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = data_.find(key);
  DNALLM_CHECK(it != data_.end(), ExitCode::kPeerFailed, "store key '{}' was deleted", key);
  return it->second;
}

std::optional<Bytes> InMemoryStore::try_get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = data_.find(key);
  if (it == data_.end()) return std::nullopt;
  return it->second;
}

void InMemoryStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto all_present = [&] {
    for (const auto& k : keys)
      if (data_.count(k) == 0) return false;
    return true;
  };
  if (changed_.wait_for(lock, timeout, all_present)) return;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (data_.count(k) == 0) missing.push_back(k);
  fail(ExitCode::kPeerFailed, "timed out after {} ms waiting for store keys: {}", timeout.count(),
       detail::join_keys(missing));
}

int64_t InMemoryStore::add(const std::string& key, int64_t delta) {
  int64_t v = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = data_[key];
    v = detail::parse_counter(slot, key) + delta;
    slot = to_bytes(std::to_string(v));
  }
  changed_.notify_all();
  return v;
}

Bytes InMemoryStore::compare_and_set(const std::string& key, const Bytes& expected,
                                     const Bytes& desired) {
  Bytes result;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = data_.find(key);
    if ((it == data_.end() && expected.empty()) || (it != data_.end() && it->second == expected)) {
      data_[key] = desired;
      result = desired;
    } else {
      result = it == data_.end() ? Bytes{} : it->second;
    }
  }
  changed_.notify_all();
  return result;
}

bool InMemoryStore::remove(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.erase(key) > 0;
}

bool InMemoryStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& k : keys)
    if (data_.count(k) == 0) return false;
  return true;
}

int64_t InMemoryStore::num_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(data_.size());
}

}  // namespace dnallm::coordinator
