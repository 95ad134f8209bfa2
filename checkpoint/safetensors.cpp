#include "checkpoint/safetensors.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/train_state.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Note [Untrusted files] (core/untrusted_file.hpp): a safetensors file may come from anywhere,
// so its header is checked before anything is allocated from it: the length bounded, every
// entry's dtype known, every dimension non-negative, shape x dtype size computed without
// overflow and equal to its byte range, every range inside the file, ranges not overlapping,
// no name twice. Damage is Error(kCheckpointCorrupt) naming the file and the tensor.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr ExitCode kDamaged = ExitCode::kCheckpointCorrupt;

DType parse_entry_dtype(const json& info, const std::string& where, const std::string& name) {
  DNALLM_CHECK(info.contains("dtype") && info["dtype"].is_string(), kDamaged,
               "{}: tensor '{}' has no dtype: the file is damaged", where, clip_for_message(name));
  const std::string s = info["dtype"].get<std::string>();
  const auto t = dtype_from_safetensors_name(s);
  if (!t) {
    fail(kDamaged, "{}: tensor '{}' has the unsupported safetensors dtype '{}'", where,
         clip_for_message(name), clip_for_message(s));
  }
  return *t;
}

// numel x dtype size of `e`, or nullopt when it overflows 64 bits.
std::optional<uint64_t> byte_count(const SafetensorsEntry& e) {
  uint64_t n = dtype_size(e.spec.dtype);
  for (int64_t d : e.spec.shape) {
    const auto u = static_cast<uint64_t>(d);
    if (u != 0 && n > std::numeric_limits<uint64_t>::max() / u) return std::nullopt;
    n *= u;
  }
  return n;
}

SafetensorsEntry parse_entry(const std::string& name, const json& info, const std::string& where) {
  const std::string quoted = clip_for_message(name);
  DNALLM_CHECK(info.is_object(), kDamaged, "{}: entry '{}' is not an object: the file is damaged",
               where, quoted);
  SafetensorsEntry e;
  e.spec.name = name;
  e.spec.dtype = parse_entry_dtype(info, where, name);
  DNALLM_CHECK(info.contains("shape") && info["shape"].is_array() && info["shape"].size() <= 16,
               kDamaged, "{}: tensor '{}' needs a shape of at most 16 dimensions", where, quoted);
  for (const auto& d : info["shape"]) {
    DNALLM_CHECK(
        d.is_number_integer() && (d.is_number_unsigned() ? d.get<uint64_t>() <= uint64_t{1} << 62
                                                         : d.get<int64_t>() >= 0),
        kDamaged, "{}: tensor '{}' has the dimension {}: dimensions are integers >= 0", where,
        quoted, clip_for_message(d.dump()));
    e.spec.shape.push_back(d.get<int64_t>());
  }
  DNALLM_CHECK(
      info.contains("data_offsets") && info["data_offsets"].is_array() &&
          info["data_offsets"].size() == 2 && info["data_offsets"][0].is_number_unsigned() &&
          info["data_offsets"][1].is_number_unsigned(),
      kDamaged, "{}: tensor '{}' needs data_offsets [begin, end] (integers >= 0)", where, quoted);
  e.data_begin = info["data_offsets"][0].get<uint64_t>();
  e.data_end = info["data_offsets"][1].get<uint64_t>();
  return e;
}

// The 8-byte length and the JSON text after it; Error(kCheckpointCorrupt) when they cannot be.
std::string read_header_text(std::ifstream& in, const fs::path& path, uint64_t file_size) {
  uint8_t len_bytes[8] = {};
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (!in || file_size < 8 || len > file_size - 8 || len > kMaxHeaderBytes)
    fail(kDamaged,
         "{} is not a safetensors file (header length {}, file size {}): the file is "
         "damaged or of another format",
         path.string(), len, file_size);
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  if (!in) fail(kDamaged, "{}: truncated safetensors header", path.string());
  return text;
}

