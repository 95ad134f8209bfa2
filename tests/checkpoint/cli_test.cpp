// dnallm-ckpt end to end: the real binary on real checkpoint directories.
#include <algorithm>
#include <cstdio>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/manifest.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/safetensors.hpp"
#include "checkpoint/shard_file.hpp"
#include "test_util.hpp"
#include "tests/support/process.hpp"

namespace dnallm::checkpoint {
namespace {

using testing::flip_byte;
using testing::make_data;
using testing::spec;
using testing::TempDir;

using CliRun = dnallm::testing::CommandResult;

// dnallm-ckpt `args`: stdout and stderr.
CliRun run_ckpt(const std::string& args) {
  return dnallm::testing::run_shell(dnallm::testing::kBin + "dnallm-ckpt " + args);
}

void make_checkpoint(const std::filesystem::path& root, std::vector<uint8_t>& w) {
  w = make_data(DType::kFloat32, 3000, 1);
  CodecOptions o;
  o.chunk_bytes = 1024;
  const auto s = spec("w", DType::kFloat32, {3000});
  const auto dir = root / step_dir_name(8);
  auto d0 = write_shard(dir, 0, {{s, 0, 1500, w.data()}}, o);
  auto d1 = write_shard(dir, 1, {{s, 1500, 3000, w.data() + 6000}}, o);
  commit_step(root, {8, 2, 1, {{"config", {{"arch", "gpt"}}}, {"tokenizer", "char"}}}, {d0, d1});
}

TEST(CheckpointCliTest, HelpAndBadUsage) {
  EXPECT_EQ(run_ckpt("--help").code, 0);
  CliRun bad = run_ckpt("reshard /nowhere");
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(std::count(bad.out.begin(), bad.out.end(), '\n'), 1) << bad.out;
  EXPECT_EQ(run_ckpt("frobnicate").code, 2);
}

TEST(CheckpointCliTest, InspectVerifyReshardExport) {
  TempDir tmp;
  std::vector<uint8_t> w;
  make_checkpoint(tmp.path() / "ck", w);
  const std::string root = (tmp.path() / "ck").string();

  CliRun inspect = run_ckpt("inspect " + root);
  ASSERT_EQ(inspect.code, 0) << inspect.out;
  auto j = nlohmann::json::parse(inspect.out);
  EXPECT_EQ(j["step"], 8);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["tensors"][0]["numel"], 3000);

  EXPECT_EQ(run_ckpt("verify " + root).code, 0);
  CliRun rs = run_ckpt("reshard " + root + " --world-size 3 --out " + (tmp.path() / "r3").string());
  ASSERT_EQ(rs.code, 0) << rs.out;
  auto r3 = CheckpointReader::open(tmp.path() / "r3");
  EXPECT_EQ(r3.manifest().world_size, 3);
  EXPECT_EQ(r3.read_tensor("w"), w);

  CliRun ex = run_ckpt("export " + (tmp.path() / "r3" / step_dir_name(8)).string() + " --out " +
                       (tmp.path() / "final").string());
  ASSERT_EQ(ex.code, 0) << ex.out;
  auto st = read_safetensors_header(tmp.path() / "final" / "model.safetensors");
  EXPECT_EQ(st.tensors.at("w").spec.numel(), 3000u);
  EXPECT_TRUE(std::filesystem::exists(tmp.path() / "final" / "config.json"));
  EXPECT_TRUE(std::filesystem::exists(tmp.path() / "final" / "tokenizer.json"));
}

TEST(CheckpointCliTest, BadOutputsAreUsageErrorsThatWriteNothing) {
  TempDir tmp;
  std::vector<uint8_t> w;
  make_checkpoint(tmp.path() / "ck", w);
  const std::string root = (tmp.path() / "ck").string();
  // reshard into a million shards: refused before the first file.
  CliRun huge =
      run_ckpt("reshard " + root + " --world-size 1000000 --out " + (tmp.path() / "huge").string());
  EXPECT_EQ(huge.code, 2) << huge.out;
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "huge" / step_dir_name(8))) << huge.out;
  CliRun too_many =
      run_ckpt("reshard " + root + " --world-size 3001 --out " + (tmp.path() / "many").string());
  EXPECT_EQ(too_many.code, 2) << too_many.out;
  EXPECT_EQ(std::count(too_many.out.begin(), too_many.out.end(), '\n'), 1) << too_many.out;
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "many" / step_dir_name(8)));
  // export --out naming an existing file.
  std::ofstream(tmp.path() / "a_file") << "keep me";
  CliRun ex = run_ckpt("export " + root + " --out " + (tmp.path() / "a_file").string());
  EXPECT_EQ(ex.code, 2) << ex.out;
  EXPECT_NE(ex.out.find("not a directory"), std::string::npos) << ex.out;
  std::ifstream kept(tmp.path() / "a_file");
  std::string text;
  std::getline(kept, text);
  EXPECT_EQ(text, "keep me");
}

TEST(CheckpointCliTest, VerifyNamesTheBadShardAndChunk) {
  TempDir tmp;
  std::vector<uint8_t> w;
  make_checkpoint(tmp.path(), w);
  const auto shard = tmp.path() / step_dir_name(8) / "shard_00001.dnc";
  ShardFile f(shard);
  const auto& c = f.tensors()[0].chunks.at(2);
  flip_byte(shard, static_cast<int64_t>(c.offset + 1));
  CliRun v = run_ckpt("verify " + tmp.path().string());
  EXPECT_EQ(v.code, 5) << v.out;
  EXPECT_NE(v.out.find("shard_00001.dnc"), std::string::npos) << v.out;
  EXPECT_NE(v.out.find("chunk 2"), std::string::npos) << v.out;
}

}  // namespace
}  // namespace dnallm::checkpoint
