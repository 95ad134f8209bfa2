#include "checkpoint/reader.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "checkpoint/train_state.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::checkpoint {

namespace fs = std::filesystem;

CheckpointReader CheckpointReader::open(const fs::path& path) {
  fs::path dir = path;
  if (!is_step_dir(path)) {
    // Note [LATEST is a hint]: the newest committed step wins.
    auto all = list_committed(path);
    if (all.empty())
      fail(ExitCode::kCheckpointCorrupt, "{} holds no committed checkpoint (no step_*/{})",
           path.string(), kManifestName);
    dir = all.back().second;
  }
  CheckpointReader r;
  r.dir_ = dir;
  r.manifest_ = read_manifest(dir);
  for (const auto& d : r.manifest_.shards) {
    ShardFile f(dir / d.file);
    if (f.size() != d.bytes)
      fail(ExitCode::kCheckpointCorrupt,
           "checkpoint shard {} is {} bytes, the manifest says {} (truncated?)", f.path().string(),
           f.size(), d.bytes);
    if (f.stored_file_hash() != d.xxh64)
      fail(ExitCode::kCheckpointCorrupt,
           "checkpoint shard {} has file hash {:016x}, the manifest says {:016x}",
           f.path().string(), f.stored_file_hash(), d.xxh64);
    for (const auto& range : d.ranges) {
      const auto pieces = f.pieces(range.tensor);
      if (std::none_of(pieces.begin(), pieces.end(), [&](const ShardTensor* t) {
            return t->begin == range.begin && t->end == range.end;
          }))
        fail(ExitCode::kCheckpointCorrupt,
             "checkpoint shard {} does not hold range [{}, {}) of '{}' the manifest lists",
             f.path().string(), range.begin, range.end, range.tensor);
    }
    r.shards_.push_back(std::move(f));
  }
  return r;
}

void CheckpointReader::verify() const {
  for (const auto& s : shards_) s.verify();
}

void CheckpointReader::read_range(const std::string& tensor, uint64_t begin, uint64_t end,
                                  void* out) const {
  const TensorSpec* spec = manifest_.find(tensor);
  if (!spec) fail(ExitCode::kUsage, "checkpoint {} has no tensor '{}'", dir_.string(), tensor);
  if (begin > end || end > spec->numel())
    fail(ExitCode::kUsage, "range [{}, {}) is outside tensor '{}' of {} elements", begin, end,
         tensor, spec->numel());
  const size_t es = dtype_size(spec->dtype);
  auto* dst = static_cast<uint8_t*>(out);
  // Collect the pieces the shards hold, then check they cover [begin, end).
  std::vector<std::pair<uint64_t, uint64_t>> covered;
  for (const auto& shard : shards_) {
    for (const ShardTensor* t : shard.pieces(tensor)) {
      const uint64_t lo = std::max(begin, t->begin), hi = std::min(end, t->end);
      if (lo >= hi) continue;
      shard.read(*t, lo, hi, dst + (lo - begin) * es);
      covered.emplace_back(lo, hi);
    }
  }
  std::sort(covered.begin(), covered.end());
  uint64_t at = begin;
  for (const auto& [lo, hi] : covered) {
    if (lo > at) break;
    at = std::max(at, hi);
  }
  if (at < end)
    fail(ExitCode::kCheckpointCorrupt,
         "checkpoint {}: no shard holds elements [{}, {}) of tensor '{}'", dir_.string(), at, end,
         tensor);
}

std::vector<uint8_t> CheckpointReader::read_tensor(const std::string& tensor) const {
  const TensorSpec* spec = manifest_.find(tensor);
  if (!spec) fail(ExitCode::kUsage, "checkpoint {} has no tensor '{}'", dir_.string(), tensor);
  std::vector<uint8_t> out(spec->numel() * dtype_size(spec->dtype));
  read_range(tensor, 0, spec->numel(), out.data());
  return out;
}

