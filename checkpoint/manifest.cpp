#include "checkpoint/manifest.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "checkpoint/codec.hpp"
#include "checkpoint/durable_io.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json spec_json(const TensorSpec& s) {
  return {{"name", s.name}, {"dtype", dtype_name(s.dtype)}, {"shape", s.shape}};
}
TensorSpec spec_from(const json& j) {
  TensorSpec s;
  s.name = j.at("name").get<std::string>();
  s.dtype = parse_dtype(j.at("dtype").get<std::string>());
  s.shape = j.at("shape").get<std::vector<int64_t>>();
  return s;
}

}  // namespace

const TensorSpec* Manifest::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

json Manifest::to_json() const {
  json j;
  j["format"] = "dnallm-checkpoint";
  j["version"] = kManifestVersion;
  j["step"] = step;
  j["world_size"] = world_size;
  j["zero_stage"] = zero_stage;
  json jt = json::array();
  for (const auto& t : tensors) jt.push_back(spec_json(t));
  j["tensors"] = std::move(jt);
  json js = json::array();
  for (const auto& s : shards) {
    json ranges = json::array();
    for (const auto& r : s.ranges)
      ranges.push_back({{"tensor", r.tensor}, {"begin", r.begin}, {"end", r.end}});
    js.push_back({{"rank", s.rank},
                  {"file", s.file},
                  {"bytes", s.bytes},
                  {"xxh64", fmt::format("{:016x}", s.xxh64)},
                  {"ranges", std::move(ranges)}});
  }
  j["shards"] = std::move(js);
  j["state"] = state;
  return j;
}

Manifest Manifest::from_json(const json& j, const std::string& where) {
  Manifest m;
  try {
    if (j.at("format").get<std::string>() != "dnallm-checkpoint")
      fail(ExitCode::kCheckpointCorrupt, "{} is not a dnallm checkpoint manifest", where);
    const int version = j.at("version").get<int>();
    if (version != kManifestVersion)
      fail(ExitCode::kCheckpointCorrupt, "{} has manifest version {}; this build reads {}", where,
           version, kManifestVersion);
    m.step = j.at("step").get<int64_t>();
    m.world_size = j.at("world_size").get<int>();
    m.zero_stage = j.at("zero_stage").get<int>();
    for (const auto& t : j.at("tensors")) m.tensors.push_back(spec_from(t));
    for (const auto& s : j.at("shards")) {
      ShardDescriptor d;
      d.rank = s.at("rank").get<int>();
      d.file = s.at("file").get<std::string>();
      d.bytes = s.at("bytes").get<uint64_t>();
      d.xxh64 = std::stoull(s.at("xxh64").get<std::string>(), nullptr, 16);
      for (const auto& r : s.at("ranges")) {
        ShardRange sr{r.at("tensor").get<std::string>(), r.at("begin").get<uint64_t>(),
                      r.at("end").get<uint64_t>()};
        const TensorSpec* spec = m.find(sr.tensor);
        if (!spec || sr.begin > sr.end || sr.end > spec->numel())
          fail(ExitCode::kCheckpointCorrupt, "{}: shard {} range of '{}' is not in the layout",
               where, d.rank, sr.tensor);
        d.tensors.push_back(*spec);
        d.ranges.push_back(std::move(sr));
      }
      m.shards.push_back(std::move(d));
    }
    if (j.contains("state")) m.state = j.at("state");
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(ExitCode::kCheckpointCorrupt, "{} is malformed: {}", where, e.what());
  }
  if (static_cast<int>(m.shards.size()) != m.world_size)
    fail(ExitCode::kCheckpointCorrupt, "{} lists {} shards for world size {}", where,
         m.shards.size(), m.world_size);
  for (int r = 0; r < m.world_size; ++r)
    if (m.shards[r].rank != r)
      fail(ExitCode::kCheckpointCorrupt, "{}: shard {} is recorded as rank {}", where, r,
           m.shards[r].rank);
  return m;
}

json descriptor_to_json(const ShardDescriptor& d) {
  json tensors = json::array(), ranges = json::array();
  for (const auto& t : d.tensors) tensors.push_back(spec_json(t));
  for (const auto& r : d.ranges)
    ranges.push_back({{"tensor", r.tensor}, {"begin", r.begin}, {"end", r.end}});
  return {{"rank", d.rank},   {"file", d.file},     {"bytes", d.bytes},
          {"xxh64", d.xxh64}, {"tensors", tensors}, {"ranges", ranges}};
}

ShardDescriptor descriptor_from_json(const json& j) {
  ShardDescriptor d;
  try {
    d.rank = j.at("rank").get<int>();
    d.file = j.at("file").get<std::string>();
    d.bytes = j.at("bytes").get<uint64_t>();
    d.xxh64 = j.at("xxh64").get<uint64_t>();
    for (const auto& t : j.at("tensors")) d.tensors.push_back(spec_from(t));
    for (const auto& r : j.at("ranges"))
      d.ranges.push_back({r.at("tensor").get<std::string>(), r.at("begin").get<uint64_t>(),
                          r.at("end").get<uint64_t>()});
  } catch (const std::exception& e) {
    fail(ExitCode::kBadData, "malformed shard descriptor {}: {}", j.dump(), e.what());
  }
  if (d.tensors.size() != d.ranges.size())
    fail(ExitCode::kBadData, "malformed shard descriptor {}: tensors and ranges differ", j.dump());
  return d;
}

