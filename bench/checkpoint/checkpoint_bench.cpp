// dnallm-bench-ckpt: save/load throughput of a realistic training state against
// torch.save/torch.load of the same bytes (measured in the same run), and the compression
// ratio of byte grouping + zstd against plain zstd.
//
// The state imitates a transformer in mixed-precision AdamW training (see
// generate_state()): fp32 master weights, Adam exp_avg and exp_avg_sq, and the bf16
// model weights. Timings are medians over --iters after one warm-up; loads read from the
// page cache for both sides.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "checkpoint/codec.hpp"
#include "checkpoint/commit.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace ck = dnallm::checkpoint;
namespace fs = std::filesystem;
using dnallm::DType;

namespace {

struct Tensor {
  ck::TensorSpec spec;
  std::vector<uint8_t> bytes;
};

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// A BERT-like layer stack of `hidden` width. Per matrix: weights ~ N(0, s) with s drawn
// from [0.01, 0.05] (LayerNorm gains ~ 1 + N(0, 0.02), biases ~ N(0, 0.01)); gradients
// g_k ~ N(0, sigma) with a per-row scale sigma ~ 1e-3 * lognormal(0, 1) (rows differ by
// orders of magnitude, as real gradients do); Adam moments after four steps of
// beta1 = 0.9, beta2 = 0.999 updates: m = sum (1-b1) b1^(4-k) g_k, v = sum (1-b2) b2^(4-k)
// g_k^2.
std::vector<Tensor> generate_state(int hidden, int layers, uint64_t seed, bool with_bf16) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.01f, 0.05f);
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    int kind;  // 0 matrix, 1 gain, 2 bias
  };
  std::vector<Param> params;
  const int64_t h = hidden;
  for (int l = 0; l < layers; ++l) {
    const std::string p = "encoder.layer." + std::to_string(l) + ".";
    for (const char* m : {"attention.self.query", "attention.self.key", "attention.self.value",
                          "attention.output.dense"}) {
      params.push_back({p + m + ".weight", {h, h}, 0});
      params.push_back({p + m + ".bias", {h}, 2});
    }
    params.push_back({p + "attention.output.LayerNorm.weight", {h}, 1});
    params.push_back({p + "intermediate.dense.weight", {4 * h, h}, 0});
    params.push_back({p + "intermediate.dense.bias", {4 * h}, 2});
    params.push_back({p + "output.dense.weight", {h, 4 * h}, 0});
    params.push_back({p + "output.LayerNorm.weight", {h}, 1});
  }
  std::vector<Tensor> out;
  for (const auto& p : params) {
    ck::TensorSpec s{p.name, DType::kFloat32, p.shape};
    const uint64_t n = s.numel();
    const int64_t row = p.shape.back();
    std::vector<float> w(n), m(n), v(n);
    const float wstd = u(rng);
    float sigma = 0;
    for (uint64_t i = 0; i < n; ++i) {
      if (i % row == 0) sigma = 1e-3f * std::exp(n01(rng));
      w[i] = p.kind == 0   ? wstd * n01(rng)
             : p.kind == 1 ? 1.0f + 0.02f * n01(rng)
                           : 0.01f * n01(rng);
      float mm = 0, vv = 0;
      for (int k = 0; k < 4; ++k) {
        const float g = sigma * n01(rng);
        mm = 0.9f * mm + 0.1f * g;
        vv = 0.999f * vv + 0.001f * g * g;
      }
      m[i] = mm;
      v[i] = vv;
    }
    auto add = [&](const std::string& suffix, const std::vector<float>& x) {
      Tensor t{s, std::vector<uint8_t>(n * 4)};
      t.spec.name = p.name + suffix;
      std::memcpy(t.bytes.data(), x.data(), n * 4);
      out.push_back(std::move(t));
    };
    add("", w);
    add(".exp_avg", m);
    add(".exp_avg_sq", v);
    if (with_bf16) {
      Tensor t{{"bf16." + p.name, DType::kBFloat16, p.shape}, std::vector<uint8_t>(n * 2)};
      for (uint64_t i = 0; i < n; ++i) {
        const uint16_t b = to_bf16(w[i]);
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
      }
      out.push_back(std::move(t));
    }
  }
  return out;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Compressed size of `tensors` (of one dtype) with the given options, chunk by chunk.
uint64_t compressed_bytes(const std::vector<const Tensor*>& tensors, const ck::CodecOptions& o) {
  uint64_t total = 0;
  std::vector<uint8_t> out;
  for (const Tensor* t : tensors) {
    const size_t es = dnallm::dtype_size(t->spec.dtype);
    const size_t per = o.chunk_bytes / es * es;
    for (size_t off = 0; off < t->bytes.size(); off += per) {
      const size_t n = std::min(per, t->bytes.size() - off);
      ck::encode_chunk(t->bytes.data() + off, n, t->spec.dtype, o, out);
      total += out.size();
    }
  }
  return total;
}

