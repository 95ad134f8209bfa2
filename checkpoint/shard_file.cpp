#include "checkpoint/shard_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <map>

#include <fmt/format.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "checkpoint/durable_io.hpp"
#include "core/error.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Writes through an OutFile while hashing every byte (the file hash).
class HashingWriter {
 public:
  explicit HashingWriter(OutFile& f) : f_(f), state_(XXH64_createState()) {
    XXH64_reset(state_, 0);
  }
  ~HashingWriter() { XXH64_freeState(state_); }
  void write(const void* p, size_t n) {
    XXH64_update(state_, p, n);
    f_.write(p, n);
  }
  uint64_t digest() const { return XXH64_digest(state_); }
  uint64_t offset() const { return f_.written(); }

 private:
  OutFile& f_;
  XXH64_state_t* state_;
};

// Checks each slice lies inside its tensor and has data, and that no two ranges of one tensor
// overlap.
void check_slices(const std::vector<TensorSlice>& slices) {
  // Note [Pieces of a tensor]: a shard may hold several disjoint ranges of one tensor (a
  // fully sharded rank owns a piece of every unit); they must not overlap.
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> seen;
  for (const auto& s : slices) {
    DNALLM_CHECK(s.begin <= s.end && s.end <= s.spec.numel(), ExitCode::kUsage,
                 "slice [{}, {}) of tensor '{}' lies outside its {} elements", s.begin, s.end,
                 s.spec.name, s.spec.numel());
    DNALLM_CHECK(s.data != nullptr || s.count() == 0, ExitCode::kUsage,
                 "slice of tensor '{}' has no data", s.spec.name);
    for (const auto& [lo, hi] : seen[s.spec.name]) {
      DNALLM_CHECK(s.end <= lo || hi <= s.begin || (s.begin == s.end && lo == hi), ExitCode::kUsage,
                   "ranges [{}, {}) and [{}, {}) of tensor '{}' overlap in one shard", lo, hi,
                   s.begin, s.end, s.spec.name);
    }
    seen[s.spec.name].emplace_back(s.begin, s.end);
  }
}

// Encodes the slices' chunks and writes them after the header; each slice's chunk index
// entries (offset, stored bytes, first element, elements, encoding, hash), by slice.
std::vector<json> write_chunks(HashingWriter& w, const std::vector<TensorSlice>& slices,
                               const CodecOptions& codec) {
  // Chunks are encoded `threads` at a time (std::async, joined before the next
  // window) and written in order, so memory stays at threads x chunk_bytes.
  struct Pending {
    size_t slice;
    uint64_t elem_begin, count;
  };
  std::vector<Pending> all;
  for (size_t si = 0; si < slices.size(); ++si) {
    const auto& s = slices[si];
    const uint64_t per_chunk = std::max<uint64_t>(1, codec.chunk_bytes / dtype_size(s.spec.dtype));
    for (uint64_t e = s.begin; e < s.end; e += per_chunk)
      all.push_back({si, e, std::min(per_chunk, s.end - e)});
  }
  std::vector<json> chunks(slices.size(), json::array());
  const size_t window = static_cast<size_t>(std::max(1, codec.threads));
  std::vector<std::vector<uint8_t>> stored(window);
  std::vector<std::future<ChunkEncoding>> encoded(window);
  for (size_t w0 = 0; w0 < all.size(); w0 += window) {
    const size_t wn = std::min(window, all.size() - w0);
    for (size_t k = 0; k < wn; ++k) {
      const Pending& p = all[w0 + k];
      const TensorSlice& s = slices[p.slice];
      const size_t es = dtype_size(s.spec.dtype);
      const auto* src = static_cast<const uint8_t*>(s.data) + (p.elem_begin - s.begin) * es;
      auto job = [src, n = p.count * es, dtype = s.spec.dtype, &codec, out = &stored[k]] {
        return encode_chunk(src, n, dtype, codec, *out);
      };
      encoded[k] =
          wn == 1 ? std::async(std::launch::deferred, job) : std::async(std::launch::async, job);
    }
    for (size_t k = 0; k < wn; ++k) encoded[k].wait();  // all joined before any rethrow
    for (size_t k = 0; k < wn; ++k) {
      const ChunkEncoding enc = encoded[k].get();  // rethrows an encoding error
      const Pending& p = all[w0 + k];
      const uint64_t off = w.offset();
      w.write(stored[k].data(), stored[k].size());
      chunks[p.slice].push_back({off, stored[k].size(), p.elem_begin, p.count,
                                 static_cast<int>(enc),
                                 XXH64(stored[k].data(), stored[k].size(), 0)});
    }
  }
  return chunks;
}

