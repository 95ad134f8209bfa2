// dnallm-infer: batched inference with a model directory (Note [One model loader]: dnallm-train's
// <checkpoint.dir>/final, a Hugging Face directory as downloaded, a PEFT adapter): `embed` (pooled
// or per-token embeddings to .npy/.safetensors), `generate` (causal LM continuation of prompts, KV
// cache), `predict` (classifier labels and probabilities). A separate binary from dnallm-eval
// (which scores) so that each stays small; see docs/inference.md.
//
// Multi-process embedding (Note [Embedding shares]): under dnallm-launch, mpirun or srun every
// rank embeds a contiguous share of the records ([r*N/W, (r+1)*N/W)) into
// <out>.part<r>.{f32,ids.txt,rows}; after a barrier over the process group, rank 0 appends
// the parts in rank order into the final file (input order) and deletes them. The output
// directory must be shared by all ranks.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cluster/topology.hpp"
#include "comm/bootstrap.hpp"
#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/worker_env.hpp"
#include "worker/data/sequence_reader.hpp"
#include "worker/infer/inference.hpp"
#include "worker/infer/variant_io.hpp"
#include "worker/infer/variants.hpp"
#include "worker/models/model_dir.hpp"
#include "worker/models/transformer/quantized_linear.hpp"

namespace {

using namespace dnallm;

struct CommonArgs {
  bool uppercase = false;
  std::string model_dir, base_dir;
  std::string device = "auto";
  std::string quantize = "none";
  int64_t batch_size = 32;
  std::string log_level = "info";
};

void add_common(CLI::App& cmd, CommonArgs& a) {
  cmd.add_option("--model", a.model_dir,
                 "model directory: dnallm-train's final/ or best/, a Hugging Face directory as "
                 "downloaded, or a PEFT adapter directory (docs/published-models.md)")
      ->required();
  cmd.add_flag("--uppercase", a.uppercase,
               "read lower-case (soft-masked) bases as bases; by default a Hugging Face "
               "model's tokenizer reads them as its reference does (unknown tokens)");
  cmd.add_option("--base", a.base_dir,
                 "a PEFT adapter's base directory, when its adapter_config.json does not name one");
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

struct Loaded {
  models::LanguageModel model{nullptr};
  std::shared_ptr<data::SequenceCodec> codec;
  torch::Device device{torch::kCPU};
};

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

// Note [Outputs never inputs]: every file dnallm-infer writes is checked before any work:
// not an existing directory, not any file the command reads (the same file by device and
// inode, or the same resolved path: a hard link or a symlink counts), in an existing
// directory. It is then written as a temporary file in its own directory and renamed over
// the final name only when complete (OutputFile; the embedding writer does the same), so a
// failed run never leaves a truncated output or a destroyed input.
void check_output(const std::string& out, const std::vector<std::string>& reads,
                  const char* flag = "--out") {
  namespace fs = std::filesystem;
  if (out == "-") return;
  struct stat o {};
  if (::stat(out.c_str(), &o) == 0) {
    DNALLM_CHECK(!S_ISDIR(o.st_mode), ExitCode::kUsage,
                 "{} {} is an existing directory: name a file (e.g. {}/out{})", flag, out, out,
                 fs::path(out).extension().string());
    for (const auto& in : reads) {
      struct stat i {};
      if (::stat(in.c_str(), &i) != 0) continue;
      DNALLM_CHECK(!(i.st_dev == o.st_dev && i.st_ino == o.st_ino), ExitCode::kUsage,
                   "{} {} is the same file as {}, which this command reads: writing it would "
                   "destroy the input; name another output file",
                   flag, out, in);
    }
  }
  std::error_code ec;
  const auto resolved = fs::weakly_canonical(out, ec);
  for (const auto& in : reads) {
    std::error_code ec_in;
    const auto r = fs::weakly_canonical(in, ec_in);
    DNALLM_CHECK(ec || ec_in || r != resolved, ExitCode::kUsage,
                 "{} {} is the same file as {}, which this command reads: writing it would "
                 "destroy the input; name another output file",
                 flag, out, in);
  }
  const auto parent = fs::path(out).has_parent_path() ? fs::path(out).parent_path() : ".";
  DNALLM_CHECK(fs::is_directory(parent, ec), ExitCode::kUsage,
               "{} {}: the directory {} does not exist; create it first", flag, out,
               parent.string());
}

// What a command reads from --model (besides its --input).
std::vector<std::string> model_files(const std::string& dir) {
  return {dir + "/config.json",           dir + "/model.safetensors",
          dir + "/tokenizer.json",        dir + "/adapter_model.safetensors",
          dir + "/pytorch_model.bin",     dir + "/adapter_config.json",
          dir + "/tokenizer_config.json", dir + "/vocab.txt"};
}

// An output file written whole or not at all (Note [Outputs never inputs]): the stream goes to
// <out>.tmp.<pid> in the same directory, renamed to `out` by commit(); "-" is stdout. The
// destructor removes the temporary file of an output that was not committed.
class OutputFile {
 public:
  explicit OutputFile(std::string out) : out_(std::move(out)) {
    if (out_ == "-") return;
    tmp_ = fmt::format("{}.tmp.{}", out_, ::getpid());
    file_.open(tmp_);
    DNALLM_CHECK(file_.good(), ExitCode::kUsage, "cannot write --out {} ({}): {}", out_, tmp_,
                 errno_string());
  }
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile() {
    if (tmp_.empty() || committed_) return;
    file_.close();
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
  }
  std::ostream& stream() { return out_ == "-" ? std::cout : file_; }
  void commit() {
    stream().flush();
    DNALLM_CHECK(stream().good(), ExitCode::kUsage, "write to --out {} failed: {}", out_,
                 errno_string());
    if (tmp_.empty()) return;
    file_.close();
    DNALLM_CHECK(!file_.fail(), ExitCode::kUsage, "write to --out {} failed: {}", out_,
                 errno_string());
    std::error_code ec;
    std::filesystem::rename(tmp_, out_, ec);
    DNALLM_CHECK(!ec, ExitCode::kUsage, "cannot rename {} to --out {}: {}", tmp_, out_,
                 ec.message());
    committed_ = true;
  }

 private:
  std::string out_, tmp_;
  std::ofstream file_;
  bool committed_ = false;
};

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

void report_truncated(const infer::RunCounts& c, int64_t max_seq) {
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

struct EmbedArgs {
  CommonArgs common;
  std::string input, out;
  std::string pooling = "mean";
  std::string sequence_column = "sequence";
  bool rc_average = false;
};

struct GenerateArgs {
  CommonArgs common;
  std::string input;
  std::string out = "-";
  std::vector<std::string> prompts;
  models::GenerateOptions generate = [] {
    models::GenerateOptions g;
    g.greedy = false;
    return g;
  }();
  bool no_cache = false;
};

struct PredictArgs {
  CommonArgs common;
  std::string input;
  std::string out = "-";
};

CLI::App* add_embed(CLI::App& app, EmbedArgs& a) {
  auto* embed = app.add_subcommand(
      "embed",
      "embeddings of every sequence of a FASTA/FASTQ/CSV/TSV/JSONL file: --out F.npy or "
      "F.safetensors, ids in F.ids.txt (docs/inference.md). Under dnallm-launch each rank "
      "embeds its share and rank 0 merges them in input order.");
  add_common(*embed, a.common);
  embed->add_option("--input", a.input, "sequences (FASTA/FASTQ, plain or gzip; CSV/TSV/JSONL)")
      ->required();
  embed->add_option("--out", a.out, "output file, *.npy or *.safetensors")->required();
  embed
      ->add_option("--pooling", a.pooling,
                   "mean (over real tokens) | cls (first token) | tokens (every token)")
      ->capture_default_str();
  embed->add_option("--sequence-column", a.sequence_column, "tables: the sequence column")
      ->capture_default_str();
  embed->add_flag("--rc-average", a.rc_average,
                  "average each pooled embedding with its reverse complement's (strand-invariant)");
  return embed;
}

CLI::App* add_generate(CLI::App& app, GenerateArgs& a) {
  auto* gen = app.add_subcommand(
      "generate", "continue prompts with a causal LM (KV cache, batched); writes FASTA");
  add_common(*gen, a.common);
  models::GenerateOptions& g = a.generate;
  gen->add_option("--input", a.input, "prompts: FASTA/FASTQ or a table");
  gen->add_option("--prompt", a.prompts, "a prompt sequence (repeatable; instead of --input)");
  gen->add_option("--out", a.out, "FASTA output ('-': stdout)")->capture_default_str();
  gen->add_option("--max-new-tokens", g.max_new_tokens, "tokens to generate per prompt")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  gen->add_option("--temperature", g.temperature, "sampling temperature; 0: greedy")
      ->capture_default_str();
  gen->add_option("--top-k", g.top_k, "sample among the k most likely tokens (0: all)")
      ->capture_default_str();
  gen->add_option("--seed", g.seed, "sampling seed")->capture_default_str();
  gen->add_flag("--no-cache", a.no_cache, "recompute the whole prefix for every token (slow)");
  return gen;
}

CLI::App* add_predict(CLI::App& app, PredictArgs& a) {
  auto* pred = app.add_subcommand(
      "predict",
      "a classifier's label and class probabilities (or a regressor's value) for "
      "every sequence; writes CSV");
  add_common(*pred, a.common);
  pred->add_option("--input", a.input, "sequences (FASTA/FASTQ or a table)")->required();
  pred->add_option("--out", a.out, "CSV output ('-': stdout)")->capture_default_str();
  return pred;
}

// Rank 0 appends the closed parts of every rank, in rank order, into `out_path`
// (Note [Embedding shares]).
void merge_parts(const std::vector<std::string>& parts, const std::string& out_path, int64_t dim,
                 bool per_token) {
  infer::EmbeddingFileWriter out(out_path, dim, per_token);
  infer::merge_embedding_parts(parts, dim, out);
  out.close();
  spdlog::info("merged {} parts: {} sequences, {} rows -> {}", parts.size(), out.sequences(),
               out.rows(), out_path);
}

int run_embed(const EmbedArgs& a, const cluster::Topology& topo, const cluster::EnvMap& env) {
  init_logging("infer", a.common.log_level);
  set_log_identity(topo.rank);
  check_input(a.input);
  const auto pool = infer::parse_pooling(a.pooling);
  const bool per_token = pool == infer::Pooling::kTokens;
  infer::check_embedding_out_name(a.out);
  auto reads = model_files(a.common.model_dir);
  reads.push_back(a.input);
  check_output(a.out, reads);
  check_output(infer::ids_path(a.out), reads, "--out's ids file");
  if (per_token && infer::offsets_path(a.out) != infer::ids_path(a.out) && a.out.size() > 4 &&
      a.out.compare(a.out.size() - 4, 4, ".npy") == 0) {
    check_output(infer::offsets_path(a.out), reads, "--out's offsets file");
  }
  auto loaded = load(a.common, topo.local_rank);
  infer::SequenceInput input(a.input, a.sequence_column, loaded.codec->keeps_case());
  const uint64_t n = input.count();
  const uint64_t w = static_cast<uint64_t>(topo.world_size);
  const uint64_t r = static_cast<uint64_t>(topo.rank);
  const uint64_t begin = n * r / w, end = n * (r + 1) / w;
  input.select(begin, end);
  const int64_t dim = loaded.model->spec().hidden_size;
  infer::EmbedOptions eo;
  eo.pooling = pool;
  eo.rc_average = a.rc_average;
  eo.batch_size = bounded_batch_size(a.common.batch_size, loaded.model->spec().max_seq_length);
  comm::ProcessGroup group;
  std::vector<std::string> parts;  // one a rank (Note [Embedding shares])
  std::unique_ptr<infer::EmbeddingSink> sink;
  if (w > 1) {
    group = connect(topo, env);
    for (uint64_t k = 0; k < w; ++k) parts.push_back(fmt::format("{}.part{}", a.out, k));
    sink = std::make_unique<infer::EmbeddingPartWriter>(parts[r], dim);
  } else {
    sink = std::make_unique<infer::EmbeddingFileWriter>(a.out, dim, per_token);
  }
  const auto counts =
      infer::embed(loaded.model, *loaded.codec, input, end - begin, *sink, eo, loaded.device);
  sink->close();
  report_truncated(counts, infer::longest_input(loaded.model->spec()));
  if (w == 1) {
    spdlog::info("{} sequences -> {}", counts.sequences, a.out);
    return 0;
  }
  group.comm->barrier()->wait();  // every part is closed
  if (r == 0) merge_parts(parts, a.out, dim, per_token);
  return 0;
}

// --prompt: a small FASTA of them in the temporary directory, removed when this goes.
class PromptFile {
 public:
  explicit PromptFile(const std::vector<std::string>& prompts) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      DNALLM_CHECK(!prompts[i].empty(), ExitCode::kUsage,
                   "--prompt number {} is empty: give at least one base", i + 1);
    }
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("dnallm-infer-prompts-{}.fa", ::getpid());
    std::ofstream f(path_);
    for (size_t i = 0; i < prompts.size(); ++i) {
      f << ">prompt" << i + 1 << "\n" << prompts[i] << "\n";
    }
    f.close();
    DNALLM_CHECK(!f.fail(), ExitCode::kUsage, "cannot write the prompts to {}: {}", path_.string(),
                 errno_string());
  }
  PromptFile(const PromptFile&) = delete;
  PromptFile& operator=(const PromptFile&) = delete;
  ~PromptFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Sampling options a user typed: one line naming the option when they cannot work.
void check_generate_options(const models::GenerateOptions& g) {
  DNALLM_CHECK(std::isfinite(g.temperature) && g.temperature >= 0, ExitCode::kUsage,
               "--temperature {}: give a finite number > 0 (or 0 for greedy decoding)",
               g.temperature);
  DNALLM_CHECK(g.top_k >= 0, ExitCode::kUsage,
               "--top-k {}: give a number >= 0 (0: sample from the whole vocabulary)", g.top_k);
}

int run_generate(const GenerateArgs& a, const cluster::Topology& topo) {
  init_logging("infer", a.common.log_level);
  DNALLM_CHECK(a.input.empty() != a.prompts.empty(), ExitCode::kUsage,
               "give either --input FILE or one or more --prompt SEQ");
  models::GenerateOptions g = a.generate;
  check_generate_options(g);
  std::optional<PromptFile> prompts;
  if (!a.prompts.empty()) prompts.emplace(a.prompts);
  const std::string prompt_file = prompts ? prompts->path() : a.input;
  check_input(prompt_file);
  auto reads = model_files(a.common.model_dir);
  reads.push_back(prompt_file);
  check_output(a.out, reads);
  g.use_cache = !a.no_cache;
  g.greedy = g.temperature <= 0;
  auto loaded = load(a.common, topo.local_rank);
  infer::SequenceInput input(prompt_file, "sequence", loaded.codec->keeps_case());
  const uint64_t n = input.count();
  infer::GenerateRun run;
  run.generate = g;
  run.batch_size = bounded_batch_size(a.common.batch_size, loaded.model->spec().max_seq_length);
  OutputFile out(a.out);
  std::ostream& os = out.stream();
  const auto counts = infer::generate(loaded.model, *loaded.codec, input, n, run, loaded.device,
                                      [&](const std::string& id, const std::string& bases) {
                                        os << '>' << id << " generated\n" << bases << '\n';
                                      });
  report_truncated(counts, loaded.model->spec().max_seq_length - g.max_new_tokens);
  out.commit();
  return 0;
}

// One CSV row: a regressor's value, or a classifier's label and class probabilities.
void write_prediction(std::ostream& os, bool classify, const std::string& id,
                      const std::vector<float>& v) {
  if (!classify) {
    os << id << ',' << fmt::format("{:.6g}", v[0]) << '\n';
    return;
  }
  const auto best = std::max_element(v.begin(), v.end()) - v.begin();
  os << id << ',' << best;
  for (float p : v) os << ',' << fmt::format("{:.6f}", p);
  os << '\n';
}

int run_predict(const PredictArgs& a, const cluster::Topology& topo) {
  init_logging("infer", a.common.log_level);
  check_input(a.input);
  auto reads = model_files(a.common.model_dir);
  reads.push_back(a.input);
  check_output(a.out, reads);
  auto loaded = load(a.common, topo.local_rank);
  infer::SequenceInput input(a.input, "sequence", loaded.codec->keeps_case());
  const uint64_t n = input.count();
  OutputFile out(a.out);
  std::ostream& os = out.stream();
  const auto& o = loaded.model->spec();
  const bool classify = o.task == models::Task::kClassification;
  os << "id," << (classify ? "label" : "value");
  for (int64_t k = 0; classify && k < o.num_labels; ++k) os << ",prob_" << k;
  os << '\n';
  const auto counts =
      infer::predict(loaded.model, *loaded.codec, input, n,
                     bounded_batch_size(a.common.batch_size, o.max_seq_length), loaded.device,
                     [&](const std::string& id, const std::vector<float>& v) {
                       write_prediction(os, classify, id, v);
                     });
  report_truncated(counts, infer::longest_input(o));
  out.commit();
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Note [Zero-shot variant effects] (variants.hpp): variants and mutagenesis.

struct VariantArgs {
  CommonArgs common;
  std::string reference, vcf, out = "-";
  infer::VariantOptions options;
};

struct MutagenesisArgs {
  CommonArgs common;
  std::string input, record, region, out = "-";
  infer::VariantOptions options;
};

void add_variant_options(CLI::App& cmd, infer::VariantOptions& o) {
  cmd.add_option("--window", o.window,
                 "bases of context centred on the variant (0: the model's length, at most 1024)")
      ->capture_default_str();
  cmd.add_flag("--rc-average", o.rc_average,
               "average the score with the reverse-complement strand's");
}

CLI::App* add_variants(CLI::App& app, VariantArgs& a) {
  auto* cmd = app.add_subcommand(
      "variants",
      "zero-shot effect of every single-nucleotide variant of a VCF: log-likelihood ratio of the "
      "alternative against the reference allele (causal models) or the masked marginal (masked "
      "models); writes TSV chrom, pos, ref, alt, score in VCF order (docs/published-models.md)");
  add_common(*cmd, a.common);
  cmd->add_option("--reference", a.reference,
                  "reference FASTA (plain, or bgzip with its .fai/.gzi; indexed on first use)")
      ->required();
  cmd->add_option("--vcf", a.vcf, "variants (VCF/BCF, plain or bgzip)")->required();
  cmd->add_option("--out", a.out, "TSV output ('-': stdout)")->capture_default_str();
  add_variant_options(*cmd, a.options);
  return cmd;
}

CLI::App* add_mutagenesis(CLI::App& app, MutagenesisArgs& a) {
  auto* cmd = app.add_subcommand(
      "mutagenesis",
      "in-silico saturation mutagenesis: every substitution of a region scored as `variants` "
      "scores a SNV; writes TSV pos, ref, A, C, G, T");
  add_common(*cmd, a.common);
  cmd->add_option("--input", a.input, "FASTA/FASTQ holding the sequence")->required();
  cmd->add_option("--record", a.record, "the record's name (default: the first record)");
  cmd->add_option("--region", a.region, "START-END, 1-based and inclusive")->required();
  cmd->add_option("--out", a.out, "TSV output ('-': stdout)")->capture_default_str();
  add_variant_options(*cmd, a.options);
  return cmd;
}

char upper_base(char c) { return static_cast<char>(std::toupper(static_cast<unsigned char>(c))); }

// What `variants` skipped, for the closing lines.
struct VariantCounts {
  int64_t records = 0, scored = 0, not_snv = 0, unscored = 0;
};

int run_variants(const VariantArgs& a) {
  init_logging("infer", a.common.log_level);
  check_input(a.vcf);
  check_input(a.reference);
  auto reads = model_files(a.common.model_dir);
  reads.push_back(a.vcf);
  reads.push_back(a.reference);
  check_output(a.out, reads);
  infer::ReferenceGenome genome(a.reference);
  infer::VcfReader vcf(a.vcf);
  auto loaded = load(a.common, 0);
  infer::VariantOptions vo = a.options;
  vo.batch_size = a.common.batch_size;
  OutputFile out(a.out);
  std::ostream& os = out.stream();
  // The sites in flight, in VCF order, with the alternatives scored (the others are not SNVs).
  struct Site {
    infer::VcfRecord record;
    std::vector<size_t> scored;  // indices into record.alts
  };
  std::vector<Site> sites;
  size_t first = 0;  // the index of sites[0]
  VariantCounts counts;
  int64_t soft_masked = 0;  // sites whose window holds lower-case bases
  infer::VariantScorer scorer(loaded.model, *loaded.codec, vo, loaded.device,
                              [&](size_t site, const std::vector<double>& scores) {
                                const auto& s = sites[site - first];
                                for (size_t k = 0; k < s.scored.size(); ++k) {
                                  if (std::isnan(scores[k])) {
                                    ++counts.unscored;
                                    continue;
                                  }
                                  os << s.record.chrom << '\t' << s.record.pos + 1 << '\t'
                                     << s.record.ref << '\t' << s.record.alts[s.scored[k]] << '\t'
                                     << fmt::format("{:.6f}", scores[k]) << '\n';
                                  ++counts.scored;
                                }
                              });
  os << "chrom\tpos\tref\talt\tscore\n";  // (after the scorer accepted the model)
  infer::Progress progress("variants", 0);
  infer::VcfRecord rec;
  while (vcf.next(rec)) {
    ++counts.records;
    const int64_t length = genome.length(rec.chrom);
    DNALLM_CHECK(length >= 0, ExitCode::kBadData,
                 "--vcf {}: contig \"{}\" ({}:{}) is not in --reference {} ({} contigs): give "
                 "the reference the VCF was called against (contig names must match)",
                 a.vcf, rec.chrom, rec.chrom, rec.pos + 1, a.reference, genome.contigs());
    DNALLM_CHECK(rec.pos >= 0 && rec.pos + static_cast<int64_t>(rec.ref.size()) <= length,
                 ExitCode::kBadData, "--vcf {}: {}:{} lies past the contig's end ({} bases)", a.vcf,
                 rec.chrom, rec.pos + 1, length);
    const auto actual =
        genome.fetch(rec.chrom, rec.pos, rec.pos + static_cast<int64_t>(rec.ref.size()));
    DNALLM_CHECK(actual == rec.ref, ExitCode::kBadData,
                 "--vcf {}: {}:{} has REF {} but the reference holds {} there: the VCF was called "
                 "against another reference (or another version of it)",
                 a.vcf, rec.chrom, rec.pos + 1, rec.ref, actual);
    Site site{rec, {}};
    infer::VariantSite query;
    if (infer::is_snv_allele(rec.ref)) {
      for (size_t k = 0; k < rec.alts.size(); ++k) {
        if (!infer::is_snv_allele(rec.alts[k])) continue;
        site.scored.push_back(k);
        query.alts.push_back(rec.alts[k][0]);
      }
    }
    counts.not_snv += static_cast<int64_t>(rec.alts.size() - site.scored.size());
    if (site.scored.empty()) continue;
    const auto [begin, end] = infer::centred_window(rec.pos, scorer.window(), length);
    query.window = genome.fetch(rec.chrom, begin, end, loaded.codec->keeps_case());
    soft_masked += std::any_of(query.window.begin(), query.window.end(),
                               [](char c) { return std::islower(static_cast<unsigned char>(c)); })
                       ? 1
                       : 0;
    query.offset = rec.pos - begin;
    sites.push_back(std::move(site));
    scorer.add(std::move(query));
    progress.advance(1);
    // Sites already written go (the scorer calls back in order, a batch at a time).
    if (sites.size() >= 4 * static_cast<size_t>(vo.batch_size)) {
      scorer.flush();
      first += sites.size();
      sites.clear();
    }
  }
  scorer.flush();
  progress.finish();
  out.commit();
  spdlog::info(
      "{} VCF records: {} alternatives scored; {} not single-nucleotide (indels, "
      "multi-base or symbolic alleles) skipped; {} with an alternative piece outside the "
      "vocabulary skipped; {} model rows",
      counts.records, counts.scored, counts.not_snv, counts.unscored, scorer.forward_rows());
  if (soft_masked > 0) {
    spdlog::warn(
        "{} sites have lower-case (soft-masked) bases in their window, which the model's "
        "own tokenizer reads as unknown tokens; give --uppercase to read them as bases",
        soft_masked);
  }
  if (counts.not_snv + counts.unscored > 0) {
    spdlog::warn("{} alternatives were not scored (see the line above)",
                 counts.not_snv + counts.unscored);
  }
  return 0;
}

int run_mutagenesis(const MutagenesisArgs& a) {
  init_logging("infer", a.common.log_level);
  check_input(a.input);
  auto reads = model_files(a.common.model_dir);
  reads.push_back(a.input);
  check_output(a.out, reads);
  int64_t first = 0, last = 0;
  const auto dash = a.region.find('-');
  try {
    DNALLM_CHECK(dash != std::string::npos, ExitCode::kUsage, "");
    first = std::stoll(a.region.substr(0, dash));
    last = std::stoll(a.region.substr(dash + 1));
  } catch (const std::exception&) {
    first = last = 0;
  }
  DNALLM_CHECK(first >= 1 && last >= first, ExitCode::kUsage,
               "--region {}: give START-END, 1-based and inclusive, START <= END (e.g. 101-200)",
               a.region);
  auto loaded = load(a.common, 0);
  data::SequenceReader reader(a.input);
  reader.set_keep_case(loaded.codec->keeps_case());
  data::SequenceRecord rec;
  bool found = false;
  while (reader.next(rec)) {
    if (a.record.empty() || rec.name == a.record) {
      found = true;
      break;
    }
  }
  DNALLM_CHECK(found, ExitCode::kBadData, "--input {}: {}", a.input,
               a.record.empty() ? std::string("holds no record")
                                : fmt::format("no record named \"{}\"", a.record));
  const auto length = static_cast<int64_t>(rec.bases.size());
  DNALLM_CHECK(last <= length, ExitCode::kUsage, "--region {}: the record {} has {} bases",
               a.region, rec.name, length);
  infer::VariantOptions vo = a.options;
  vo.batch_size = a.common.batch_size;
  OutputFile out(a.out);
  std::ostream& os = out.stream();
  const std::string bases = "ACGT";
  std::vector<int64_t> positions;  // of the sites added, in order
  infer::VariantScorer scorer(
      loaded.model, *loaded.codec, vo, loaded.device,
      [&](size_t site, const std::vector<double>& scores) {
        const int64_t pos = positions[site];
        const char ref = rec.bases[static_cast<size_t>(pos)];
        os << pos + 1 << '\t' << ref;
        size_t k = 0;
        for (const char b : bases) {
          if (b == upper_base(ref)) {
            os << "\t0";
          } else {
            os << '\t'
               << (std::isnan(scores[k]) ? std::string("NA") : fmt::format("{:.6f}", scores[k]));
            ++k;
          }
        }
        os << '\n';
      });
  os << "pos\tref\tA\tC\tG\tT\n";
  for (int64_t pos = first - 1; pos < last; ++pos) {
    const char ref = upper_base(rec.bases[static_cast<size_t>(pos)]);
    infer::VariantSite q;
    for (const char b : bases) {
      if (b != ref) q.alts.push_back(b);
    }
    const auto [begin, end] = infer::centred_window(pos, scorer.window(), length);
    q.window = rec.bases.substr(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
    q.offset = pos - begin;
    positions.push_back(pos);
    scorer.add(std::move(q));
  }
  scorer.flush();
  out.commit();
  spdlog::info("{} positions x 3 substitutions scored ({} model rows)", last - first + 1,
               scorer.forward_rows());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dnallm-infer: batched inference with an exported model. Exit codes: 0 ok, 2 usage, 3 bad "
      "data, 4 a peer rank failed, 5 a damaged model file."};
  app.require_subcommand(1);
  EmbedArgs embed_args;
  GenerateArgs gen_args;
  PredictArgs pred_args;
  VariantArgs variant_args;
  MutagenesisArgs mutagenesis_args;
  auto* embed = add_embed(app, embed_args);
  auto* gen = add_generate(app, gen_args);
  auto* pred = add_predict(app, pred_args);
  auto* variants = add_variants(app, variant_args);
  add_mutagenesis(app, mutagenesis_args);
  return run_main("dnallm-infer", app, argc, argv, [&]() -> int {
    const auto env = cluster::current_env();
    const auto topo = cluster::detect_topology(env);
    if (embed->parsed()) return run_embed(embed_args, topo, env);
    DNALLM_CHECK(topo.world_size == 1, ExitCode::kUsage,
                 "generate, predict, variants and mutagenesis run as one process (this is rank "
                 "{} of {}); only embed splits its input over ranks",
                 topo.rank, topo.world_size);
    if (gen->parsed()) return run_generate(gen_args, topo);
    if (pred->parsed()) return run_predict(pred_args, topo);
    if (variants->parsed()) return run_variants(variant_args);
    return run_mutagenesis(mutagenesis_args);
  });
}
