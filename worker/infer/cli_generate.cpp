// dnallm-infer generate: continue prompts with a causal LM (docs/inference.md).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <fmt/format.h>
#include <unistd.h>

#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/infer/cli_common.hpp"

namespace dnallm::infer::cli {
namespace {

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

class Generate final : public CommandWith<GenerateArgs> {
 public:
  explicit Generate(CLI::App& app) {
    GenerateArgs& a = args_;
    auto* gen = subcommand(app, "generate",
                           "continue prompts with a causal LM (KV cache, batched); writes FASTA");
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
  }

  int run(const cluster::Topology& topo, const cluster::EnvMap&) override {
    const GenerateArgs& a = args_;
    require_one_process(topo, "generate");
    init_logging("infer", a.common.log_level);
    DNALLM_CHECK(a.input.empty() != a.prompts.empty(), ExitCode::kUsage,
                 "give either --input FILE or one or more --prompt SEQ");
    models::GenerateOptions g = a.generate;
    check_generate_options(g);
    std::optional<PromptFile> prompts;
    if (!a.prompts.empty()) prompts.emplace(a.prompts);
    const std::string prompt_file = prompts ? prompts->path() : a.input;
    check_output(a.out, checked_reads(a.common.model_dir, {prompt_file}));
    g.use_cache = !a.no_cache;
    g.greedy = g.temperature <= 0;
    auto loaded = load(a.common, topo.local_rank);
    SequenceInput input(prompt_file, "sequence", loaded.codec->keeps_case());
    const uint64_t n = input.count();
    GenerateRun run;
    run.generate = g;
    run.batch_size = bounded_batch_size(a.common.batch_size, loaded.model->spec().max_seq_length);
    OutputFile out(a.out);
    std::ostream& os = out.stream();
    const auto counts = generate(loaded.model, *loaded.codec, input, n, run, loaded.device,
                                 [&](const std::string& id, const std::string& bases) {
                                   os << '>' << id << " generated\n" << bases << '\n';
                                 });
    report_truncated(counts, loaded.model->spec().usable_positions() - g.max_new_tokens);
    out.commit();
    return 0;
  }
};

}  // namespace

std::unique_ptr<Command> add_generate(CLI::App& app) { return std::make_unique<Generate>(app); }

}  // namespace dnallm::infer::cli
