// Streaming writers of embedding matrices (torch-free, so they build and test fast).
//
// Note [Embedding files]: `dnallm-infer embed --out F` writes
//   F.npy             float32 [rows, dim], C order, NumPy format 1.0
//   F.safetensors     "embeddings" F32 [rows, dim] (+ "offsets" I64 [sequences + 1])
//   F.ids.txt         the sequence ids, one per line, in input order
//   <stem>.offsets.npy (.npy, per-token only) int64 [sequences + 1]: sequence i owns rows
//                     [offsets[i], offsets[i + 1])
// Pooled embeddings have one row per sequence (rows == sequences, no offsets). Rows are
// appended as they are computed and the header, whose size is reserved up front, is
// rewritten at close(): memory stays bounded whatever the number of sequences (per-token
// safetensors keeps the offsets, 8 bytes a sequence, until close()).
// A file is written as <path>.tmp and renamed at close(), so a killed run leaves no
// truncated file under the final name; a writer destroyed before close() (an error
// unwound) removes its .tmp files. A final name that is a device or a FIFO is Error(kUsage)
// (never renamed over: Note [Outputs never inputs], core/output_file.cpp); so is a failed
// write (a full disk).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace dnallm::infer {

// How the files are written, for require_regular_output() (core/output_file.hpp).
inline constexpr const char* kEmbeddingHeaderLast =
    "embedding files are written beside it, their header last, and renamed over it";

// Where appended rows go: the final files, or one rank's part (merged by rank 0).
class EmbeddingSink {
 public:
  virtual ~EmbeddingSink() = default;
  // `rows` x dim floats for one sequence (1 row when pooled).
  virtual void append(const std::string& id, const float* values, int64_t rows) = 0;
  virtual void close() = 0;
};

class EmbeddingFileWriter final : public EmbeddingSink {
 public:
  // `path` ends in .npy or .safetensors (else Error(kUsage)). `per_token`: variable rows per
  // sequence, offsets written.
  EmbeddingFileWriter(std::string path, int64_t dim, bool per_token);
  ~EmbeddingFileWriter() override;
  void append(const std::string& id, const float* values, int64_t rows) override;
  void close() override;
  int64_t sequences() const { return sequences_; }
  int64_t rows() const { return rows_; }

 private:
  void write_header();
  std::string path_;
  int64_t dim_;
  bool per_token_;
  bool safetensors_;
  std::FILE* data_ = nullptr;
  std::FILE* ids_ = nullptr;
  std::FILE* offsets_ = nullptr;     // .npy per-token only
  std::vector<int64_t> st_offsets_;  // .safetensors per-token only
  int64_t sequences_ = 0, rows_ = 0;
  bool closed_ = false;
};

// One rank's share, raw: <prefix>.f32 (rows), <prefix>.ids.txt, <prefix>.rows (int64 rows
// per sequence). merge_embedding_parts() appends parts to a writer in rank order.
class EmbeddingPartWriter final : public EmbeddingSink {
 public:
  EmbeddingPartWriter(std::string prefix, int64_t dim);
  ~EmbeddingPartWriter() override;
  void append(const std::string& id, const float* values, int64_t rows) override;
  void close() override;

 private:
  std::string prefix_;
  int64_t dim_;
  std::FILE* data_ = nullptr;
  std::FILE* ids_ = nullptr;
  std::FILE* counts_ = nullptr;
};

// Appends every part (prefixes in order) to `out` and deletes the part files.
void merge_embedding_parts(const std::vector<std::string>& prefixes, int64_t dim,
                           EmbeddingSink& out);

// Error(kUsage) unless `path` ends in .npy or .safetensors.
void check_embedding_out_name(const std::string& path);

// "<stem>.ids.txt" and, for a .npy path, "<stem>.offsets.npy" (<stem>: `path` without its
// .npy or .safetensors extension: F.npy -> F.ids.txt, F.offsets.npy).
std::string ids_path(const std::string& path);
std::string offsets_path(const std::string& path);

// Reads a float32 or int64 2-D/1-D .npy written by EmbeddingFileWriter (tests, tools).
struct NpyArray {
  std::string dtype;  // "<f4" | "<i8"
  std::vector<int64_t> shape;
  std::vector<char> data;
};
NpyArray read_npy(const std::string& path);

}  // namespace dnallm::infer