std::string step_dir_name(int64_t step) { return fmt::format("step_{:09d}", step); }

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  if (name.size() > 5 + 18) return std::nullopt;
  return std::stoll(name.substr(5));
}

void commit_step(const fs::path& root, const CommitInfo& info,
                 std::vector<ShardDescriptor> shards) {
  const fs::path dir = root / step_dir_name(info.step);
  DNALLM_CHECK(static_cast<int>(shards.size()) == info.world_size, ExitCode::kUsage,
               "commit of step {}: {} shard descriptors for world size {}", info.step,
               shards.size(), info.world_size);
  std::sort(shards.begin(), shards.end(),
            [](const ShardDescriptor& a, const ShardDescriptor& b) { return a.rank < b.rank; });
  Manifest m;
  m.step = info.step;
  m.world_size = info.world_size;
  m.zero_stage = info.zero_stage;
  m.state = info.state;
  for (int r = 0; r < info.world_size; ++r) {
    const ShardDescriptor& d = shards[r];
    DNALLM_CHECK(d.rank == r, ExitCode::kUsage, "commit of step {}: no shard from rank {}",
                 info.step, r);
    DNALLM_CHECK(d.tensors.size() == d.ranges.size(), ExitCode::kUsage,
                 "commit of step {}: rank {} descriptor is inconsistent", info.step, r);
    for (const auto& spec : d.tensors) {
      const TensorSpec* have = m.find(spec.name);
      if (!have) {
        m.tensors.push_back(spec);
      } else {
        DNALLM_CHECK(*have == spec, ExitCode::kUsage,
                     "commit of step {}: ranks disagree on dtype/shape of tensor '{}'", info.step,
                     spec.name);
      }
    }
    std::error_code ec;
    const auto size = fs::file_size(dir / d.file, ec);
    if (ec || size != d.bytes)
      fail(ExitCode::kCheckpointCorrupt,
           "commit of step {}: shard {} is {} (expected {} bytes); not committing", info.step,
           (dir / d.file).string(), ec ? ec.message() : fmt::format("{} bytes", size), d.bytes);
  }
  m.shards = std::move(shards);
  write_file_durable(dir / kManifestName, m.to_json().dump(1) + "\n");
  write_file_durable(root / kLatestName, step_dir_name(info.step) + "\n");
  // Step 5: leftovers of crashed saves that are older than this commit.
  for (const auto& entry : fs::directory_iterator(root)) {
    auto s = parse_step_dir_name(entry.path().filename().string());
    if (!s || *s >= info.step || !entry.is_directory()) continue;
    if (fs::exists(entry.path() / kManifestName)) continue;
    std::error_code ec;
    fs::remove_all(entry.path(), ec);
    if (ec)
      spdlog::warn("could not remove uncommitted checkpoint {}: {}", entry.path().string(),
                   ec.message());
    else
      spdlog::info("removed uncommitted checkpoint directory {}", entry.path().string());
  }
}

Manifest read_manifest(const fs::path& step_dir) {
  const fs::path p = step_dir / kManifestName;
  if (!fs::exists(p))
    fail(ExitCode::kCheckpointCorrupt, "{} has no {}: it is not a committed checkpoint",
         step_dir.string(), kManifestName);
  json j;
  try {
    j = json::parse(read_small_file(p));
  } catch (const json::exception& e) {
    fail(ExitCode::kCheckpointCorrupt, "{} is not valid JSON: {}", p.string(), e.what());
  }
  Manifest m = Manifest::from_json(j, p.string());
  // A manifest belongs to its directory: one copied or edited into another step's directory
  // would resume at the wrong step (and data position).
  fs::path name = step_dir.filename().empty() ? step_dir.parent_path() : step_dir;
  const auto dir_step = parse_step_dir_name(name.filename().string());
  if (dir_step && *dir_step != m.step)
    fail(ExitCode::kCheckpointCorrupt,
         "{} says step {} but its directory is {} (step {}): the manifest does not belong there",
         p.string(), m.step, name.filename().string(), *dir_step);
  return m;
}

std::vector<std::pair<int64_t, fs::path>> list_committed(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root)) {
    auto s = parse_step_dir_name(entry.path().filename().string());
    if (s && entry.is_directory() && fs::exists(entry.path() / kManifestName))
      out.emplace_back(*s, entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<fs::path> latest_step_dir(const fs::path& root) {
  std::error_code ec;
  if (!fs::exists(root / kLatestName, ec)) return std::nullopt;
  std::string name = read_small_file(root / kLatestName);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!parse_step_dir_name(name)) return std::nullopt;
  fs::path dir = root / name;
  if (!fs::exists(dir / kManifestName, ec)) return std::nullopt;
  return dir;
}

bool is_step_dir(const fs::path& path) {
  std::error_code ec;
  fs::path norm = fs::absolute(path, ec).lexically_normal();
  if (norm.filename().empty()) norm = norm.parent_path();
  return fs::exists(path / kManifestName, ec) ||
         parse_step_dir_name(norm.filename().string()).has_value();
}

}  // namespace dnallm::checkpoint
