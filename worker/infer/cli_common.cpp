// See cli_common.hpp.
#include "worker/infer/cli_common.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "core/worker_env.hpp"
#include "worker/models/model_dir.hpp"
#include "worker/models/model_dir_options.hpp"
#include "worker/models/transformer/quantized_linear.hpp"

namespace dnallm::infer::cli {

void add_common(CLI::App& cmd, CommonArgs& a) {
  models::add_model_dir_options(cmd, a.model_dir, a.base_dir, a.uppercase);
  cmd.add_option("--device", a.device,
                 "auto (cuda:LOCAL_RANK when there is a GPU) | cpu | "
                 "cuda | cuda:N")
      ->capture_default_str();
  cmd.add_option("--quantize", a.quantize,
                 "none | int8 (dynamic quantisation of the block linears, CPU) | nf4 (4-bit "
                 "weights dequantised on the fly)")
      ->capture_default_str();
  cmd.add_option("--batch-size", a.batch_size, "sequences per forward pass")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd.add_option("--log-level", a.log_level, "trace|debug|info|warn|error")->capture_default_str();
}

Loaded load(const CommonArgs& a, int local_rank) {
  Loaded l;
  const auto format = models::parse_weight_format(a.quantize, "--quantize");
  auto loaded = models::load_model_dir(a.model_dir, a.base_dir);
  l.model = loaded.model;
  l.codec = loaded.codec;
  l.codec->set_uppercase(a.uppercase);
  // After the model directory was checked: refusing a damaged one never loads CUDA (Note
  // [Lazy CUDA]); the weights wait on the CPU meanwhile.
  l.device = infer::resolve_device(a.device, local_rank);
  DNALLM_CHECK(format != models::WeightFormat::kInt8 || l.device.is_cpu(), ExitCode::kUsage,
               "--quantize int8 is CPU inference (dynamic quantisation): add --device cpu");
  l.model->to(l.device);
  l.model->eval();
  if (format != models::WeightFormat::kFull) {
    const auto r = models::quantize_linears(*l.model, format);
    spdlog::info("{}: {} linears, {:.2f} MB -> {:.2f} MB ({:.3f}x fp32)", a.quantize, r.linears,
                 r.fp32_bytes() / 1e6, r.quantized_bytes / 1e6,
                 double(r.quantized_bytes) / double(std::max<int64_t>(r.fp32_bytes(), 1)));
  }
  spdlog::info("model {} on {}", a.model_dir, l.device.str());
  return l;
}

void check_input(const std::string& path) {
  DNALLM_CHECK(std::filesystem::is_regular_file(path), ExitCode::kBadData,
               "--input {} does not exist or is not a file", path);
}

std::vector<std::string> model_files(const std::string& dir) {
  return {dir + "/config.json",           dir + "/model.safetensors",
          dir + "/tokenizer.json",        dir + "/adapter_model.safetensors",
          dir + "/pytorch_model.bin",     dir + "/adapter_config.json",
          dir + "/tokenizer_config.json", dir + "/vocab.txt"};
}

std::vector<std::string> checked_reads(const std::string& model_dir,
                                       const std::vector<std::string>& inputs) {
  for (const auto& input : inputs) check_input(input);
  auto reads = model_files(model_dir);
  reads.insert(reads.end(), inputs.begin(), inputs.end());
  return reads;
}

// Note [Batches bounded by tokens]: a forward pass holds batch x max_seq_length tokens (and
// embed reads 8 batches ahead), so --batch-size is lowered to at most kMaxBatchTokens tokens
// a batch, with a warning: `embed --batch-size 1000000` used 17 GB on 100k records before.
constexpr int64_t kMaxBatchTokens = int64_t{1} << 16;

int64_t bounded_batch_size(int64_t requested, int64_t max_seq_length) {
  const int64_t most = std::max<int64_t>(1, kMaxBatchTokens / std::max<int64_t>(max_seq_length, 1));
  if (requested <= most) return requested;
  spdlog::warn("--batch-size {} lowered to {}: at most {} tokens a batch ({} x max_seq_length {})",
               requested, most, kMaxBatchTokens, most, max_seq_length);
  return most;
}

void report_truncated(const RunCounts& c, int64_t max_seq) {
  c.lower_case.warn();
  if (c.truncated > 0) {
    spdlog::warn(
        "{} of {} sequences were longer than {} tokens (the model's longest input) and were cut",
        c.truncated, c.sequences, max_seq);
  }
}

// The job's process group (Note [Embedding shares]); world_size 1: none.
comm::ProcessGroup connect(const cluster::Topology& topo, const cluster::EnvMap& env) {
  comm::ProcessGroupOptions po;
  po.backend = "gloo";  // a barrier between host processes
  po.rank = topo.rank;
  po.world_size = topo.world_size;
  po.master_addr = topo.master_addr;
  po.master_port = topo.master_port > 0 ? topo.master_port : 29500;
  // Note [Worker environment] (core/worker_env.hpp).
  const WorkerEnv w = WorkerEnv::from_environment(env);
  po.rank0_hosts_store = !w.external_coordinator;
  po.token = w.job_token;
  po.name = w.generation ? "infer-g" + std::to_string(*w.generation) : "infer";
  return comm::connect_process_group(po);
}

RowShares::RowShares(const cluster::Topology& topo, const cluster::EnvMap& env,
                     const std::string& out, std::string header)
    : rank_(topo.rank), world_size_(topo.world_size), out_(out), header_(std::move(header)) {
  if (world_size_ == 1) {
    part_ = std::make_unique<OutputFile>(out_);
    part_->stream() << header_;
    return;
  }
  check(topo, out_);
  group_ = connect(topo, env);
  for (int k = 0; k < world_size_; ++k) parts_.push_back(fmt::format("{}.part{}", out_, k));
  part_ = std::make_unique<OutputFile>(parts_[static_cast<size_t>(rank_)]);
}

void RowShares::check(const cluster::Topology& topo, const std::string& out) {
  DNALLM_CHECK(topo.world_size == 1 || out != "-", ExitCode::kUsage,
               "--out -: under {} ranks give a file (each rank writes its share beside it and "
               "rank 0 merges them)",
               topo.world_size);
  DNALLM_CHECK(topo.world_size == 1 || !written_in_place(out), ExitCode::kUsage,
               "--out {} is not a regular file (a device or a FIFO): under {} ranks give a file "
               "(each rank writes its share beside it and rank 0 merges them), or run one "
               "process",
               out, topo.world_size);
}

std::pair<int64_t, int64_t> RowShares::share(int64_t n) const {
  return {n * rank_ / world_size_, n * (rank_ + 1) / world_size_};
}

void RowShares::commit() {
  part_->commit();
  if (world_size_ == 1) return;
  group_.comm->barrier()->wait();  // every part is closed
  if (rank_ != 0) return;
  OutputFile merged(out_);
  merged.stream() << header_;
  for (const auto& p : parts_) {
    std::ifstream in(p, std::ios::binary);
    DNALLM_CHECK(in.good(), ExitCode::kPeerFailed, "cannot read {}, a rank's share of --out {}", p,
                 out_);
    // (an empty part would set the output's failbit)
    if (in.peek() != std::ifstream::traits_type::eof()) merged.stream() << in.rdbuf();
  }
  merged.commit();
  for (const auto& p : parts_) {
    std::error_code ec;
    std::filesystem::remove(p, ec);
  }
  spdlog::info("merged {} parts -> {}", parts_.size(), out_);
}

void require_one_process(const cluster::Topology& topo, const char* what) {
  DNALLM_CHECK(topo.world_size == 1, ExitCode::kUsage,
               "{} runs as one process (this is rank {} of {}); embed, variants and mutagenesis "
               "split their input over ranks",
               what, topo.rank, topo.world_size);
}

}  // namespace dnallm::infer::cli