// The index's "tensors" list (each slice with its chunks, moved from `chunks`); the slices'
// specs and ranges added to `desc`.
json tensor_index(const std::vector<TensorSlice>& slices, std::vector<json>& chunks,
                  ShardDescriptor& desc) {
  json jtensors = json::array();
  for (size_t si = 0; si < slices.size(); ++si) {
    const auto& s = slices[si];
    jtensors.push_back({{"name", s.spec.name},
                        {"dtype", dtype_name(s.spec.dtype)},
                        {"shape", s.spec.shape},
                        {"begin", s.begin},
                        {"end", s.end},
                        {"chunks", std::move(chunks[si])}});
    desc.tensors.push_back(s.spec);
    desc.ranges.push_back({s.spec.name, s.begin, s.end});
  }
  return jtensors;
}

// The index and the footer after the chunks; the file's hash and size into `desc`.
void write_index_and_footer(OutFile& f, HashingWriter& w, const json& index,
                            ShardDescriptor& desc) {
  const std::string itext = index.dump();
  const uint64_t index_offset = w.offset();
  w.write(itext.data(), itext.size());

  uint8_t footer[kFooterBytes];
  put_u64(footer, index_offset);
  put_u64(footer + 8, itext.size());
  put_u64(footer + 16, XXH64(itext.data(), itext.size(), 0));
  w.write(footer, 24);
  desc.xxh64 = w.digest();  // covers everything before the file-hash field
  put_u64(footer + 24, desc.xxh64);
  std::memcpy(footer + 32, kFooterMagic, 8);
  f.write(footer + 24, 16);
  desc.bytes = f.written();
}

}  // namespace

std::string shard_file_name(int rank) { return fmt::format("shard_{:05d}.dnc", rank); }

ShardDescriptor write_shard(const fs::path& step_dir, int rank,
                            const std::vector<TensorSlice>& slices, const CodecOptions& codec) {
  DNALLM_CHECK(rank >= 0, ExitCode::kUsage, "write_shard: rank {} is negative", rank);
  check_slices(slices);
  std::error_code mkdir_error;
  fs::create_directories(step_dir, mkdir_error);
  DNALLM_CHECK(!mkdir_error, kWriteFailed,
               "cannot create the checkpoint directory {}: {}: free disk space or make "
               "checkpoint.dir writable, then run again (it resumes from the last committed "
               "checkpoint)",
               step_dir.string(), mkdir_error.message());
  const std::string name = shard_file_name(rank);
  const fs::path final_path = step_dir / name;
  const fs::path tmp_path = step_dir / (name + fmt::format(".tmp.{}", ::getpid()));

  ShardDescriptor desc;
  desc.rank = rank;
  desc.file = name;
  try {
    OutFile f(tmp_path);
    HashingWriter w(f);
    uint8_t header[kHeaderBytes] = {};
    std::memcpy(header, kShardMagic, 8);
    header[8] = static_cast<uint8_t>(kShardVersion);
    w.write(header, sizeof header);

    json index;
    index["rank"] = rank;
    index["codec"] = codec_name(codec.codec);
    index["level"] = codec.level;
    index["byte_grouping"] = codec.byte_grouping;
    auto chunks = write_chunks(w, slices, codec);
    index["tensors"] = tensor_index(slices, chunks, desc);
    write_index_and_footer(f, w, index, desc);
    f.sync();
    f.close();
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp_path, ec);
    throw;
  }
  DNALLM_WRITECHECK(::rename(tmp_path.c_str(), final_path.c_str()), final_path.string());
  fsync_dir(step_dir);
  return desc;
}

