// The built-in store ops of StoreServer (coordinator/store_wire.hpp) and the waiters they wake.
#include "coordinator/store_server_impl.hpp"
#include "coordinator/store_wire.hpp"

namespace dnallm::coordinator {

void StoreServer::Impl::on_write(const std::string& key) {
  for (auto it = waiters.begin(); it != waiters.end();) {
    auto& w = **it;
    bool relevant = false;
    for (const auto& k : w.keys) relevant = relevant || k == key;
    if (relevant && detail::has_all(data, w.keys)) {
      w.done = true;
      w.timer->cancel();
      w.reply.send(Status::kOk);
      it = waiters.erase(it);
    } else {
      ++it;
    }
  }
}

// The built-in store ops (coordinator/store_wire.hpp), one named handler each.
void StoreServer::Impl::register_builtins() {
  using Method = void (Impl::*)(FrameReader&, Responder);
  const std::pair<Op, Method> table[] = {
      {Op::kPing, &Impl::on_ping},
      {Op::kSet, &Impl::on_set},
      {Op::kSetOwned, &Impl::on_set_owned},
      {Op::kGet, &Impl::on_get},
      {Op::kWait, &Impl::on_wait},
      {Op::kAdd, &Impl::on_add},
      {Op::kCompareSet, &Impl::on_compare_set},
      {Op::kDelete, &Impl::on_delete},
      {Op::kCheck, &Impl::on_check},
      {Op::kNumKeys, &Impl::on_num_keys},
  };
  for (const auto& [op, method] : table) {
    handlers[static_cast<uint8_t>(op)] = [this, method = method](FrameReader& a, Responder r) {
      (this->*method)(a, std::move(r));
    };
  }
}

void StoreServer::Impl::set_value(const std::string& key, Bytes value) {
  data[key] = std::move(value);
  owner.erase(key);
  on_write(key);
}

void StoreServer::Impl::on_ping(FrameReader& a, Responder r) {
  decode_message<NoFields>(a);
  r.send(Status::kOk);
}

void StoreServer::Impl::on_set(FrameReader& a, Responder r) {
  auto m = decode_message<KeyValueRequest>(a);
  set_value(m.key, std::move(m.value));
  r.send(Status::kOk);
}

void StoreServer::Impl::on_set_owned(FrameReader& a, Responder r) {
  auto m = decode_message<KeyValueRequest>(a);
  set_value(m.key, std::move(m.value));
  owner[m.key] = r.session_id();
  for (auto& s : sessions)
    if (s->id_ == r.session_id()) s->owned_keys_.push_back(m.key);
  r.send(Status::kOk);
}

void StoreServer::Impl::on_get(FrameReader& a, Responder r) {
  const auto m = decode_message<KeyRequest>(a);
  auto it = data.find(m.key);
  if (it == data.end())
    r.send(Status::kNotFound);
  else
    r.send(Status::kOk, encode_reply(ValueReply{it->second}));
}

void StoreServer::Impl::on_wait(FrameReader& a, Responder r) {
  auto m = decode_message<WaitRequest>(a);
  if (detail::has_all(data, m.keys)) {
    r.send(Status::kOk);
    return;
  }
  auto w = std::make_shared<Waiter>();
  w->keys = std::move(m.keys);
  w->reply = r;
  w->timer = std::make_unique<asio::steady_timer>(io);
  w->timer->expires_after(std::chrono::milliseconds(std::max<int64_t>(0, m.timeout_ms)));
  waiters.push_back(w);
  w->timer->async_wait([this, w](boost::system::error_code ec) {
    if (ec || w->done) return;
    w->done = true;
    waiters.remove(w);
    w->reply.send(Status::kTimeout);
  });
}

void StoreServer::Impl::on_add(FrameReader& a, Responder r) {
  const auto m = decode_message<AddRequest>(a);
  const int64_t v = detail::add_to_counter(data, m.key, m.delta);
  on_write(m.key);
  r.send(Status::kOk, encode_reply(CountReply{v}));
}

void StoreServer::Impl::on_compare_set(FrameReader& a, Responder r) {
  const auto m = decode_message<CompareSetRequest>(a);
  bool changed = false;
  Bytes stored = detail::compare_and_set(data, m.key, m.expected, m.desired, &changed);
  if (changed) {
    owner.erase(m.key);
    on_write(m.key);
  }
  r.send(Status::kOk, encode_reply(ValueReply{std::move(stored)}));
}

void StoreServer::Impl::on_delete(FrameReader& a, Responder r) {
  const auto m = decode_message<KeyRequest>(a);
  owner.erase(m.key);
  r.send(Status::kOk, encode_reply(FlagReply{data.erase(m.key) > 0}));
}

void StoreServer::Impl::on_check(FrameReader& a, Responder r) {
  const auto m = decode_message<KeysRequest>(a);
  r.send(Status::kOk, encode_reply(FlagReply{detail::has_all(data, m.keys)}));
}

void StoreServer::Impl::on_num_keys(FrameReader& a, Responder r) {
  decode_message<NoFields>(a);
  r.send(Status::kOk, encode_reply(CountReply{static_cast<int64_t>(data.size())}));
}

}  // namespace dnallm::coordinator
