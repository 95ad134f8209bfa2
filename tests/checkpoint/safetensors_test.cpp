#include "checkpoint/safetensors.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/manifest.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "test_util.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::checkpoint {
namespace {

using dnallm::testing::expect_error;
using namespace testing;  // NOLINT: tests/checkpoint/test_util.hpp

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
  auto path = export_checkpoint_model(CheckpointReader::open(tmp.path() / "ckpt"), out);
  auto st = read_safetensors_header(path);
  EXPECT_EQ(st.data_offset % 8, 0u);
  EXPECT_EQ(st.metadata.at("step"), "42");
  ASSERT_EQ(st.tensors.size(), 3u);
  std::ifstream in(path, std::ios::binary);
  auto check = [&](const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                   const std::vector<uint8_t>& want) {
    const auto& e = st.tensors.at(name);
    EXPECT_EQ(safetensors_dtype_name(e.spec.dtype), dtype);
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

// A tensor whose bytes come in pieces of `piece` bytes (as the checkpoint export streams).
SafetensorsTensor tensor_of(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const std::vector<uint8_t>& bytes, size_t piece) {
  return {name, dtype, std::move(shape), [&bytes, piece](const ByteSink& sink) {
            for (size_t b = 0; b < bytes.size(); b += piece)
              sink(bytes.data() + b, std::min(piece, bytes.size() - b));
          }};
}

TEST(CheckpointSafetensorsTest, WriterAndReaderAgreeOnEveryByte) {
  TempDir tmp;
  const auto q = make_data(DType::kBFloat16, 6, 1);
  const auto ids = make_data(DType::kInt64, 5, 2);
  const auto small = make_data(DType::kInt8, 3, 3);
  const auto path = tmp.path() / "m.safetensors";
  write_safetensors(path,
                    {tensor_of("z.last", DType::kBFloat16, {2, 3}, q, 5),
                     tensor_of("a.first", DType::kInt64, {5}, ids, 7),
                     tensor_of("i8", DType::kInt8, {3}, small, 1)},
                    {{"format", "pt"}});
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "m.safetensors.tmp"));
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.file().data_offset % 8, 0u);
  EXPECT_EQ(reader.file().metadata.at("format"), "pt");
  // Data in the order given (not sorted by name): "z.last" first.
  EXPECT_EQ(reader.file().tensors.at("z.last").data_begin, 0u);
  auto read = [&](const std::string& name) {
    const auto& e = reader.file().tensors.at(name);
    std::vector<uint8_t> got(e.data_end - e.data_begin);
    reader.read(e, got.data());
    return got;
  };
  EXPECT_EQ(read("z.last"), q);
  EXPECT_EQ(read("a.first"), ids);
  EXPECT_EQ(read("i8"), small);
  EXPECT_EQ(reader.file().tensors.at("a.first").spec.shape, (std::vector<int64_t>{5}));
}

TEST(CheckpointSafetensorsTest, AWrongByteCountWritesNothing) {
  TempDir tmp;
  const auto bytes = make_data(DType::kFloat32, 4, 1);
  const auto path = tmp.path() / "bad.safetensors";
  // Claims 5 floats, produces 4.
  EXPECT_THROW(write_safetensors(path, {tensor_of("w", DType::kFloat32, {5}, bytes, 16)}), Error);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "bad.safetensors.tmp"));
}

