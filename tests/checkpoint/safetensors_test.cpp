#include "checkpoint/safetensors.hpp"

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/manifest.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "test_util.hpp"

namespace dnallm::checkpoint {
namespace {

using testing::make_data;
using testing::spec;
using testing::TempDir;

TEST(CheckpointSafetensorsTest, ExportParsesBackWithEveryByte) {
  TempDir tmp;
  auto q = make_data(DType::kBFloat16, 8 * 4, 1);
  auto b = make_data(DType::kFloat32, 4, 2);
  auto ids = make_data(DType::kInt64, 3, 3);
  const auto sq = spec("encoder.layer.0.attention.self.query.weight", DType::kBFloat16, {8, 4});
  const auto dir = tmp.path() / "ckpt" / step_dir_name(42);
  auto d0 = write_shard(
      dir, 0, {{sq, 0, 20, q.data()}, {spec("bias", DType::kFloat32, {4}), 0, 4, b.data()}}, {});
  auto d1 = write_shard(
      dir, 1, {{sq, 20, 32, q.data() + 40}, {spec("ids", DType::kInt64, {3}), 0, 3, ids.data()}},
      {});
  nlohmann::json state = {{"config", {{"arch", "bert"}, {"hidden", 4}}},
                          {"tokenizer", {{"kind", "kmer"}, {"k", 6}}}};
  commit_step(tmp.path() / "ckpt", {42, 2, 1, state}, {d0, d1});

  const auto out = tmp.path() / "final";
  auto path = export_model(CheckpointReader::open(tmp.path() / "ckpt"), out);
  auto st = read_safetensors_header(path);
  EXPECT_EQ(st.data_offset % 8, 0u);
  EXPECT_EQ(st.metadata.at("step"), "42");
  ASSERT_EQ(st.tensors.size(), 3u);
  std::ifstream in(path, std::ios::binary);
  auto check = [&](const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                   const std::vector<uint8_t>& want) {
    const auto& e = st.tensors.at(name);
    EXPECT_EQ(safetensors_dtype(e.spec.dtype), dtype);
    EXPECT_EQ(e.spec.shape, shape);
    std::vector<uint8_t> got(e.data_end - e.data_begin);
    in.seekg(static_cast<std::streamoff>(st.data_offset + e.data_begin));
    in.read(reinterpret_cast<char*>(got.data()), static_cast<std::streamsize>(got.size()));
    EXPECT_EQ(got, want) << name;
  };
  check(sq.name, "BF16", {8, 4}, q);
  check("bias", "F32", {4}, b);
  check("ids", "I64", {3}, ids);
  std::ifstream cfg(out / "config.json"), tok(out / "tokenizer.json");
  EXPECT_EQ(nlohmann::json::parse(cfg), state["config"]);
  EXPECT_EQ(nlohmann::json::parse(tok), state["tokenizer"]);
}

TEST(CheckpointSafetensorsTest, RejectsGarbage) {
  TempDir tmp;
  std::ofstream(tmp.path() / "x.safetensors") << "not a safetensors file at all";
  EXPECT_THROW(read_safetensors_header(tmp.path() / "x.safetensors"), Error);
}

}  // namespace
}  // namespace dnallm::checkpoint
