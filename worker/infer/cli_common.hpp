// What every dnallm-infer subcommand shares: the model options and loading (Note [One model
// loader]), the checks of inputs (outputs: Note [Outputs never inputs], core/output_file.cpp),
// the job's process group (Note [Embedding shares]) and the Command interface that main() runs.
// Each subcommand lives in its own cli_<name>.cpp; see docs/inference.md.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "cluster/topology.hpp"
#include "comm/bootstrap.hpp"
#include "core/output_file.hpp"
#include "worker/data/sequence_codec.hpp"
#include "worker/infer/inference.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::infer::cli {

// The options every subcommand takes.
struct CommonArgs {
  bool uppercase = false;
  std::string model_dir, base_dir;
  std::string device = "auto";
  std::string quantize = "none";
  int64_t batch_size = 32;
  std::string log_level = "info";
};

void add_common(CLI::App& cmd, CommonArgs& a);

// A model directory loaded for inference: on its device, in eval mode, quantised if asked.
struct Loaded {
  models::LanguageModel model{nullptr};
  std::shared_ptr<data::SequenceCodec> codec;
  torch::Device device{torch::kCPU};
};

Loaded load(const CommonArgs& a, int local_rank);

// --input must be an existing file (exit 3).
void check_input(const std::string& path);

// What a command reads from --model (besides its --input).
std::vector<std::string> model_files(const std::string& dir);

// Each of `inputs` checked in order (check_input), and every file the command reads: the model's
// (model_files) and `inputs`, what check_output refuses to overwrite.
std::vector<std::string> checked_reads(const std::string& model_dir,
                                       const std::vector<std::string>& inputs);

// Note [Batches bounded by tokens] (cli_common.cpp).
int64_t bounded_batch_size(int64_t requested, int64_t max_seq_length);

// The closing warnings of a batch loop: lower-case bases, cut sequences.
void report_truncated(const RunCounts& c, int64_t max_seq);

// The job's process group (Note [Embedding shares]), a barrier between host processes (gloo).
comm::ProcessGroup connect(const cluster::Topology& topo, const cluster::EnvMap& env);

// Note [Row shares]: a table that several ranks write, each the rows of its contiguous share
// of the work (variants, mutagenesis). One rank: `out` itself (an OutputFile, header first).
// Several: each rank writes its rows to <out>.part<r> (an OutputFile: whole or not at all);
// commit() closes it, waits at a barrier over the process group, and rank 0 writes `out` (again
// an OutputFile): the header, then the parts in rank order, so the rows are in input order
// whatever the world size; then it deletes the parts. The output directory must be shared by
// all ranks; "-" (stdout) is one process only. Must be constructed and committed on every rank.
class RowShares {
 public:
  RowShares(const cluster::Topology& topo, const cluster::EnvMap& env, const std::string& out,
            std::string header);
  // Exit 2 when `out` cannot be shared (stdout under several ranks): call before any work.
  static void check(const cluster::Topology& topo, const std::string& out);
  // This rank's rows.
  std::ostream& rows() { return part_->stream(); }
  // [begin, end) of this rank's contiguous share of `n` items.
  std::pair<int64_t, int64_t> share(int64_t n) const;
  void commit();

 private:
  int rank_ = 0, world_size_ = 1;
  std::string out_, header_;
  comm::ProcessGroup group_;
  std::vector<std::string> parts_;
  std::unique_ptr<OutputFile> part_;
};

// Exit 2 unless this is the only process: `what` does not split its work over ranks.
void require_one_process(const cluster::Topology& topo, const char* what);

// One subcommand: its constructor declares its options on the program's CLI::App; run() after
// parsing.
class Command {
 public:
  virtual ~Command() = default;
  bool parsed() const { return app_ != nullptr && app_->parsed(); }
  virtual int run(const cluster::Topology& topo, const cluster::EnvMap& env) = 0;

 protected:
  CLI::App* app_ = nullptr;
};

// A subcommand whose options fill an `Args` (which holds the CommonArgs as `common`).
template <class Args>
class CommandWith : public Command {
 protected:
  // Declares the subcommand `name` on `app` with the options every subcommand takes; the
  // subcommand's own options go on what it returns.
  CLI::App* subcommand(CLI::App& app, const char* name, const char* help) {
    app_ = app.add_subcommand(name, help);
    add_common(*app_, args_.common);
    return app_;
  }

  Args args_;
};

std::unique_ptr<Command> add_embed(CLI::App& app);        // cli_embed.cpp
std::unique_ptr<Command> add_generate(CLI::App& app);     // cli_generate.cpp
std::unique_ptr<Command> add_predict(CLI::App& app);      // cli_predict.cpp
std::unique_ptr<Command> add_variants(CLI::App& app);     // cli_variants.cpp
std::unique_ptr<Command> add_mutagenesis(CLI::App& app);  // cli_variants.cpp

}  // namespace dnallm::infer::cli
