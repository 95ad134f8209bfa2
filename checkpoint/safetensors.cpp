#include "checkpoint/safetensors.hpp"

#include <algorithm>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/train_state.hpp"
#include "core/error.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

DType parse_entry_dtype(const std::string& s, const std::string& where) {
  const auto t = dtype_from_safetensors_name(s);
  if (!t) fail(ExitCode::kBadData, "{}: unsupported safetensors dtype '{}'", where, s);
  return *t;
}

SafetensorsEntry parse_entry(const std::string& name, const json& info, const std::string& where) {
  SafetensorsEntry e;
  e.spec.name = name;
  e.spec.dtype = parse_entry_dtype(info.at("dtype").get<std::string>(), where);
  e.spec.shape = info.at("shape").get<std::vector<int64_t>>();
  const auto& offsets = info.at("data_offsets");
  DNALLM_CHECK(offsets.size() == 2, ExitCode::kBadData,
               "{}: tensor '{}' needs data_offsets [begin, end]", where, name);
  e.data_begin = offsets.at(0).get<uint64_t>();
  e.data_end = offsets.at(1).get<uint64_t>();
  return e;
}

// The 8-byte length and the JSON text after it; Error(kBadData) when they cannot be.
std::string read_header_text(std::ifstream& in, const fs::path& path, uint64_t file_size) {
  uint8_t len_bytes[8] = {};
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (!in || file_size < 8 || len > file_size - 8 || len > kMaxHeaderBytes)
    fail(ExitCode::kBadData, "{} is not a safetensors file (header length {})", path.string(), len);
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  return text;
}

SafetensorsFile parse_header(std::ifstream& in, const fs::path& path) {
  const auto file_size = fs::file_size(path);
  const std::string text = read_header_text(in, path, file_size);
  SafetensorsFile f;
  f.data_offset = 8 + text.size();
  try {
    const json h = json::parse(text);
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it->begin(); m != it->end(); ++m) f.metadata[m.key()] = m->get<std::string>();
        continue;
      }
      SafetensorsEntry e = parse_entry(it.key(), *it, path.string());
      if (e.data_end < e.data_begin ||
          e.data_end - e.data_begin != e.spec.numel() * dtype_size(e.spec.dtype) ||
          f.data_offset + e.data_end > file_size)
        fail(ExitCode::kBadData, "{}: tensor '{}' has inconsistent data offsets", path.string(),
             e.spec.name);
      f.tensors[e.spec.name] = e;
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(ExitCode::kBadData, "{}: bad safetensors header: {}", path.string(), e.what());
  }
  return f;
}

std::ifstream open_for_reading(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ExitCode::kBadData, "cannot open {}: {}", path.string(), errno_string());
  return in;
}

uint64_t byte_size(const SafetensorsTensor& t) {
  uint64_t n = 1;
  for (auto d : t.shape) n *= static_cast<uint64_t>(d);
  return n * dtype_size(t.dtype);
}

// The header text, padded with spaces to a multiple of 8 bytes.
std::string header_text(const std::vector<SafetensorsTensor>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const uint64_t bytes = byte_size(t);
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  return text;
}

void write_safetensors_to(OutFile& f, const std::vector<SafetensorsTensor>& tensors,
                          const std::string& header, const fs::path& path) {
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{header.size()} >> (8 * i));
  f.write(len, 8);
  f.write(header.data(), header.size());
  for (const auto& t : tensors) {
    const uint64_t before = f.written();
    t.write_data([&f](const void* data, size_t bytes) { f.write(data, bytes); });
    DNALLM_CHECK(f.written() - before == byte_size(t), ExitCode::kFailure,
                 "{}: tensor '{}' produced {} bytes, its shape and dtype need {}", path.string(),
                 t.name, f.written() - before, byte_size(t));
  }
  f.sync();
  f.close();
}

void write_json_file(const fs::path& path, const nlohmann::ordered_json& j) {
  write_file_durable(path, j.dump(2) + "\n");
}

}  // namespace

SafetensorsFile read_safetensors_header(const fs::path& path) {
  std::ifstream in = open_for_reading(path);
  return parse_header(in, path);
}

SafetensorsReader::SafetensorsReader(const fs::path& path)
    : path_(path), in_(open_for_reading(path)) {
  file_ = parse_header(in_, path_);
}

void SafetensorsReader::read(const SafetensorsEntry& entry, void* dst) {
  in_.seekg(static_cast<std::streamoff>(file_.data_offset + entry.data_begin));
  in_.read(static_cast<char*>(dst),
           static_cast<std::streamsize>(entry.data_end - entry.data_begin));
  DNALLM_CHECK(in_.good(), ExitCode::kBadData, "{}: truncated data for tensor '{}'", path_.string(),
               entry.spec.name);
}

