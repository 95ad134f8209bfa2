#include "test_util.hpp"

#include <cstring>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include <fmt/format.h>

namespace dnallm::testing {

std::map<std::string, std::vector<float>> read_safetensors_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  auto meta = nlohmann::json::parse(header);
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, std::vector<float>> out;
  for (auto it = meta.begin(); it != meta.end(); ++it) {
    if (it.key() == "__metadata__" || it.value()["dtype"] != "F32") continue;
    auto off = it.value()["data_offsets"];
    size_t b = off[0].get<size_t>(), e = off[1].get<size_t>();
    std::vector<float> v((e - b) / 4);
    std::memcpy(v.data(), data.data() + b, e - b);
    out[it.key()] = std::move(v);
  }
  return out;
}

std::map<int64_t, double> read_step_losses(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  std::map<int64_t, double> out;
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("event") || !j.contains("step")) continue;
    out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

std::string tiny_train_command(const std::string& starter, const std::string& dir, int micro,
                               int accum, const std::string& extra) {
  return fmt::format(
      "cd {src} && {starter} {bin}dnallm-train "
      "--set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64 "
      "--set model.max_seq_length=64 --set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
      "--set training.max_steps=5 --set training.micro_batch_size={micro} "
      "--set training.grad_accum_steps={accum} --set training.lr=3e-3 "
      "--set training.warmup_steps=0 --set training.logging_steps=1 --set training.seed=7 "
      "--set data.dataloader_num_workers=1 "
      "--set parallel.bucket_cap_mb=0.02 --set parallel.first_bucket_mb=0.005 "
      "--set checkpoint.dir={dir}/ckpt --set checkpoint.resume=none "
      "--metrics-file {dir}/metrics.jsonl {extra}",
      fmt::arg("src", kSrc), fmt::arg("bin", kBin), fmt::arg("starter", starter),
      fmt::arg("micro", micro), fmt::arg("accum", accum), fmt::arg("dir", dir),
      fmt::arg("extra", extra));
}

}  // namespace dnallm::testing