struct Args {
  int hidden = 512, layers = 4, iters = 3;
  std::string dir = "/tmp/dnallm_bench_ckpt", python = "/usr/bin/python3";
  std::string peer = DNALLM_BENCH_PEER;
};

// The state's tensors by dtype.
struct ByDtype {
  std::vector<const Tensor*> fp32, bf16;
  uint64_t fp32_bytes = 0, bf16_bytes = 0;
};

ByDtype split_by_dtype(const std::vector<Tensor>& state) {
  ByDtype out;
  for (const auto& t : state) {
    const bool fp32 = t.spec.dtype == DType::kFloat32;
    (fp32 ? out.fp32 : out.bf16).push_back(&t);
    (fp32 ? out.fp32_bytes : out.bf16_bytes) += t.bytes.size();
  }
  return out;
}

// Compression ratio: byte grouping + zstd vs plain zstd, per dtype and level, then per kind
// of fp32 tensor (weights, exp_avg, exp_avg_sq) at level 3.
void print_compression(const ByDtype& s) {
  std::printf("\n%-28s %6s %10s %10s %8s\n", "data", "level", "grouped", "plain", "gain");
  for (int level : {1, 3}) {
    for (const auto* set : {&s.fp32, &s.bf16}) {
      const uint64_t raw = set == &s.fp32 ? s.fp32_bytes : s.bf16_bytes;
      ck::CodecOptions g;
      g.level = level;
      ck::CodecOptions p = g;
      p.byte_grouping = false;
      const double rg = double(raw) / compressed_bytes(*set, g);
      const double rp = double(raw) / compressed_bytes(*set, p);
      std::printf("%-28s %6d %9.3fx %9.3fx %7.3fx\n",
                  set == &s.fp32 ? "fp32 weights+Adam m,v" : "bf16 weights", level, rg, rp,
                  rg / rp);
    }
  }
  std::vector<std::pair<std::string, std::vector<const Tensor*>>> sets = {
      {"fp32 weights", {}}, {"fp32 exp_avg", {}}, {"fp32 exp_avg_sq", {}}};
  for (const Tensor* t : s.fp32) {
    const auto& n = t->spec.name;
    int k = n.size() > 11 && n.compare(n.size() - 11, 11, ".exp_avg_sq") == 0 ? 2
            : n.size() > 8 && n.compare(n.size() - 8, 8, ".exp_avg") == 0     ? 1
                                                                              : 0;
    sets[k].second.push_back(t);
  }
  for (const auto& [name, set] : sets) {
    uint64_t raw = 0;
    for (const Tensor* t : set) raw += t->bytes.size();
    ck::CodecOptions g, p;
    p.byte_grouping = false;
    std::printf("%-28s %6d %9.3fx %9.3fx\n", name.c_str(), 3,
                double(raw) / compressed_bytes(set, g), double(raw) / compressed_bytes(set, p));
  }
}

struct SaveLoad {
  double save_s = 0, load_s = 0;
  uint64_t file_bytes = 0;
};

// One save (write and commit through the one commit path, checkpoint/commit.hpp) and one
// verified load of `tensors` under `root`.
SaveLoad save_and_load(const fs::path& root, const std::vector<const Tensor*>& tensors,
                       const ck::CodecOptions& opts) {
  std::vector<ck::TensorSlice> slices;
  for (const Tensor* t : tensors) slices.push_back({t->spec, 0, t->spec.numel(), t->bytes.data()});
  fs::remove_all(root);
  SaveLoad out;
  double t0 = now_s();
  out.file_bytes = ck::save_single(root, {1000, 1, 0, {{"step", 1000}}}, slices, opts).bytes;
  out.save_s = now_s() - t0;
  t0 = now_s();
  auto r = ck::CheckpointReader::open(root);
  std::vector<uint8_t> buf;
  uint64_t mismatches = 0;
  for (const Tensor* t : tensors) {
    buf.resize(t->bytes.size());
    r.read_range(t->spec.name, 0, t->spec.numel(), buf.data());
    mismatches += buf != t->bytes;
  }
  out.load_s = now_s() - t0;
  if (mismatches) dnallm::fail(dnallm::ExitCode::kFailure, "{} tensors differ", mismatches);
  return out;
}

struct Throughput {
  double save_mb_s = 0, load_mb_s = 0;
};