void write_safetensors(const fs::path& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string header = header_text(tensors, metadata);
  fs::path tmp = path;
  tmp += ".tmp";
  try {
    OutFile f(tmp);
    write_safetensors_to(f, tensors, header, path);
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);  // no *.tmp left behind by a failed write
    throw;
  }
  fs::rename(tmp, path);
  fsync_dir(path.has_parent_path() ? path.parent_path() : fs::path("."));
}

fs::path write_model_directory(const fs::path& dir, const ModelDirectory& model) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  DNALLM_CHECK(!ec, ExitCode::kFailure, "cannot create the model directory {}: {}", dir.string(),
               ec.message());
  if (!model.adapters.empty())
    write_safetensors(dir / "adapter_model.safetensors", model.adapters, model.adapters_metadata);
  const fs::path weights = dir / "model.safetensors";
  write_safetensors(weights, model.weights, model.weights_metadata);
  if (model.config) write_json_file(dir / "config.json", *model.config);
  if (model.tokenizer) write_json_file(dir / "tokenizer.json", *model.tokenizer);
  fsync_dir(dir);
  return weights;
}

namespace {

// What an export from a checkpoint writes: `numel` elements of `source` from `begin`.
struct StoredRange {
  std::string source;
  uint64_t begin = 0;
  uint64_t numel = 0;
};

SafetensorsTensor stored_tensor(const CheckpointReader& ckpt, std::string name, DType dtype,
                                std::vector<int64_t> shape, StoredRange range) {
  SafetensorsTensor t{std::move(name), dtype, std::move(shape), nullptr};
  t.write_data = [&ckpt, dtype, range](const ByteSink& sink) {
    const size_t es = dtype_size(dtype);
    const uint64_t piece = std::max<uint64_t>(1, (uint64_t{64} << 20) / es);
    std::vector<uint8_t> buf;
    for (uint64_t b = 0; b < range.numel; b += piece) {
      const uint64_t e = std::min(range.numel, b + piece);
      buf.resize((e - b) * es);
      ckpt.read_range(range.source, range.begin + b, range.begin + e, buf.data());
      sink(buf.data(), buf.size());
    }
  };
  return t;
}

// The tensors to export (Note [Flat parameter exports]).
std::vector<SafetensorsTensor> checkpoint_weights(const CheckpointReader& ckpt,
                                                  const ModelInfo& info) {
  const Manifest& m = ckpt.manifest();
  std::vector<SafetensorsTensor> out;
  const TensorSpec* flat = nullptr;
  for (const auto& t : m.tensors) {
    if (t.name == kFlatParameters) flat = &t;
  }
  if (flat != nullptr && info.layout) {
    for (const auto& e : *info.layout) {
      const auto numel = static_cast<uint64_t>(e.numel());
      const auto offset = static_cast<uint64_t>(e.offset);
      DNALLM_CHECK(e.offset >= 0 && offset + numel <= flat->numel(), ExitCode::kCheckpointCorrupt,
                   "{}: state.layout entry {} lies outside {}", ckpt.dir().string(), e.name,
                   kFlatParameters);
      out.push_back(stored_tensor(ckpt, e.name, flat->dtype, e.shape, {flat->name, offset, numel}));
    }
  } else {
    for (const auto& t : m.tensors)
      out.push_back(stored_tensor(ckpt, t.name, t.dtype, t.shape, {t.name, 0, t.numel()}));
  }
  return out;
}

}  // namespace

fs::path export_checkpoint_model(const CheckpointReader& ckpt, const fs::path& out_dir) {
  const Manifest& m = ckpt.manifest();
  std::error_code ec;
  DNALLM_CHECK(!fs::exists(out_dir, ec) || fs::is_directory(out_dir, ec), ExitCode::kUsage,
               "export --out {}: it exists and is not a directory; name a directory (created if "
               "missing)",
               out_dir.string());
  fs::create_directories(out_dir, ec);
  DNALLM_CHECK(!ec, ExitCode::kUsage, "export --out {}: cannot create the directory: {}",
               out_dir.string(), ec.message());
  ModelDirectory model;
  const ModelInfo info = read_model_info(ckpt);
  model.weights = checkpoint_weights(ckpt, info);
  model.weights_metadata = {
      {"format", "pt"}, {"step", std::to_string(m.step)}, {"producer", "dnallm-ckpt"}};
  if (info.config) model.config = *info.config;
  if (info.tokenizer) model.tokenizer = *info.tokenizer;
  return write_model_directory(out_dir, model);
}

}  // namespace dnallm::checkpoint
