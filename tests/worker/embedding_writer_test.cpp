// Streaming embedding files: .npy and .safetensors round trips, per-token offsets, rank parts
// merged in order, and no final file from an unfinished writer.
#include "worker/infer/embedding_writer.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::infer {
namespace {

using dnallm::testing::expect_error;

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("dnallm_embedding_writer_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);) out.push_back(line);
  return out;
}

std::vector<float> row_values(int seq, int64_t rows, int64_t dim) {
  std::vector<float> v(static_cast<size_t>(rows * dim));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(seq) * 1000.0F + float(i);
  return v;
}

TEST(EmbeddingWriter, PooledNpyRoundTrip) {
  const auto dir = temp_dir("npy");
  const auto path = (dir / "e.npy").string();
  EmbeddingFileWriter w(path, 3, false);
  for (int s = 0; s < 5; ++s) w.append("id" + std::to_string(s), row_values(s, 1, 3).data(), 1);
  EXPECT_FALSE(fs::exists(path));  // only the .tmp until close()
  w.close();
  auto a = read_npy(path);
  EXPECT_EQ(a.dtype, "<f4");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{5, 3}));
  const float* f = reinterpret_cast<const float*>(a.data.data());
  for (int s = 0; s < 5; ++s) {
    for (int j = 0; j < 3; ++j) EXPECT_EQ(f[s * 3 + j], float(s) * 1000.0F + float(j));
  }
  EXPECT_EQ(read_lines(ids_path(path)),
            (std::vector<std::string>{"id0", "id1", "id2", "id3", "id4"}));
  EXPECT_FALSE(fs::exists(offsets_path(path)));
  // NumPy's rule: the header ends in '\n' and data starts at a multiple of 64.
  std::ifstream raw(path, std::ios::binary);
  std::string head(128, '\0');
  raw.read(head.data(), 128);
  EXPECT_EQ(head[127], '\n');
  EXPECT_NE(head.find("'shape': (5, 3)"), std::string::npos);
}

TEST(EmbeddingWriter, PerTokenNpyHasOffsets) {
  const auto dir = temp_dir("tokens");
  const auto path = (dir / "t.npy").string();
  EmbeddingFileWriter w(path, 2, true);
  const int64_t rows[] = {3, 1, 4};
  for (int s = 0; s < 3; ++s)
    w.append("s" + std::to_string(s), row_values(s, rows[s], 2).data(), rows[s]);
  w.close();
  auto a = read_npy(path);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{8, 2}));
  auto off = read_npy(offsets_path(path));
  EXPECT_EQ(off.dtype, "<i8");
  ASSERT_EQ(off.shape, (std::vector<int64_t>{4}));
  const int64_t* o = reinterpret_cast<const int64_t*>(off.data.data());
  EXPECT_EQ(std::vector<int64_t>(o, o + 4), (std::vector<int64_t>{0, 3, 4, 8}));
  const float* f = reinterpret_cast<const float*>(a.data.data());
  EXPECT_EQ(f[o[2] * 2], 2000.0F);  // first row of sequence 2
}

TEST(EmbeddingWriter, SafetensorsHeaderDescribesTheData) {
  const auto dir = temp_dir("st");
  const auto path = (dir / "e.safetensors").string();
  EmbeddingFileWriter w(path, 4, true);
  w.append("a", row_values(0, 2, 4).data(), 2);
  w.append("b", row_values(1, 3, 4).data(), 3);
  w.close();
  std::ifstream f(path, std::ios::binary);
  uint64_t len = 0;
  f.read(reinterpret_cast<char*>(&len), 8);
  std::string text(len, '\0');
  f.read(text.data(), static_cast<std::streamsize>(len));
  auto h = nlohmann::json::parse(text);
  EXPECT_EQ(h["embeddings"]["shape"], nlohmann::json({5, 4}));
  EXPECT_EQ(h["embeddings"]["dtype"], "F32");
  EXPECT_EQ(h["offsets"]["shape"], nlohmann::json({3}));
  const auto offs = h["offsets"]["data_offsets"].get<std::vector<uint64_t>>();
  EXPECT_EQ(offs[0], 5u * 4u * 4u);
  EXPECT_EQ(fs::file_size(path), 8 + len + offs[1]);
  f.seekg(static_cast<std::streamoff>(8 + len + offs[0]));
  int64_t o[3];
  f.read(reinterpret_cast<char*>(o), sizeof o);
  EXPECT_EQ(std::vector<int64_t>(o, o + 3), (std::vector<int64_t>{0, 2, 5}));
}

TEST(EmbeddingWriter, PartsMergeInRankOrderAndAreRemoved) {
  const auto dir = temp_dir("parts");
  std::vector<std::string> prefixes;
  int seq = 0;
  for (int r = 0; r < 3; ++r) {
    prefixes.push_back((dir / ("out.part" + std::to_string(r))).string());
    EmbeddingPartWriter p(prefixes.back(), 2);
    for (int k = 0; k < r + 1; ++k, ++seq)
      p.append("q" + std::to_string(seq), row_values(seq, 1, 2).data(), 1);
    p.close();
  }
  const auto path = (dir / "out.npy").string();
  EmbeddingFileWriter w(path, 2, false);
  merge_embedding_parts(prefixes, 2, w);
  w.close();
  auto a = read_npy(path);
  ASSERT_EQ(a.shape, (std::vector<int64_t>{6, 2}));
  const float* f = reinterpret_cast<const float*>(a.data.data());
  for (int s = 0; s < 6; ++s) EXPECT_EQ(f[s * 2], float(s) * 1000.0F);
  EXPECT_EQ(read_lines(ids_path(path)).back(), "q5");
  EXPECT_FALSE(fs::exists(prefixes[1] + ".f32"));
}

TEST(EmbeddingWriter, BadNameAndMissingPartAreClearErrors) {
  const auto dir = temp_dir("bad");
  expect_error([&] { EmbeddingFileWriter w((dir / "e.txt").string(), 2, false); },
               ExitCode::kUsage);
  EmbeddingFileWriter w((dir / "e.npy").string(), 2, false);
  expect_error([&] { merge_embedding_parts({(dir / "missing").string()}, 2, w); },
               ExitCode::kPeerFailed, {"shared"});
}

}  // namespace
}  // namespace dnallm::infer