std::optional<CheckpointReader> find_resume(const fs::path& root, const cfg::Resume& resume) {
  if (resume.kind == cfg::Resume::Kind::kNone) return std::nullopt;
  fs::path base = root;
  if (resume.kind == cfg::Resume::Kind::kPath) {
    base = resume.path;
    if (is_step_dir(base)) {
      CheckpointReader r = CheckpointReader::open(base);
      r.verify();
      return r;
    }
  }
  // Note [LATEST is a hint]: LATEST is written after the manifest, so it can lag behind
  // (a crash or a full disk between the two writes) or name an older step (restored by
  // hand); resuming from it would then redo steps and save over committed directories.
  // The newest committed step directory wins; a LATEST that disagrees is reported.
  const auto all = list_committed(base);
  if (all.empty()) return std::nullopt;
  std::optional<fs::path> latest;
  try {
    latest = latest_step_dir(base);
  } catch (const Error&) {
    latest.reset();
  }
  if (!latest || latest->filename() != all.back().second.filename())
    spdlog::warn(
        "{}/{} names {} but the newest committed checkpoint is {}: resuming from the "
        "newest (LATEST is only a hint)",
        base.string(), kLatestName,
        latest ? latest->filename().string() : std::string("no committed step"),
        all.back().second.filename().string());
  std::string last_error;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const fs::path& dir = it->second;
    try {
      CheckpointReader r = CheckpointReader::open(dir);
      r.verify();
      return r;
    } catch (const Error& e) {
      if (e.code() != ExitCode::kCheckpointCorrupt) throw;
      last_error = e.what();
      spdlog::warn("skipping damaged checkpoint {}: {}; trying the previous one", dir.string(),
                   e.what());
    }
  }
  fail(ExitCode::kCheckpointCorrupt,
       "no usable checkpoint under {}: all {} committed checkpoints are damaged (last: {}); "
       "restore the directory or start with resume = \"none\"",
       base.string(), all.size(), last_error);
}

std::string manifest_path(const CheckpointReader& ckpt) {
  return (ckpt.dir() / kManifestName).string();
}

TrainState read_train_state(const CheckpointReader& ckpt) {
  return TrainState::from_json(ckpt.manifest().state, manifest_path(ckpt));
}

ModelInfo read_model_info(const CheckpointReader& ckpt) {
  return ModelInfo::from_json(ckpt.manifest().state, manifest_path(ckpt));
}

void check_compatible(const CheckpointReader& ckpt, const Expectation& expected) {
  const Manifest& m = ckpt.manifest();
  const std::string dir = ckpt.dir().string();
  for (const auto& want : expected.layout) {
    const TensorSpec* have = m.find(want.name);
    if (!have)
      fail(ExitCode::kUsage,
           "checkpoint {} has no tensor '{}': it was saved from another model; point "
           "[checkpoint] dir elsewhere or set resume = \"none\"",
           dir, want.name);
    if (*have != want)
      fail(ExitCode::kUsage,
           "checkpoint {} holds tensor '{}' as {} {}, the model expects {} {}: it was saved "
           "from another model configuration",
           dir, want.name, dtype_name(have->dtype), fmt::join(have->shape, "x"),
           dtype_name(want.dtype), fmt::join(want.shape, "x"));
  }
  if (expected.layout.size() && m.tensors.size() != expected.layout.size())
    fail(ExitCode::kUsage, "checkpoint {} holds {} tensors, the model has {}", dir,
         m.tensors.size(), expected.layout.size());
  if (!expected.config_hash && !expected.tokenizer) return;
  const ModelInfo info = read_model_info(ckpt);
  if (expected.config_hash) {
    const std::string have = info.config_hash.value_or("<none>");
    if (have != *expected.config_hash)
      fail(ExitCode::kUsage,
           "checkpoint {} was saved with config hash {}, this run has {}: the model or "
           "training configuration changed",
           dir, have, *expected.config_hash);
  }
  if (expected.tokenizer) {
    if (info.tokenizer != expected.tokenizer)
      fail(ExitCode::kUsage,
           "checkpoint {} was saved with tokenizer {}, this run uses {}: resume with the same "
           "[tokenizer] settings",
           dir, info.tokenizer ? info.tokenizer->dump() : std::string("<none>"),
           expected.tokenizer->dump());
  }
}

}  // namespace dnallm::checkpoint
