#include "worker/infer/embedding_writer.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/output_file.hpp"

namespace dnallm::infer {
namespace {

// Reserved header sizes (Note [Embedding files]): enough for any row count.
constexpr size_t kNpyHeaderBytes = 128;
constexpr size_t kSafetensorsHeaderBytes = 512;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::FILE* open_or_fail(const std::string& path, const char* mode) {
  std::FILE* f = std::fopen(path.c_str(), mode);
  DNALLM_CHECK(f != nullptr, ExitCode::kUsage,
               "cannot open {} ({}): check the directory exists "
               "and is writable",
               path, errno_string());
  return f;
}

// A failed write (a full disk) is the user's to fix: exit 2, as for every --out (Note [Outputs
// never inputs], core/output_file.cpp).
void write_or_fail(std::FILE* f, const void* data, size_t bytes, const std::string& path) {
  DNALLM_CHECK(bytes == 0 || std::fwrite(data, 1, bytes, f) == bytes, ExitCode::kUsage,
               "write to {} failed: {}", path, errno_string());
}

void close_file(std::FILE*& f, const std::string& path) {
  if (f == nullptr) return;
  const bool ok = std::fflush(f) == 0;
  std::fclose(f);
  f = nullptr;
  DNALLM_CHECK(ok, ExitCode::kUsage, "write to {} failed: {}", path, errno_string());
}

// NumPy format 1.0 header padded to exactly kNpyHeaderBytes.
std::string npy_header(const std::string& dtype, const std::vector<int64_t>& shape) {
  std::string dims;
  for (auto d : shape) dims += fmt::format("{}, ", d);
  if (shape.size() > 1) dims.resize(dims.size() - 2);  // "(n,)" for 1-D, "(n, m)" for 2-D
  std::string dict =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", dtype, dims);
  const size_t prefix = 10;  // magic(6) + version(2) + header length(2)
  DNALLM_CHECK(prefix + dict.size() + 1 <= kNpyHeaderBytes, ExitCode::kFailure,
               "npy header too long");
  dict.append(kNpyHeaderBytes - prefix - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(dict.size());
  out.push_back(static_cast<char>(len & 0xff));
  out.push_back(static_cast<char>(len >> 8));
  return out + dict;
}

std::string stem_of(const std::string& path) {
  if (ends_with(path, ".npy")) return path.substr(0, path.size() - 4);
  if (ends_with(path, ".safetensors")) return path.substr(0, path.size() - 12);
  return path;
}

void rename_or_fail(const std::string& from, const std::string& to) {
  std::error_code ec;
  std::filesystem::rename(from, to, ec);
  DNALLM_CHECK(!ec, ExitCode::kUsage, "cannot rename {} to {}: {}", from, to, ec.message());
}

}  // namespace

void check_embedding_out_name(const std::string& path) {
  DNALLM_CHECK(ends_with(path, ".safetensors") || ends_with(path, ".npy"), ExitCode::kUsage,
               "--out {}: name the output file *.npy or *.safetensors", path);
}

std::string ids_path(const std::string& path) { return stem_of(path) + ".ids.txt"; }
std::string offsets_path(const std::string& path) { return stem_of(path) + ".offsets.npy"; }

EmbeddingFileWriter::EmbeddingFileWriter(std::string path, int64_t dim, bool per_token)
    : path_(std::move(path)), dim_(dim), per_token_(per_token) {
  safetensors_ = ends_with(path_, ".safetensors");
  check_embedding_out_name(path_);
  DNALLM_CHECK(dim_ > 0, ExitCode::kFailure, "embedding dimension must be positive");
  // Never renamed over a device or a FIFO (Note [Outputs never inputs], core/output_file.cpp).
  require_regular_output(path_, "--out", kEmbeddingHeaderLast);
  require_regular_output(ids_path(path_), "--out's ids file", kEmbeddingHeaderLast);
  if (per_token_ && !safetensors_) {
    require_regular_output(offsets_path(path_), "--out's offsets file", kEmbeddingHeaderLast);
  }
  data_ = open_or_fail(path_ + ".tmp", "wb");
  ids_ = open_or_fail(ids_path(path_) + ".tmp", "wb");
  const std::string reserved(safetensors_ ? kSafetensorsHeaderBytes : kNpyHeaderBytes, ' ');
  write_or_fail(data_, reserved.data(), reserved.size(), path_);
  if (per_token_) {
    if (safetensors_) {
      st_offsets_.push_back(0);
    } else {
      offsets_ = open_or_fail(offsets_path(path_) + ".tmp", "wb");
      write_or_fail(offsets_, reserved.data(), kNpyHeaderBytes, offsets_path(path_));
      const int64_t zero = 0;
      write_or_fail(offsets_, &zero, sizeof zero, offsets_path(path_));
    }
  }
}

EmbeddingFileWriter::~EmbeddingFileWriter() {
  // Not closed (an error unwound): remove the .tmp files; never a truncated final file.
  for (auto* f : {data_, ids_, offsets_}) {
    if (f != nullptr) std::fclose(f);
  }
  if (closed_) return;
  std::error_code ec;
  for (const auto& p : {path_, ids_path(path_), offsets_path(path_)}) {
    std::filesystem::remove(p + ".tmp", ec);
  }
}

void EmbeddingFileWriter::append(const std::string& id, const float* values, int64_t rows) {
  DNALLM_CHECK(!closed_, ExitCode::kFailure, "append after close");
  DNALLM_CHECK(per_token_ || rows == 1, ExitCode::kFailure, "pooled embeddings are one row");
  write_or_fail(data_, values, static_cast<size_t>(rows * dim_) * sizeof(float), path_);
  const std::string line = id + "\n";
  write_or_fail(ids_, line.data(), line.size(), ids_path(path_));
  rows_ += rows;
  ++sequences_;
  if (per_token_) {
    if (safetensors_) {
      st_offsets_.push_back(rows_);
    } else {
      write_or_fail(offsets_, &rows_, sizeof rows_, offsets_path(path_));
    }
  }
}

void EmbeddingFileWriter::write_header() {
  std::string header;
  if (safetensors_) {
    const uint64_t emb_bytes = static_cast<uint64_t>(rows_ * dim_) * sizeof(float);
    nlohmann::ordered_json h;
    h["__metadata__"] = {{"format", "dnallm-embeddings"},
                         {"ids", ids_path(std::filesystem::path(path_).filename().string())}};
    h["embeddings"] = {{"dtype", safetensors_dtype_name(DType::kFloat32)},
                       {"shape", {rows_, dim_}},
                       {"data_offsets", {uint64_t{0}, emb_bytes}}};
    if (per_token_) {
      h["offsets"] = {{"dtype", safetensors_dtype_name(DType::kInt64)},
                      {"shape", {static_cast<int64_t>(st_offsets_.size())}},
                      {"data_offsets", {emb_bytes, emb_bytes + st_offsets_.size() * 8}}};
    }
    std::string text = h.dump();
    DNALLM_CHECK(text.size() + 8 <= kSafetensorsHeaderBytes, ExitCode::kFailure,
                 "safetensors header too long");
    text.append(kSafetensorsHeaderBytes - 8 - text.size(), ' ');
    uint64_t len = text.size();
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(len >> (8 * i));
    header.assign(reinterpret_cast<const char*>(le), 8);
    header += text;
  } else {
    header = npy_header("<f4", {rows_, dim_});
  }
  DNALLM_CHECK(std::fseek(data_, 0, SEEK_SET) == 0, ExitCode::kFailure, "seek in {}: {}", path_,
               errno_string());
  write_or_fail(data_, header.data(), header.size(), path_);
}

void EmbeddingFileWriter::close() {
  if (closed_) return;
  if (per_token_ && safetensors_) {
    DNALLM_CHECK(std::fseek(data_, 0, SEEK_END) == 0, ExitCode::kFailure, "seek in {}", path_);
    write_or_fail(data_, st_offsets_.data(), st_offsets_.size() * sizeof(int64_t), path_);
  }
  write_header();
  close_file(data_, path_);
  close_file(ids_, ids_path(path_));
  if (offsets_ != nullptr) {
    const std::string header = npy_header("<i8", {sequences_ + 1});
    DNALLM_CHECK(std::fseek(offsets_, 0, SEEK_SET) == 0, ExitCode::kFailure, "seek failed");
    write_or_fail(offsets_, header.data(), header.size(), offsets_path(path_));
    close_file(offsets_, offsets_path(path_));
  }
  // Every name is checked before the first rename (Note [Outputs never inputs] in
  // core/output_file.cpp): an existing directory would make a rename fail after the others.
  for (const auto& p : {path_, ids_path(path_), offsets_path(path_)}) {
    DNALLM_CHECK(!std::filesystem::is_directory(p), ExitCode::kUsage,
                 "{} is an existing directory: name another --out file", p);
  }
  if (per_token_ && !safetensors_)
    rename_or_fail(offsets_path(path_) + ".tmp", offsets_path(path_));
  rename_or_fail(ids_path(path_) + ".tmp", ids_path(path_));
  rename_or_fail(path_ + ".tmp", path_);
  closed_ = true;
}

EmbeddingPartWriter::EmbeddingPartWriter(std::string prefix, int64_t dim)
    : prefix_(std::move(prefix)), dim_(dim) {
  data_ = open_or_fail(prefix_ + ".f32", "wb");
  ids_ = open_or_fail(prefix_ + ".ids.txt", "wb");
  counts_ = open_or_fail(prefix_ + ".rows", "wb");
}

EmbeddingPartWriter::~EmbeddingPartWriter() {
  for (auto* f : {data_, ids_, counts_}) {
    if (f != nullptr) std::fclose(f);
  }
}

void EmbeddingPartWriter::append(const std::string& id, const float* values, int64_t rows) {
  write_or_fail(data_, values, static_cast<size_t>(rows * dim_) * sizeof(float), prefix_);
  const std::string line = id + "\n";
  write_or_fail(ids_, line.data(), line.size(), prefix_);
  write_or_fail(counts_, &rows, sizeof rows, prefix_);
}

void EmbeddingPartWriter::close() {
  close_file(data_, prefix_ + ".f32");
  close_file(ids_, prefix_ + ".ids.txt");
  close_file(counts_, prefix_ + ".rows");
}

void merge_embedding_parts(const std::vector<std::string>& prefixes, int64_t dim,
                           EmbeddingSink& out) {
  std::vector<float> buffer;
  for (const auto& prefix : prefixes) {
    std::ifstream data(prefix + ".f32", std::ios::binary);
    std::ifstream ids(prefix + ".ids.txt");
    std::ifstream counts(prefix + ".rows", std::ios::binary);
    DNALLM_CHECK(data.good() && ids.good() && counts.good(), ExitCode::kPeerFailed,
                 "embedding part {}.* is missing: the rank that wrote it failed or the output "
                 "directory is not shared by all ranks",
                 prefix);
    int64_t rows = 0;
    std::string id;
    while (counts.read(reinterpret_cast<char*>(&rows), sizeof rows)) {
      DNALLM_CHECK(std::getline(ids, id).good() && rows >= 0, ExitCode::kPeerFailed,
                   "embedding part {} is inconsistent (ids and row counts differ)", prefix);
      buffer.resize(static_cast<size_t>(rows * dim));
      data.read(reinterpret_cast<char*>(buffer.data()),
                static_cast<std::streamsize>(buffer.size() * sizeof(float)));
      DNALLM_CHECK(data.good() || buffer.empty(), ExitCode::kPeerFailed,
                   "embedding part {}.f32 is truncated", prefix);
      out.append(id, buffer.data(), rows);
    }
    for (const char* ext : {".f32", ".ids.txt", ".rows"}) std::filesystem::remove(prefix + ext);
  }
}

NpyArray read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DNALLM_CHECK(f.good(), ExitCode::kBadData, "cannot open {}", path);
  char prefix[10];
  f.read(prefix, 10);
  DNALLM_CHECK(f.good() && std::memcmp(prefix, "\x93NUMPY", 6) == 0, ExitCode::kBadData,
               "{} is not a .npy file", path);
  const size_t len = static_cast<unsigned char>(prefix[8]) |
                     (static_cast<size_t>(static_cast<unsigned char>(prefix[9])) << 8);
  std::string dict(len, '\0');
  f.read(dict.data(), static_cast<std::streamsize>(len));
  NpyArray out;
  const auto d = dict.find("'descr': '");
  DNALLM_CHECK(d != std::string::npos, ExitCode::kBadData, "{}: no descr", path);
  out.dtype = dict.substr(d + 10, 3);
  const auto s = dict.find("'shape': (");
  DNALLM_CHECK(s != std::string::npos, ExitCode::kBadData, "{}: no shape", path);
  const auto e = dict.find(')', s);
  std::string dims = dict.substr(s + 10, e - s - 10);
  size_t pos = 0;
  int64_t count = 1;
  while (pos < dims.size()) {
    const auto comma = dims.find(',', pos);
    const std::string tok =
        dims.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (tok.find_first_not_of(' ') != std::string::npos) {
      out.shape.push_back(std::stoll(tok));
      count *= out.shape.back();
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  const size_t item = out.dtype == "<i8" ? 8 : 4;
  out.data.resize(static_cast<size_t>(count) * item);
  f.read(out.data.data(), static_cast<std::streamsize>(out.data.size()));
  DNALLM_CHECK(f.good() || out.data.empty(), ExitCode::kBadData, "{} is truncated", path);
  return out;
}

}  // namespace dnallm::infer
