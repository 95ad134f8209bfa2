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

int64_t add_to_counter(KeyValues& data, const std::string& key, int64_t delta) {
  auto it = data.find(key);
  const int64_t v = (it == data.end() ? 0 : parse_counter(it->second, key)) + delta;
  data[key] = to_bytes(std::to_string(v));
  return v;
}

Bytes compare_and_set(KeyValues& data, const std::string& key, const Bytes& expected,
                      const Bytes& desired, bool* changed) {
  auto it = data.find(key);
  *changed = (it == data.end() && expected.empty()) || (it != data.end() && it->second == expected);
  if (*changed) {
    data[key] = desired;
    return desired;
  }
  return it == data.end() ? Bytes{} : it->second;
}

std::vector<std::string> missing_keys(const KeyValues& data, const std::vector<std::string>& keys) {
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (data.count(k) == 0) missing.push_back(k);
  return missing;
}

bool has_all(const KeyValues& data, const std::vector<std::string>& keys) {
  for (const auto& k : keys)
    if (data.count(k) == 0) return false;
  return true;
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

Bytes Store::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  auto v = try_get(key);
  DNALLM_CHECK(v.has_value(), ExitCode::kPeerFailed, "store key '{}' was deleted while read", key);
  return *v;
}

void InMemoryStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

std::optional<Bytes> InMemoryStore::try_get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = data_.find(key);
  if (it == data_.end()) return std::nullopt;
  return it->second;
}

void InMemoryStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (changed_.wait_for(lock, timeout, [&] { return detail::has_all(data_, keys); })) return;
  fail(ExitCode::kPeerFailed, "timed out after {} ms waiting for store keys: {}", timeout.count(),
       detail::join_keys(detail::missing_keys(data_, keys)));
}

int64_t InMemoryStore::add(const std::string& key, int64_t delta) {
  int64_t v = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    v = detail::add_to_counter(data_, key, delta);
  }
  changed_.notify_all();
  return v;
}

Bytes InMemoryStore::compare_and_set(const std::string& key, const Bytes& expected,
                                     const Bytes& desired) {
  Bytes result;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    result = detail::compare_and_set(data_, key, expected, desired, &changed);
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
  return detail::has_all(data_, keys);
}

int64_t InMemoryStore::num_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(data_.size());
}

}  // namespace dnallm::coordinator