ShardFile::ShardFile(const fs::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0)
    fail(ExitCode::kCheckpointCorrupt, "checkpoint shard {} cannot be opened: {}", path.string(),
         errno_string());
  struct stat st {};
  DNALLM_SYSCHECK(::fstat(fd_, &st), path.string());
  size_ = static_cast<uint64_t>(st.st_size);
  auto corrupt = [&](const std::string& why) {
    ::close(fd_);
    fd_ = -1;
    fail(ExitCode::kCheckpointCorrupt, "checkpoint shard {} is damaged: {}", path.string(), why);
  };
  if (size_ < kHeaderBytes + kFooterBytes) corrupt(fmt::format("only {} bytes", size_));
  uint8_t header[kHeaderBytes];
  uint8_t footer[kFooterBytes];
  pread_all(0, header, sizeof header);
  pread_all(size_ - kFooterBytes, footer, sizeof footer);
  if (std::memcmp(header, kShardMagic, 8) != 0) corrupt("bad magic (not a .dnc shard)");
  if (header[8] != kShardVersion)
    corrupt(fmt::format("format version {} (this build reads {})", header[8], kShardVersion));
  if (std::memcmp(footer + 32, kFooterMagic, 8) != 0)
    corrupt("footer missing (file truncated or not finished)");
  const uint64_t ioff = get_u64(footer), isize = get_u64(footer + 8);
  file_hash_ = get_u64(footer + 24);
  if (ioff < kHeaderBytes || ioff > size_ || isize > size_ || ioff + isize != size_ - kFooterBytes)
    corrupt("index position does not match the file size (truncated?)");
  std::string itext(isize, '\0');
  pread_all(ioff, itext.data(), isize);
  if (XXH64(itext.data(), itext.size(), 0) != get_u64(footer + 16))
    corrupt("index checksum mismatch");
  try {
    json index = json::parse(itext);
    for (const auto& jt : index.at("tensors")) {
      ShardTensor t;
      t.spec.name = jt.at("name").get<std::string>();
      t.spec.dtype = parse_dtype(jt.at("dtype").get<std::string>());
      t.spec.shape = jt.at("shape").get<std::vector<int64_t>>();
      t.begin = jt.at("begin").get<uint64_t>();
      t.end = jt.at("end").get<uint64_t>();
      if (t.begin > t.end || t.end > t.spec.numel())
        corrupt(fmt::format("range [{}, {}) of '{}' is outside its {} elements", t.begin, t.end,
                            t.spec.name, t.spec.numel()));
      for (const auto& c : jt.at("chunks")) {
        ChunkEntry ch;
        ch.offset = c.at(0).get<uint64_t>();
        ch.stored_size = c.at(1).get<uint64_t>();
        ch.elem_begin = c.at(2).get<uint64_t>();
        ch.elem_count = c.at(3).get<uint64_t>();
        ch.encoding = static_cast<ChunkEncoding>(c.at(4).get<int>());
        ch.xxh64 = c.at(5).get<uint64_t>();
        if (ch.offset > ioff || ch.stored_size > ioff - ch.offset || ch.elem_begin < t.begin ||
            ch.elem_count > t.end - ch.elem_begin)
          corrupt("chunk lies outside the data region or its tensor range");
        t.chunks.push_back(ch);
      }
      tensors_.push_back(std::move(t));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    corrupt(fmt::format("index unreadable: {}", e.what()));
  }
}

ShardFile::~ShardFile() {
  if (fd_ >= 0) ::close(fd_);
}

ShardFile::ShardFile(ShardFile&& o) noexcept
    : path_(std::move(o.path_)),
      fd_(o.fd_),
      size_(o.size_),
      file_hash_(o.file_hash_),
      tensors_(std::move(o.tensors_)) {
  o.fd_ = -1;
}

std::vector<const ShardTensor*> ShardFile::pieces(const std::string& name) const {
  std::vector<const ShardTensor*> out;
  for (const auto& t : tensors_)
    if (t.spec.name == name) out.push_back(&t);
  return out;
}