std::vector<uint8_t> file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Note [Safetensors in any order]: tensors written at their offsets in another order than the
// header's make the same file, byte for byte, as write_safetensors() in the header's order; a
// writer that is not committed (a tensor missing, an error) leaves neither file nor *.tmp.
TEST(CheckpointSafetensorsTest, WritingInAnyOrderMakesTheSameFile) {
  TempDir tmp;
  const auto a = make_data(DType::kFloat32, 6, 1);
  const auto b = make_data(DType::kBFloat16, 5, 2);
  const auto c = make_data(DType::kInt64, 3, 3);
  const std::vector<SafetensorsTensor> tensors = {tensor_of("a", DType::kFloat32, {2, 3}, a, 8),
                                                  tensor_of("b", DType::kBFloat16, {5}, b, 3),
                                                  tensor_of("c", DType::kInt64, {3}, c, 24)};
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  write_safetensors(tmp.path() / "in_order.safetensors", tensors, metadata);
  std::vector<TensorSpec> specs;
  for (const auto& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  {
    SafetensorsWriter writer(tmp.path() / "any_order.safetensors", specs, metadata);
    for (size_t i : {2, 0, 1}) writer.write(i, tensors[i].write_data);
    EXPECT_THROW(writer.write(0, tensors[0].write_data), Error);  // once per tensor
    writer.commit();
  }
  EXPECT_EQ(file_bytes(tmp.path() / "any_order.safetensors"),
            file_bytes(tmp.path() / "in_order.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "any_order.safetensors.tmp"));
  SafetensorsReader reader(tmp.path() / "any_order.safetensors");
  for (const auto& [name, want] : {std::pair{"a", &a}, std::pair{"b", &b}, std::pair{"c", &c}}) {
    const auto& e = reader.file().tensors.at(name);
    std::vector<uint8_t> got(e.data_end - e.data_begin);
    reader.read(e, got.data());
    EXPECT_EQ(got, *want) << name;
  }
  const auto partial = tmp.path() / "partial.safetensors";
  {
    SafetensorsWriter writer(partial, specs, metadata);
    writer.write(1, tensors[1].write_data);
    EXPECT_TRUE(std::filesystem::exists(tmp.path() / "partial.safetensors.tmp"));
    try {
      writer.commit();
      ADD_FAILURE() << "a file with a tensor never written was committed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tensor 'a' was never written"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(partial));
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "partial.safetensors.tmp"));
}

TEST(CheckpointSafetensorsTest, TruncatedDataIsDamaged) {
  TempDir tmp;
  const auto bytes = make_data(DType::kFloat32, 64, 1);
  const auto path = tmp.path() / "t.safetensors";
  write_safetensors(path, {tensor_of("w", DType::kFloat32, {64}, bytes, 256)});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  expect_error([&] { read_safetensors_header(path); }, ExitCode::kCheckpointCorrupt);
}

// ---------------------------------------------------------------------------------------------
// Issue 22: a downloaded model.safetensors is untrusted (Note [Untrusted files]). Each damaged
// header is refused with exit code 5 and one line naming the file and what is wrong.

// A safetensors file with this header text and `data_bytes` zero bytes of data.
void write_raw(const std::filesystem::path& path, const std::string& header, size_t data_bytes) {
  std::string text = header;
  while (text.size() % 8 != 0) text.push_back(' ');
  std::ofstream f(path, std::ios::binary);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f << text << std::string(data_bytes, '\0');
}

void expect_damaged(const std::filesystem::path& path, const std::string& needle) {
  try {
    SafetensorsReader reader(path);
    FAIL() << path << " accepted; expected: " << needle;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), ExitCode::kCheckpointCorrupt) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
    EXPECT_NE(what.find(path.string()), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_LT(what.size(), 600u) << what;
  }
}

struct DamagedHeader {
  const char* name;
  const char* header;
  size_t data_bytes;
  const char* needle;
};

TEST(CheckpointSafetensorsTest, DamagedHeadersAreRefusedWithExitCode5) {
  TempDir tmp;
  const std::string long_name(100000, 'x');
  const std::vector<DamagedHeader> cases = {
      {"negative_dim", R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", 16,
       "has the dimension -4"},
      {"overflowing_shape",
       R"({"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,16]}})",
       16, "do not match its shape"},
      {"shape_not_bytes", R"({"w":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}})", 16,
       "do not match its shape"},
      {"past_the_end", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}})", 16,
       "past the end"},
      {"reversed", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[16,0]}})", 16,
       "data_offsets [16, 0]"},
      {"negative_offset", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[-16,0]}})", 16,
       "needs data_offsets"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
       24, "tensors 'a' and 'b' share bytes"},
      {"duplicate",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
       16, "key \"w\" appears twice"},
      {"bad_dtype", R"({"w":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}})", 16,
       "unsupported safetensors dtype 'Q4'"},
      {"not_json", "{\"w\": [", 16, "is not valid JSON"},
      {"not_object", "[1, 2]", 16, "not a JSON object"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto path = tmp.path() / (std::string(c.name) + ".safetensors");
    write_raw(path, c.header, c.data_bytes);
    expect_damaged(path, c.needle);
  }
  // A name of 100,000 characters is quoted, not copied whole, into the message.
  const auto long_path = tmp.path() / "long_name.safetensors";
  write_raw(long_path,
            R"({")" + long_name + R"(":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}})", 16);
  expect_damaged(long_path, "(100000 bytes in all)");
  // A header length beyond the file (or the 100 MiB bound).
  const auto huge = tmp.path() / "huge_header.safetensors";
  {
    std::ofstream f(huge, std::ios::binary);
    const uint8_t len[8] = {0, 0, 0, 0, 0, 0, 0, 0x40};
    f.write(reinterpret_cast<const char*>(len), 8);
    f << "{}      ";
  }
  expect_damaged(huge, "not a safetensors file (header length 4611686018427387904");
}

TEST(CheckpointSafetensorsTest, OnlyRegularFilesAreRead) {
  TempDir tmp;
  const auto dir = tmp.path() / "dir.safetensors";
  std::filesystem::create_directories(dir);
  expect_damaged(dir, "is a directory");
  const auto zero = tmp.path() / "zero.safetensors";
  std::filesystem::create_symlink("/dev/zero", zero);
  expect_damaged(zero, "is not a regular file (a device)");
  const auto loop = tmp.path() / "loop.safetensors";
  std::filesystem::create_symlink(loop, loop);
  expect_damaged(loop, "symbolic link loop");
}

TEST(CheckpointSafetensorsTest, ModelDirectoryHoldsWhatItWasGiven) {
  TempDir tmp;
  const auto w = make_data(DType::kFloat32, 4, 1);
  const auto a = make_data(DType::kFloat32, 2, 2);
  ModelDirectory model;
  model.weights = {tensor_of("w", DType::kFloat32, {4}, w, 16)};
  model.config = nlohmann::ordered_json{{"model_type", "bert"}, {"hidden_size", 4}};
  model.adapters = {tensor_of("base_model.model.w.lora_A.weight", DType::kFloat32, {1, 2}, a, 8)};
  const auto dir = tmp.path() / "out" / "final";
  EXPECT_EQ(write_model_directory(dir, model), dir / "model.safetensors");
  EXPECT_EQ(read_safetensors_header(dir / "model.safetensors").tensors.size(), 1u);
  EXPECT_EQ(read_safetensors_header(dir / "adapter_model.safetensors").tensors.size(), 1u);
  std::ifstream cfg(dir / "config.json");
  EXPECT_EQ(nlohmann::ordered_json::parse(cfg), *model.config);
  EXPECT_FALSE(std::filesystem::exists(dir / "tokenizer.json"));  // none given
}

}  // namespace
}  // namespace dnallm::checkpoint
