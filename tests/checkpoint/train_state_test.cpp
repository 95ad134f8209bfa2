#include "checkpoint/train_state.hpp"

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace dnallm::checkpoint {
namespace {

using nlohmann::json;

// A manifest written by dnallm-train 0.1.0 (a one-layer BERT, one rank, step 2), before the
// state was typed: its state must parse and round-trip byte for byte.
json golden_manifest() {
  std::ifstream in(std::string(DNALLM_SOURCE_DIR) + "/tests/checkpoint/data/manifest_0.1.0.json");
  EXPECT_TRUE(in.good()) << "golden manifest missing";
  return json::parse(in);
}

const std::string kWhere = "/ckpt/step_000000002/manifest.json";

// Runs `f`, expects Error(kCheckpointCorrupt), returns its message.
template <class F>
std::string corrupt_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kCheckpointCorrupt) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(CheckpointTrainStateTest, StateWrittenByTodaysTrainerRoundTrips) {
  const json state = golden_manifest().at("state");
  const auto s = TrainState::from_json(state, kWhere);
  EXPECT_EQ(s.to_json(), state);
  EXPECT_EQ(s.to_json().dump(1), state.dump(1));  // same numbers' types: 65536.0 stays a float
  EXPECT_EQ(s.step, 2);
  EXPECT_EQ(s.adam_steps, 2);
  EXPECT_EQ(s.loss_scaler.scale, 65536.0);
  ASSERT_TRUE(s.rng.has_value());
  EXPECT_EQ(s.rng->seed, 7u);
  EXPECT_EQ(s.rng->scheme, "splitmix64(seed,step,micro_step,rank)");
  EXPECT_EQ(s.config_hash, "11b0d9f3b6e1f48f");
  EXPECT_EQ(s.version, "0.1.0");
  EXPECT_EQ(s.world_size, 1);
  EXPECT_EQ(s.micro_batch_size, 2);
  EXPECT_EQ(s.grad_accum_steps, 1);
  EXPECT_EQ(s.zero_stage, 0);
  ASSERT_EQ(s.layout.size(), 25u);
  EXPECT_EQ(s.layout[3],
            (LayoutEntry{"bert.encoder.layer.0.attention.self.query.bias", 928, {16}}));
  ASSERT_TRUE(s.sampler.has_value());
  EXPECT_EQ(s.sampler->at("consumed_samples"), 4);
  ASSERT_TRUE(s.config.has_value());
  EXPECT_EQ(s.config->at("model_type"), state.at("config").at("model_type"));

  const auto m = ModelInfo::from_json(state, kWhere);
  EXPECT_EQ(m.config_hash, s.config_hash);
  EXPECT_EQ(m.tokenizer, s.tokenizer);
  EXPECT_EQ(m.config, s.config);
  EXPECT_EQ(m.layout, s.layout);
}

TEST(CheckpointTrainStateTest, OptionalKeysOfOlderCheckpointsStayAbsent) {
  json state = golden_manifest().at("state");
  for (const char* key : {"sampler", "rng", "micro_batch_size", "grad_accum_steps", "config"}) {
    state.erase(key);
  }
  const auto s = TrainState::from_json(state, kWhere);
  EXPECT_FALSE(s.sampler || s.rng || s.micro_batch_size || s.grad_accum_steps || s.config);
  EXPECT_EQ(s.to_json(), state);  // nothing invented on the way back
}

TEST(CheckpointTrainStateTest, BuiltStateRoundTrips) {
  TrainState s;
  s.step = 12;
  s.adam_steps = 11;
  s.loss_scaler = {1024.5, 3, 1};
  s.rng = RngState{"scheme", ~uint64_t{0}};  // a negative seed cast to unsigned
  s.config_hash = "00ff";
  s.tokenizer = nullptr;  // no tokenizer given
  s.version = "9.9";
  s.world_size = 4;
  s.zero_stage = 2;
  s.layout = {{"a", 0, {2, 3}}, {"b", 6, {}}};
  const auto back = TrainState::from_json(json::parse(s.to_json().dump()), kWhere);
  EXPECT_EQ(back.to_json(), s.to_json());
  EXPECT_EQ(back.rng->seed, ~uint64_t{0});
  EXPECT_EQ(back.layout, s.layout);
  EXPECT_EQ(back.layout[1].numel(), 1);
  EXPECT_TRUE(back.tokenizer.is_null());
}

TEST(CheckpointTrainStateTest, MissingKeyNamesKeyAndManifest) {
  for (const char* key : {"step", "adam_steps", "loss_scaler", "config_hash", "tokenizer",
                          "version", "world_size", "zero_stage", "layout"}) {
    json state = golden_manifest().at("state");
    state.erase(key);
    const auto msg = corrupt_message([&] { TrainState::from_json(state, kWhere); });
    EXPECT_NE(msg.find(kWhere), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("state.") + key + " is missing"), std::string::npos) << msg;
  }
  json state = golden_manifest().at("state");
  state["loss_scaler"].erase("skipped");
  EXPECT_NE(corrupt_message([&] {
              TrainState::from_json(state, kWhere);
            }).find("state.loss_scaler.skipped is missing"),
            std::string::npos);
}

TEST(CheckpointTrainStateTest, WrongTypeNamesKeyAndWhatWasExpected) {
  json state = golden_manifest().at("state");
  state["layout"][1]["offset"] = "32";
  auto msg = corrupt_message([&] { TrainState::from_json(state, kWhere); });
  EXPECT_NE(msg.find("state.layout[1].offset is string"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected an integer"), std::string::npos) << msg;
  // ModelInfo reads the layout too: export fails the same way.
  EXPECT_NE(
      corrupt_message([&] { ModelInfo::from_json(state, kWhere); }).find("state.layout[1].offset"),
      std::string::npos);

  state = golden_manifest().at("state");
  state["rng"]["seed"] = -1;
  msg = corrupt_message([&] { TrainState::from_json(state, kWhere); });
  EXPECT_NE(msg.find("state.rng.seed is number"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected a non-negative integer"), std::string::npos) << msg;

  state = golden_manifest().at("state");
  state["step"] = 2.5;
  EXPECT_NE(corrupt_message([&] { TrainState::from_json(state, kWhere); }).find("state.step"),
            std::string::npos);
  state = golden_manifest().at("state");
  state["layout"] = json::object();
  EXPECT_NE(
      corrupt_message([&] { TrainState::from_json(state, kWhere); }).find("state.layout is object"),
      std::string::npos);
  EXPECT_NE(
      corrupt_message([&] { TrainState::from_json(json::array(), kWhere); }).find("state is array"),
      std::string::npos);
}

TEST(CheckpointTrainStateTest, ModelInfoReadsStatesOfAnyProducer) {
  const auto none = ModelInfo::from_json({{"step", 7}}, kWhere);
  EXPECT_FALSE(none.config_hash || none.tokenizer || none.config || none.layout);
  const auto some =
      ModelInfo::from_json({{"config_hash", "abc"}, {"tokenizer", {{"k", 6}}}}, kWhere);
  EXPECT_EQ(some.config_hash, "abc");
  EXPECT_EQ(some.tokenizer, (json{{"k", 6}}));
  EXPECT_FALSE(some.layout.has_value());
  const auto msg = corrupt_message([&] { ModelInfo::from_json({{"config_hash", 5}}, kWhere); });
  EXPECT_NE(msg.find("state.config_hash is number"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dnallm::checkpoint
