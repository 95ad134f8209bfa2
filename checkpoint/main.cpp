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

struct CkptArgs {
  std::string path, out, compression = "zstd";
  int world_size = 0;
};

// The subcommands, in the order of the help text.
struct Commands {
  CLI::App* inspect = nullptr;
  CLI::App* verify = nullptr;
  CLI::App* reshard = nullptr;
  CLI::App* exp = nullptr;
};

Commands add_commands(CLI::App& app, CkptArgs& a) {
  Commands c;
  c.inspect = app.add_subcommand("inspect", "print a JSON summary of a checkpoint");
  c.inspect->add_option("path", a.path, "step directory or checkpoint root")->required();
  c.verify = app.add_subcommand("verify", "check every shard and chunk checksum");
  c.verify->add_option("path", a.path, "step directory or checkpoint root")->required();
  c.reshard = app.add_subcommand("reshard", "rewrite into N shards (even flat ranges)");
  c.reshard->add_option("path", a.path, "step directory or checkpoint root")->required();
  c.reshard->add_option("--world-size", a.world_size, "number of output shards")
      ->required()
      ->check(CLI::Range(1, ck::kMaxReshardWorldSize));
  c.reshard->add_option("--out", a.out, "output checkpoint root")->required();
  c.reshard->add_option("--compression", a.compression, "none | zstd | zstd:<level>");
  c.exp = app.add_subcommand("export", "write model.safetensors, config and tokenizer");
  c.exp->add_option("path", a.path, "step directory or checkpoint root")->required();
  c.exp->add_option("--out", a.out, "output directory")->required();
  return c;
}

// A first argument that is neither an option nor a command: one line naming the commands.
bool unknown_command(int argc, char** argv) {
  if (argc <= 1 || argv[1][0] == '-') return false;
  const std::string first = argv[1];
  return first != "inspect" && first != "verify" && first != "reshard" && first != "export";
}

// -1 when the command line parsed; otherwise the exit code (help: 0, bad usage: 2).
int parse(CLI::App& app, int argc, char** argv) {
  if (unknown_command(argc, argv)) {
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
  return -1;
}

void run(const Commands& c, const CkptArgs& a) {
  auto reader = ck::CheckpointReader::open(a.path);
  if (*c.inspect) {
    std::cout << summary(reader).dump(2) << "\n";
  } else if (*c.verify) {
    reader.verify();
    std::cout << "ok: " << reader.dir().string() << " (step " << reader.step() << ", "
              << reader.shards().size() << " shards) verified\n";
  } else if (*c.reshard) {
    auto dir = ck::reshard(reader, a.out, a.world_size, ck::parse_codec(a.compression));
    std::cout << "wrote " << dir.string() << " with " << a.world_size << " shards\n";
  } else if (*c.exp) {
    auto file = ck::export_model(reader, a.out);
    std::cout << "wrote " << file.string() << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  dnallm::init_logging("ckpt", "warn");
  CLI::App app{"dnallm-ckpt: inspect, verify, reshard and export dnallm checkpoints"};
  app.require_subcommand(1);
  CkptArgs args;
  const Commands commands = add_commands(app, args);
  if (const int code = parse(app, argc, argv); code >= 0) return code;
  try {
    run(commands, args);
  } catch (const dnallm::Error& e) {
    std::fprintf(stderr, "dnallm-ckpt: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dnallm-ckpt: %s\n", e.what());
    return static_cast<int>(dnallm::ExitCode::kFailure);
  }
  return 0;
}
