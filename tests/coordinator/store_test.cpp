// Store semantics, run against both InMemoryStore and a real StoreServer on loopback.
#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "coordinator/store.hpp"
#include "coordinator/store_server.hpp"
#include "coordinator/tcp_store_client.hpp"
#include "core/error.hpp"

namespace dnallm::coordinator {
namespace {

using namespace std::chrono_literals;

class StoreSemantics : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) {
      server_ = std::make_unique<StoreServer>(StoreServerOptions{"127.0.0.1", 0, "tok"});
      server_->start();
      store_ = make_client();
    } else {
      store_ = std::make_shared<InMemoryStore>();
    }
  }
  std::shared_ptr<Store> make_client() {
    if (!server_) return store_;
    TcpStoreClientOptions o;
    o.port = server_->port();
    o.token = "tok";
    o.connect_timeout = 10s;
    return std::make_shared<TcpStoreClient>(o);
  }
  std::unique_ptr<StoreServer> server_;
  std::shared_ptr<Store> store_;
};

TEST_P(StoreSemantics, SetGetCheckDelete) {
  store_->set("a", to_bytes("hello"));
  EXPECT_EQ(to_string(store_->get("a", 1s)), "hello");
  EXPECT_TRUE(store_->check({"a"}));
  EXPECT_FALSE(store_->check({"a", "b"}));
  EXPECT_FALSE(store_->try_get("b").has_value());
  store_->set("empty", {});
  EXPECT_TRUE(store_->get("empty", 1s).empty());
  EXPECT_EQ(store_->num_keys(), 2);
  EXPECT_TRUE(store_->remove("a"));
  EXPECT_FALSE(store_->remove("a"));
  EXPECT_EQ(store_->num_keys(), 1);
}

TEST_P(StoreSemantics, AddIsACounter) {
  EXPECT_EQ(store_->add("c", 5), 5);
  EXPECT_EQ(store_->add("c", -2), 3);
  EXPECT_EQ(to_string(store_->get("c", 1s)), "3");
  store_->set("text", to_bytes("abc"));
  EXPECT_THROW(store_->add("text", 1), Error);
}

TEST_P(StoreSemantics, CompareAndSet) {
  EXPECT_EQ(to_string(store_->compare_and_set("k", {}, to_bytes("v1"))), "v1");
  EXPECT_EQ(to_string(store_->compare_and_set("k", to_bytes("nope"), to_bytes("v2"))), "v1");
  EXPECT_EQ(to_string(store_->compare_and_set("k", to_bytes("v1"), to_bytes("v2"))), "v2");
}

TEST_P(StoreSemantics, WaitTimesOutNamingMissingKeys) {
  store_->set("here", to_bytes("1"));
  auto t0 = std::chrono::steady_clock::now();
  try {
    store_->wait({"here", "missing_key"}, 300ms);
    FAIL() << "wait did not time out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kPeerFailed);
    EXPECT_NE(std::string(e.what()).find("missing_key"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("here,"), std::string::npos) << e.what();
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
}

TEST_P(StoreSemantics, WaitWakesWhenAnotherClientSets) {
  auto other = make_client();
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    other->set("x", to_bytes("1"));
    other->add("y", 1);
  });
  store_->wait({"x", "y"}, 10s);
  EXPECT_EQ(to_string(store_->get("y", 1s)), "1");
  setter.join();
}

TEST_P(StoreSemantics, ManyConcurrentClientsCountExactly) {
  constexpr int kClients = 16;
  constexpr int kAdds = 50;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      try {
        auto s = make_client();
        for (int i = 0; i < kAdds; ++i) s->add("counter", 1);
        s->set("done/" + std::to_string(c), to_bytes("1"));
      } catch (const std::exception&) {
        ++failures;
      }
    });
  }
  std::vector<std::string> keys;
  for (int c = 0; c < kClients; ++c) keys.push_back("done/" + std::to_string(c));
  store_->wait(keys, 20s);
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(to_string(store_->get("counter", 1s)), std::to_string(kClients * kAdds));
}

INSTANTIATE_TEST_SUITE_P(InMemoryAndTcp, StoreSemantics, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Tcp" : "InMemory"; });

}  // namespace
}  // namespace dnallm::coordinator
