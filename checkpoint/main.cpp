// dnallm-ckpt: inspect, verify, reshard and export checkpoints. Every command takes a
// step directory or a checkpoint root (meaning the checkpoint LATEST names).
#include <cstdio>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "checkpoint/reader.hpp"
#include "checkpoint/reshard.hpp"
#include "checkpoint/safetensors.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace ck = dnallm::checkpoint;
using nlohmann::json;

namespace {

json summary(const ck::CheckpointReader& r) {
  const ck::Manifest& m = r.manifest();
  json j;
  j["dir"] = r.dir().string();
  j["step"] = m.step;
  j["world_size"] = m.world_size;
  j["zero_stage"] = m.zero_stage;
  uint64_t stored = 0, raw = 0;
  json shards = json::array();
  for (size_t i = 0; i < r.shards().size(); ++i) {
    const auto& f = r.shards()[i];
    uint64_t shard_raw = 0, chunks = 0;
    for (const auto& t : f.tensors()) {
      shard_raw += (t.end - t.begin) * dnallm::dtype_size(t.spec.dtype);
      chunks += t.chunks.size();
    }
    raw += shard_raw;
    stored += f.size();
    shards.push_back({{"rank", i},
                      {"file", f.path().filename().string()},
                      {"bytes", f.size()},
                      {"raw_bytes", shard_raw},
                      {"chunks", chunks},
                      {"tensors", f.tensors().size()}});
  }
  json tensors = json::array();
  for (const auto& t : m.tensors)
    tensors.push_back({{"name", t.name},
                       {"dtype", dnallm::dtype_name(t.dtype)},
                       {"shape", t.shape},
                       {"numel", t.numel()}});
  j["bytes"] = stored;
  j["raw_bytes"] = raw;
  j["compression_ratio"] = stored ? static_cast<double>(raw) / static_cast<double>(stored) : 0.0;
  j["shards"] = std::move(shards);
  j["tensors"] = std::move(tensors);
  j["state"] = m.state;
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  dnallm::init_logging("ckpt", "warn");
  CLI::App app{"dnallm-ckpt: inspect, verify, reshard and export dnallm checkpoints"};
  app.require_subcommand(1);
  std::string path, out, compression = "zstd";
  int world_size = 0;

  auto* inspect = app.add_subcommand("inspect", "print a JSON summary of a checkpoint");
  inspect->add_option("path", path, "step directory or checkpoint root")->required();
  auto* verify = app.add_subcommand("verify", "check every shard and chunk checksum");
  verify->add_option("path", path, "step directory or checkpoint root")->required();
  auto* reshard = app.add_subcommand("reshard", "rewrite into N shards (even flat ranges)");
  reshard->add_option("path", path, "step directory or checkpoint root")->required();
  reshard->add_option("--world-size", world_size, "number of output shards")
      ->required()
      ->check(CLI::Range(1, ck::kMaxReshardWorldSize));
  reshard->add_option("--out", out, "output checkpoint root")->required();
  reshard->add_option("--compression", compression, "none | zstd | zstd:<level>");
  auto* exp = app.add_subcommand("export", "write model.safetensors, config and tokenizer");
  exp->add_option("path", path, "step directory or checkpoint root")->required();
  exp->add_option("--out", out, "output directory")->required();

  if (argc > 1 && argv[1][0] != '-' && std::string(argv[1]) != "inspect" &&
      std::string(argv[1]) != "verify" && std::string(argv[1]) != "reshard" &&
      std::string(argv[1]) != "export") {
    std::fprintf(stderr,
                 "dnallm-ckpt: unknown command '%s'; use inspect, verify, reshard or export\n",
                 argv[1]);
    return static_cast<int>(dnallm::ExitCode::kUsage);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    std::fprintf(stderr, "dnallm-ckpt: %s (run with --help for usage)\n", msg.c_str());
    return static_cast<int>(dnallm::ExitCode::kUsage);
  }

  try {
    auto reader = ck::CheckpointReader::open(path);
    if (*inspect) {
      std::cout << summary(reader).dump(2) << "\n";
    } else if (*verify) {
      reader.verify();
      std::cout << "ok: " << reader.dir().string() << " (step " << reader.step() << ", "
                << reader.shards().size() << " shards) verified\n";
    } else if (*reshard) {
      auto dir = ck::reshard(reader, out, world_size, ck::parse_codec(compression));
      std::cout << "wrote " << dir.string() << " with " << world_size << " shards\n";
    } else if (*exp) {
      auto file = ck::export_checkpoint_model(reader, out);
      std::cout << "wrote " << file.string() << "\n";
    }
  } catch (const dnallm::Error& e) {
    std::fprintf(stderr, "dnallm-ckpt: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dnallm-ckpt: %s\n", e.what());
    return static_cast<int>(dnallm::ExitCode::kFailure);
  }
  return 0;
}