// Save/load MB/s of the fp32 training state per codec (medians after one warm-up); returns
// zstd:1's.
Throughput print_our_throughput(const Args& a, const ByDtype& s) {
  std::printf("\n%-22s %10s %10s %10s %10s %8s\n", "writer", "MB", "save_MB/s", "load_MB/s",
              "file_MB", "ratio");
  Throughput zstd1;
  for (const char* codec : {"none", "zstd:1", "zstd:3"}) {
    std::vector<double> saves, loads;
    uint64_t file_bytes = 0;
    for (int it = 0; it <= a.iters; ++it) {
      const auto r = save_and_load(fs::path(a.dir) / codec, s.fp32, ck::parse_codec(codec));
      file_bytes = r.file_bytes;
      if (it > 0) {  // the first iteration warms up
        saves.push_back(r.save_s);
        loads.push_back(r.load_s);
      }
    }
    const double mb = s.fp32_bytes / 1e6;
    const Throughput t{mb / median(saves), mb / median(loads)};
    std::printf("%-22s %10.1f %10.1f %10.1f %10.1f %7.3fx\n",
                (std::string("dnallm ") + codec).c_str(), mb, t.save_mb_s, t.load_mb_s,
                file_bytes / 1e6, double(s.fp32_bytes) / file_bytes);
    if (std::string(codec) == "zstd:1") zstd1 = t;
  }
  return zstd1;
}

// The same bytes for torch: one raw file and its layout.
void write_peer_input(const std::vector<const Tensor*>& fp32, const fs::path& data,
                      const fs::path& layout) {
  nlohmann::json jl = nlohmann::json::array();
  std::ofstream out(data, std::ios::binary);
  uint64_t off = 0;
  for (const Tensor* t : fp32) {
    out.write(reinterpret_cast<const char*>(t->bytes.data()),
              static_cast<std::streamsize>(t->bytes.size()));
    jl.push_back(
        {{"name", t->spec.name}, {"dtype", "fp32"}, {"numel", t->spec.numel()}, {"offset", off}});
    off += t->bytes.size();
  }
  std::ofstream(layout) << jl.dump();
}

// torch.save/torch.load of the same state (bench/checkpoint/torch_peer.py), and our ratio.
void print_torch_peer(const Args& a, const ByDtype& s, const Throughput& ours) {
  const fs::path data = fs::path(a.dir) / "state.bin", layout = fs::path(a.dir) / "layout.json";
  write_peer_input(s.fp32, data, layout);
  const std::string cmd = a.python + " " + a.peer + " " + layout.string() + " " + data.string() +
                          " " + (fs::path(a.dir) / "torch.pt").string() + " " +
                          std::to_string(a.iters + 1);
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string text;
  char buf[4096];
  size_t n;
  while (p && (n = std::fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  const int rc = p ? ::pclose(p) : -1;
  if (rc != 0 || text.empty()) {
    std::printf("torch peer failed (rc %d): %s\n", rc, text.c_str());
    return;
  }
  auto j = nlohmann::json::parse(text);
  const double mb = j["bytes"].get<double>() / 1e6;
  const double ts = mb / j["save_s"].get<double>(), tl = mb / j["load_s"].get<double>();
  std::printf("%-22s %10.1f %10.1f %10.1f %10.1f %7.3fx\n", "torch.save/load", mb, ts, tl,
              j["file_bytes"].get<double>() / 1e6, mb * 1e6 / j["file_bytes"].get<double>());
  std::printf("\n# dnallm zstd:1 vs torch: save %.2fx, load %.2fx\n", ours.save_mb_s / ts,
              ours.load_mb_s / tl);
}

}  // namespace

int main(int argc, char** argv) {
  dnallm::init_logging("bench-ckpt", "warn");
  CLI::App app{"dnallm-bench-ckpt: checkpoint save/load vs torch.save/torch.load"};
  Args a;
  app.add_option("--hidden", a.hidden, "model width");
  app.add_option("--layers", a.layers, "layers (12.6 * hidden^2 fp32 elements each, x3 for Adam)");
  app.add_option("--iters", a.iters, "timed iterations after one warm-up");
  app.add_option("--dir", a.dir, "scratch directory");
  app.add_option("--python", a.python, "python with torch for the peer ('' skips it)");
  CLI11_PARSE(app, argc, argv);

  try {
    std::printf("# generating state: hidden=%d layers=%d\n", a.hidden, a.layers);
    std::fflush(stdout);
    const auto state = generate_state(a.hidden, a.layers, 1234, true);
    const ByDtype s = split_by_dtype(state);
    std::printf("# fp32 master weights + exp_avg + exp_avg_sq: %.1f MB; bf16 weights: %.1f MB\n",
                s.fp32_bytes / 1e6, s.bf16_bytes / 1e6);
    print_compression(s);
    fs::remove_all(a.dir);
    fs::create_directories(a.dir);
    const Throughput ours = print_our_throughput(a, s);
    if (!a.python.empty()) print_torch_peer(a, s, ours);
    fs::remove_all(a.dir);
  } catch (const dnallm::Error& e) {
    std::fprintf(stderr, "dnallm-bench-ckpt: %s\n", e.what());
    return e.exit_code();
  }
  return 0;
}
