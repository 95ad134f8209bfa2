#include "checkpoint/safetensors.hpp"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "checkpoint/durable_io.hpp"
#include "checkpoint/train_state.hpp"
#include "core/error.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "F32";
    case DType::kFloat64:
      return "F64";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
    case DType::kInt64:
      return "I64";
    case DType::kInt32:
      return "I32";
    case DType::kUInt8:
      return "U8";
    case DType::kInt8:
      return "I8";
  }
  return "?";
}

namespace {
DType from_safetensors_dtype(const std::string& s, const std::string& where) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                  DType::kInt64, DType::kInt32, DType::kUInt8, DType::kInt8})
    if (s == safetensors_dtype(t)) return t;
  fail(ExitCode::kBadData, "{}: unsupported safetensors dtype '{}'", where, s);
}
}  // namespace

SafetensorsFile read_safetensors_header(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ExitCode::kBadData, "cannot open {}", path.string());
  uint8_t len_bytes[8] = {};
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  const auto file_size = fs::file_size(path);
  if (!in || len > file_size - 8 || len > (uint64_t{100} << 20))
    fail(ExitCode::kBadData, "{} is not a safetensors file (header length {})", path.string(), len);
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  SafetensorsFile f;
  f.data_offset = 8 + len;
  try {
    json h = json::parse(text);
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it->begin(); m != it->end(); ++m) f.metadata[m.key()] = m->get<std::string>();
        continue;
      }
      SafetensorsEntry e;
      e.spec.name = it.key();
      e.spec.dtype = from_safetensors_dtype(it->at("dtype").get<std::string>(), path.string());
      e.spec.shape = it->at("shape").get<std::vector<int64_t>>();
      e.data_begin = it->at("data_offsets").at(0).get<uint64_t>();
      e.data_end = it->at("data_offsets").at(1).get<uint64_t>();
      if (e.data_end - e.data_begin != e.spec.numel() * dtype_size(e.spec.dtype) ||
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

fs::path export_model(const CheckpointReader& ckpt, const fs::path& out_dir) {
  const Manifest& m = ckpt.manifest();
  std::error_code ec;
  DNALLM_CHECK(!fs::exists(out_dir, ec) || fs::is_directory(out_dir, ec), ExitCode::kUsage,
               "export --out {}: it exists and is not a directory; name a directory (created if "
               "missing)",
               out_dir.string());
  fs::create_directories(out_dir, ec);
  DNALLM_CHECK(!ec, ExitCode::kUsage, "export --out {}: cannot create the directory: {}",
               out_dir.string(), ec.message());
  // safetensors keeps header keys sorted when it writes; we keep manifest order for data
  // and let the JSON object be sorted (nlohmann::json default), which readers accept.
  // What to write: (name, dtype, shape, source tensor, first element in it).
  // See Note [Flat parameter exports].
  struct Item {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::string source;
    uint64_t begin;
    uint64_t numel;
  };
  std::vector<Item> items;
  const TensorSpec* flat = nullptr;
  for (const auto& t : m.tensors) {
    if (t.name == kFlatParameters) flat = &t;
  }
  const ModelInfo info = read_model_info(ckpt);
  if (flat != nullptr && info.layout) {
    for (const auto& e : *info.layout) {
      const auto numel = static_cast<uint64_t>(e.numel());
      const auto offset = static_cast<uint64_t>(e.offset);
      DNALLM_CHECK(e.offset >= 0 && offset + numel <= flat->numel(), ExitCode::kCheckpointCorrupt,
                   "{}: state.layout entry {} lies outside {}", ckpt.dir().string(), e.name,
                   kFlatParameters);
      items.push_back({e.name, flat->dtype, e.shape, flat->name, offset, numel});
    }
  } else {
    for (const auto& t : m.tensors)
      items.push_back({t.name, t.dtype, t.shape, t.name, 0, t.numel()});
  }
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& t : items) {
    const uint64_t bytes = t.numel * dtype_size(t.dtype);
    header[t.name] = {{"dtype", safetensors_dtype(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {
      {"format", "pt"}, {"step", std::to_string(m.step)}, {"producer", "dnallm-ckpt"}};
  std::string htext = header.dump();
  while ((8 + htext.size()) % 8 != 0) htext.push_back(' ');  // align the data section
  const fs::path path = out_dir / "model.safetensors";
  const fs::path tmp = out_dir / "model.safetensors.tmp";
  try {
    OutFile f(tmp);
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(htext.size() >> (8 * i));
    f.write(len, 8);
    f.write(htext.data(), htext.size());
    std::vector<uint8_t> buf;
    for (const auto& t : items) {
      const size_t es = dtype_size(t.dtype);
      const uint64_t piece = std::max<uint64_t>(1, (uint64_t{64} << 20) / es);
      for (uint64_t b = 0; b < t.numel; b += piece) {
        const uint64_t e = std::min(t.numel, b + piece);
        buf.resize((e - b) * es);
        ckpt.read_range(t.source, t.begin + b, t.begin + e, buf.data());
        f.write(buf.data(), buf.size());
      }
    }
    f.sync();
    f.close();
  } catch (...) {
    fs::remove(tmp, ec);  // no *.tmp left behind by a failed export
    throw;
  }
  fs::rename(tmp, path);
  if (info.config) write_file_durable(out_dir / "config.json", info.config->dump(2) + "\n");
  if (info.tokenizer) {
    write_file_durable(out_dir / "tokenizer.json", info.tokenizer->dump(2) + "\n");
  }
  fsync_dir(out_dir);
  return path;
}

}  // namespace dnallm::checkpoint
