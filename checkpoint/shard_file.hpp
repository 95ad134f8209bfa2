// One shard file (`shard_NNNNN.dnc`): header, independently compressed chunks, a JSON
// index, and a fixed footer. Layout and hashes: docs/checkpoint-format.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/codec.hpp"
#include "checkpoint/types.hpp"

namespace dnallm::checkpoint {

inline constexpr char kShardMagic[8] = {'D', 'N', 'L', 'M', 'C', 'K', 'P', 'T'};
inline constexpr char kFooterMagic[8] = {'D', 'N', 'L', 'M', 'E', 'N', 'D', '1'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr size_t kFooterBytes = 40;

// "shard_00003.dnc"
std::string shard_file_name(int rank);

// Writes the shard of `rank` into `step_dir` (created if needed) durably: a temporary
// name, fsync, rename to shard_file_name(rank), fsync of the directory. Blocks; called
// from the async writer's thread or directly. Slices must not overlap per tensor.
// Throws Error(kFailure) on I/O errors (the temporary file is removed) and
// Error(kUsage) on inconsistent slices.
ShardDescriptor write_shard(const std::filesystem::path& step_dir, int rank,
                            const std::vector<TensorSlice>& slices, const CodecOptions& codec);

struct ChunkEntry {
  uint64_t offset = 0;       // in the file
  uint64_t stored_size = 0;  // bytes in the file
  uint64_t elem_begin = 0;   // first element, in the tensor's global flat layout
  uint64_t elem_count = 0;
  ChunkEncoding encoding = ChunkEncoding::kRaw;
  uint64_t xxh64 = 0;  // of the stored bytes
};

struct ShardTensor {
  TensorSpec spec;
  uint64_t begin = 0;
  uint64_t end = 0;
  std::vector<ChunkEntry> chunks;
};

// A shard opened for reading. Opening validates header, footer and index hash (not the
// chunk data). All reads use pread: const methods may be called from several threads.
class ShardFile {
 public:
  // Throws Error(kCheckpointCorrupt) naming the file when it is missing, truncated or
  // its index is damaged.
  explicit ShardFile(const std::filesystem::path& path);
  ~ShardFile();
  ShardFile(ShardFile&& o) noexcept;
  ShardFile& operator=(ShardFile&&) = delete;
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  uint64_t size() const { return size_; }
  uint64_t stored_file_hash() const { return file_hash_; }
  const std::vector<ShardTensor>& tensors() const { return tensors_; }
  // Every range of tensor `name` this shard holds, in file order (Note [Pieces of a tensor]).
  std::vector<const ShardTensor*> pieces(const std::string& name) const;

  // Hashes the whole file and every chunk; throws Error(kCheckpointCorrupt) naming the
  // file and (for a chunk) the tensor and chunk index.
  void verify() const;

  // Copies elements [begin, end) of `t` (within [t.begin, t.end)) to `out`, reading and
  // verifying only the overlapping chunks, decoding up to `threads` chunks in parallel.
  void read(const ShardTensor& t, uint64_t begin, uint64_t end, uint8_t* out,
            int threads = 4) const;

  // Reads, verifies and decodes chunk `i` of `t` into `out` (elem_count elements).
  void read_chunk(const ShardTensor& t, size_t i, uint8_t* out) const;

 private:
  void pread_all(uint64_t offset, void* out, size_t size) const;

  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t file_hash_ = 0;
  std::vector<ShardTensor> tensors_;
};

}  // namespace dnallm::checkpoint