void ShardFile::pread_all(uint64_t offset, void* out, size_t size) const {
  auto* p = static_cast<uint8_t*>(out);
  while (size > 0) {
    ssize_t n = ::pread(fd_, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      fail(ExitCode::kCheckpointCorrupt, "reading checkpoint shard {} at offset {} failed: {}",
           path_.string(), offset, n == 0 ? "unexpected end of file" : errno_string());
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<size_t>(n);
  }
}

void ShardFile::read_chunk(const ShardTensor& t, size_t i, uint8_t* out) const {
  const ChunkEntry& c = t.chunks.at(i);
  std::vector<uint8_t> stored(c.stored_size);
  pread_all(c.offset, stored.data(), stored.size());
  const std::string where =
      fmt::format("checkpoint shard {} tensor '{}' chunk {}", path_.string(), t.spec.name, i);
  if (XXH64(stored.data(), stored.size(), 0) != c.xxh64)
    fail(ExitCode::kCheckpointCorrupt, "{}: checksum mismatch (file damaged)", where);
  decode_chunk(stored.data(), stored.size(), c.encoding, t.spec.dtype, out,
               c.elem_count * dtype_size(t.spec.dtype), where);
}

void ShardFile::read(const ShardTensor& t, uint64_t begin, uint64_t end, uint8_t* out,
                     int threads) const {
  DNALLM_CHECK(t.begin <= begin && begin <= end && end <= t.end, ExitCode::kFailure,
               "read [{}, {}) outside shard range [{}, {}) of '{}'", begin, end, t.begin, t.end,
               t.spec.name);
  const size_t es = dtype_size(t.spec.dtype);
  // One chunk: whole chunks decode in place, partial ones through a buffer.
  auto read_one = [this, &t, begin, end, es, out](size_t i) {
    const ChunkEntry& c = t.chunks[i];
    const uint64_t lo = std::max(begin, c.elem_begin);
    const uint64_t hi = std::min(end, c.elem_begin + c.elem_count);
    if (lo == c.elem_begin && hi == c.elem_begin + c.elem_count) {
      read_chunk(t, i, out + (lo - begin) * es);
      return;
    }
    std::vector<uint8_t> buf(c.elem_count * es);
    read_chunk(t, i, buf.data());
    std::memcpy(out + (lo - begin) * es, buf.data() + (lo - c.elem_begin) * es, (hi - lo) * es);
  };
  std::vector<size_t> wanted;
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const ChunkEntry& c = t.chunks[i];
    if (std::max(begin, c.elem_begin) < std::min(end, c.elem_begin + c.elem_count))
      wanted.push_back(i);
  }
  const size_t window = static_cast<size_t>(std::max(1, threads));
  if (window == 1 || wanted.size() <= 1) {
    for (size_t i : wanted) read_one(i);
    return;
  }
  std::vector<std::future<void>> jobs;
  for (size_t w0 = 0; w0 < wanted.size(); w0 += window) {
    jobs.clear();
    for (size_t k = w0; k < std::min(wanted.size(), w0 + window); ++k)
      jobs.push_back(std::async(std::launch::async, read_one, wanted[k]));
    std::exception_ptr first;
    for (auto& j : jobs) {  // join all before rethrowing the first error
      try {
        j.get();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }
}

void ShardFile::verify() const {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<uint8_t> buf(size_t{1} << 20);
  const uint64_t hashed = size_ - 16;
  try {
    for (uint64_t off = 0; off < hashed;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), hashed - off));
      pread_all(off, buf.data(), n);
      XXH64_update(st, buf.data(), n);
      off += n;
    }
  } catch (...) {
    XXH64_freeState(st);
    throw;
  }
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  // Name the damaged chunk first when there is one: it is the more useful message.
  for (const auto& t : tensors_) {
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const ChunkEntry& c = t.chunks[i];
      std::vector<uint8_t> stored(c.stored_size);
      pread_all(c.offset, stored.data(), stored.size());
      if (XXH64(stored.data(), stored.size(), 0) != c.xxh64)
        fail(ExitCode::kCheckpointCorrupt,
             "checkpoint shard {} tensor '{}' chunk {}: checksum mismatch (file damaged)",
             path_.string(), t.spec.name, i);
    }
  }
  if (h != file_hash_)
    fail(ExitCode::kCheckpointCorrupt, "checkpoint shard {}: file checksum mismatch",
         path_.string());
}

}  // namespace dnallm::checkpoint
