// dnallm-infer embed (docs/inference.md).
//
// Multi-process embedding (Note [Embedding shares]): under dnallm-launch, mpirun or srun every
// rank embeds a contiguous share of the records ([r*N/W, (r+1)*N/W)) into
// <out>.part<r>.{f32,ids.txt,rows}; after a barrier over the process group, rank 0 appends
// the parts in rank order into the final file (input order) and deletes them. The output
// directory must be shared by all ranks.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/log.hpp"
#include "worker/infer/cli_common.hpp"

namespace dnallm::infer::cli {
namespace {

struct EmbedArgs {
  CommonArgs common;
  std::string input, out;
  std::string pooling = "mean";
  std::string sequence_column = "sequence";
  bool rc_average = false;
};

// Rank 0 appends the closed parts of every rank, in rank order, into `out_path`
// (Note [Embedding shares]).
void merge_parts(const std::vector<std::string>& parts, const std::string& out_path, int64_t dim,
                 bool per_token) {
  EmbeddingFileWriter out(out_path, dim, per_token);
  merge_embedding_parts(parts, dim, out);
  out.close();
  spdlog::info("merged {} parts: {} sequences, {} rows -> {}", parts.size(), out.sequences(),
               out.rows(), out_path);
}

class Embed final : public CommandWith<EmbedArgs> {
 public:
  explicit Embed(CLI::App& app) {
    EmbedArgs& a = args_;
    auto* embed = subcommand(
        app, "embed",
        "embeddings of every sequence of a FASTA/FASTQ/CSV/TSV/JSONL file: --out F.npy or "
        "F.safetensors, ids in F.ids.txt (docs/inference.md). Under dnallm-launch each rank "
        "embeds its share and rank 0 merges them in input order.");
    embed->add_option("--input", a.input, "sequences (FASTA/FASTQ, plain or gzip; CSV/TSV/JSONL)")
        ->required();
    embed->add_option("--out", a.out, "output file, *.npy or *.safetensors")->required();
    embed
        ->add_option("--pooling", a.pooling,
                     "mean (over real tokens) | cls (first token) | tokens (every token)")
        ->capture_default_str();
    embed->add_option("--sequence-column", a.sequence_column, "tables: the sequence column")
        ->capture_default_str();
    embed->add_flag(
        "--rc-average", a.rc_average,
        "average each pooled embedding with its reverse complement's (strand-invariant)");
  }

  int run(const cluster::Topology& topo, const cluster::EnvMap& env) override {
    const EmbedArgs& a = args_;
    init_logging("infer", a.common.log_level);
    set_log_identity(topo.rank);
    check_input(a.input);
    const auto pool = parse_pooling(a.pooling);
    const bool per_token = pool == Pooling::kTokens;
    check_embedding_out_name(a.out);
    auto reads = model_files(a.common.model_dir);
    reads.push_back(a.input);
    // Note [Outputs never inputs] (core/output_file.cpp): the files are renamed into place
    // whole, and the header is written last, so none of them can be a device or a FIFO.
    const auto check = [&](const std::string& path, const char* flag) {
      check_output(path, reads, flag);
      require_regular_output(path, flag, kEmbeddingHeaderLast);
    };
    check(a.out, "--out");
    check(ids_path(a.out), "--out's ids file");
    if (per_token && offsets_path(a.out) != ids_path(a.out) && a.out.size() > 4 &&
        a.out.compare(a.out.size() - 4, 4, ".npy") == 0) {
      check(offsets_path(a.out), "--out's offsets file");
    }
    auto loaded = load(a.common, topo.local_rank);
    SequenceInput input(a.input, a.sequence_column, loaded.codec->keeps_case());
    const uint64_t n = input.count();
    const uint64_t w = static_cast<uint64_t>(topo.world_size);
    const uint64_t r = static_cast<uint64_t>(topo.rank);
    const uint64_t begin = n * r / w, end = n * (r + 1) / w;
    input.select(begin, end);
    const int64_t dim = loaded.model->spec().hidden_size;
    EmbedOptions eo;
    eo.pooling = pool;
    eo.rc_average = a.rc_average;
    eo.batch_size = bounded_batch_size(a.common.batch_size, loaded.model->spec().max_seq_length);
    comm::ProcessGroup group;
    std::vector<std::string> parts;  // one a rank (Note [Embedding shares])
    std::unique_ptr<EmbeddingSink> sink;
    if (w > 1) {
      group = connect(topo, env);
      for (uint64_t k = 0; k < w; ++k) parts.push_back(fmt::format("{}.part{}", a.out, k));
      sink = std::make_unique<EmbeddingPartWriter>(parts[r], dim);
    } else {
      sink = std::make_unique<EmbeddingFileWriter>(a.out, dim, per_token);
    }
    const auto counts =
        embed(loaded.model, *loaded.codec, input, end - begin, *sink, eo, loaded.device);
    sink->close();
    report_truncated(counts, longest_input(loaded.model->spec()));
    if (w == 1) {
      spdlog::info("{} sequences -> {}", counts.sequences, a.out);
      return 0;
    }
    group.comm->barrier()->wait();  // every part is closed
    if (r == 0) merge_parts(parts, a.out, dim, per_token);
    return 0;
  }
};

}  // namespace

std::unique_ptr<Command> add_embed(CLI::App& app) { return std::make_unique<Embed>(app); }

}  // namespace dnallm::infer::cli
