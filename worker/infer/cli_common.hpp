// What every dnallm-infer subcommand shares: the model options and loading (Note [One model
// loader]), the checks of inputs and outputs (Note [Outputs never inputs]), the job's process
// group (Note [Embedding shares]) and the Command interface that main() runs. Each subcommand
// lives in its own cli_<name>.cpp; see docs/inference.md.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cluster/topology.hpp"
#include "comm/bootstrap.hpp"
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

// Note [Outputs never inputs] (cli_common.cpp): exit 2 before any work when `out` is a
// directory, one of `reads`, or in a missing directory.
void check_output(const std::string& out, const std::vector<std::string>& reads,
                  const char* flag = "--out");

// What a command reads from --model (besides its --input).
std::vector<std::string> model_files(const std::string& dir);

// An output file written whole or not at all (Note [Outputs never inputs]): the stream goes to
// <out>.tmp.<pid> in the same directory, renamed to `out` by commit(); "-" is stdout. The
// destructor removes the temporary file of an output that was not committed.
class OutputFile {
 public:
  explicit OutputFile(std::string out);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();
  std::ostream& stream();
  void commit();

 private:
  std::string out_, tmp_;
  std::ofstream file_;
  bool committed_ = false;
};

// Note [Batches bounded by tokens] (cli_common.cpp).
int64_t bounded_batch_size(int64_t requested, int64_t max_seq_length);

// The closing warnings of a batch loop: lower-case bases, cut sequences.
void report_truncated(const RunCounts& c, int64_t max_seq);

// The job's process group (Note [Embedding shares]), a barrier between host processes (gloo).
comm::ProcessGroup connect(const cluster::Topology& topo, const cluster::EnvMap& env);

// Exit 2 unless this is the only process: `what` does not split its work over ranks.
void require_one_process(const cluster::Topology& topo, const char* what);

// One subcommand: add_to() declares its options on `app`; run() after parsing.
class Command {
 public:
  virtual ~Command() = default;
  bool parsed() const { return app_ != nullptr && app_->parsed(); }
  virtual int run(const cluster::Topology& topo, const cluster::EnvMap& env) = 0;

 protected:
  CLI::App* app_ = nullptr;
};

std::unique_ptr<Command> add_embed(CLI::App& app);        // cli_embed.cpp
std::unique_ptr<Command> add_generate(CLI::App& app);     // cli_generate.cpp
std::unique_ptr<Command> add_predict(CLI::App& app);      // cli_predict.cpp
std::unique_ptr<Command> add_variants(CLI::App& app);     // cli_variants.cpp
std::unique_ptr<Command> add_mutagenesis(CLI::App& app);  // cli_variants.cpp

}  // namespace dnallm::infer::cli