SafetensorsFile parse_header(std::ifstream& in, const fs::path& path) {
  const auto file_size = check_regular_file(path.string(), kDamaged, "safetensors file");
  const std::string text = read_header_text(in, path, file_size);
  SafetensorsFile f;
  f.data_offset = 8 + text.size();
  const uint64_t data_bytes = file_size - f.data_offset;
  // Duplicate names are refused by the strict parser (nlohmann would keep the last).
  const json h = parse_json_strict(text, path.string() + " (safetensors header)", kDamaged);
  DNALLM_CHECK(h.is_object(), kDamaged, "{}: the safetensors header is not a JSON object",
               path.string());
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      DNALLM_CHECK(it->is_object(), kDamaged, "{}: __metadata__ is not an object", path.string());
      for (auto m = it->begin(); m != it->end(); ++m) {
        DNALLM_CHECK(m->is_string(), kDamaged, "{}: __metadata__.{} is not a string", path.string(),
                     clip_for_message(m.key()));
        f.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e = parse_entry(it.key(), *it, path.string());
    const auto bytes = byte_count(e);
    if (e.data_end < e.data_begin || e.data_end > data_bytes || !bytes ||
        e.data_end - e.data_begin != *bytes) {
      fail(kDamaged,
           "{}: tensor '{}' ({} {}) has data_offsets [{}, {}], which do not match its shape and "
           "dtype or lie past the end of the file ({} data bytes): the file is damaged",
           path.string(), clip_for_message(e.spec.name), safetensors_dtype_name(e.spec.dtype),
           clip_for_message(json(e.spec.shape).dump()), e.data_begin, e.data_end, data_bytes);
    }
    if (e.data_end > e.data_begin) ranges.emplace_back(e.data_begin, e.data_end);
    f.tensors[e.spec.name] = e;
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      std::string a, b;
      for (const auto& [name, e] : f.tensors) {
        if (e.data_begin == ranges[i - 1].first && e.data_end == ranges[i - 1].second && a.empty())
          a = name;
        else if (e.data_begin == ranges[i].first && e.data_end == ranges[i].second && b.empty())
          b = name;
      }
      fail(kDamaged,
           "{}: tensors '{}' and '{}' share bytes (data_offsets [{}, {}] and [{}, {}] overlap): "
           "the file is damaged",
           path.string(), clip_for_message(a), clip_for_message(b), ranges[i - 1].first,
           ranges[i - 1].second, ranges[i].first, ranges[i].second);
    }
  }
  return f;
}

std::ifstream open_for_reading(const fs::path& path) {
  check_regular_file(path.string(), kDamaged, "safetensors file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(kDamaged, "cannot open {}: {}", path.string(), errno_string());
  return in;
}

uint64_t byte_size(const TensorSpec& t) { return t.numel() * dtype_size(t.dtype); }

// The header text, padded with spaces to a multiple of 8 bytes.
std::string header_text(const std::vector<TensorSpec>& tensors,
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
  DNALLM_CHECK(in_.good(), kDamaged, "{}: truncated data for tensor '{}'", path_.string(),
               clip_for_message(entry.spec.name));
}

SafetensorsWriter::SafetensorsWriter(fs::path path, std::vector<TensorSpec> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tensors_(std::move(tensors)), written_(tensors_.size(), false) {
  tmp_ = path_;
  tmp_ += ".tmp";
  const std::string header = header_text(tensors_, metadata);
  uint64_t offset = 8 + header.size();
  for (const auto& t : tensors_) {
    offsets_.push_back(offset);
    offset += byte_size(t);
  }
  try {
    file_ = std::make_unique<OutFile>(tmp_);
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{header.size()} >> (8 * i));
    file_->write(len, 8);
    file_->write(header.data(), header.size());
  } catch (...) {
    file_.reset();
    std::error_code ec;
    fs::remove(tmp_, ec);
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!file_) return;  // committed
  file_.reset();
  std::error_code ec;
  fs::remove(tmp_, ec);  // no *.tmp left behind by a failed write
}

void SafetensorsWriter::write(size_t index,
                              const std::function<void(const ByteSink&)>& write_data) {
  DNALLM_CHECK(file_ != nullptr && index < tensors_.size() && !written_[index], ExitCode::kFailure,
               "internal: {}: tensor {} of {} written twice, out of range or after commit",
               path_.string(), index, tensors_.size());
  const TensorSpec& t = tensors_[index];
  const uint64_t want = byte_size(t);
  uint64_t got = 0;
  write_data([&](const void* data, size_t bytes) {
    DNALLM_CHECK(got + bytes <= want, ExitCode::kFailure,
                 "{}: tensor '{}' produced more than the {} bytes its shape and dtype need",
                 path_.string(), t.name, want);
    file_->write_at(offsets_[index] + got, data, bytes);
    got += bytes;
  });
  DNALLM_CHECK(got == want, ExitCode::kFailure,
               "{}: tensor '{}' produced {} bytes, its shape and dtype need {}", path_.string(),
               t.name, got, want);
  written_[index] = true;
}

void SafetensorsWriter::commit() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    DNALLM_CHECK(written_[i], ExitCode::kFailure, "internal: {}: tensor '{}' was never written",
                 path_.string(), tensors_[i].name);
  }
  file_->sync();
  file_->close();
  file_.reset();  // from here the destructor leaves <path>.tmp alone
  try {
    DNALLM_WRITECHECK(::rename(tmp_.c_str(), path_.c_str()), path_.string());
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp_, ec);
    throw;
  }
  fsync_dir(path_.has_parent_path() ? path_.parent_path() : fs::path("."));
}

void write_safetensors(const fs::path& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  SafetensorsWriter writer(path, std::move(specs), metadata);
  for (size_t i = 0; i < tensors.size(); ++i) writer.write(i, tensors[i].write_data);
  writer.commit();
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
  if (model.config) write_json_durable(dir / "config.json", *model.config);
  if (model.tokenizer) write_json_durable(dir / "tokenizer.json", *model.tokenizer);
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
