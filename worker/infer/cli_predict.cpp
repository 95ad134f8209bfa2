// dnallm-infer predict: a classifier's labels and probabilities, a regressor's value.
#include <algorithm>

#include <fmt/format.h>

#include "core/log.hpp"
#include "worker/infer/cli_common.hpp"

namespace dnallm::infer::cli {
namespace {

struct PredictArgs {
  CommonArgs common;
  std::string input;
  std::string out = "-";
};

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

class Predict final : public CommandWith<PredictArgs> {
 public:
  explicit Predict(CLI::App& app) {
    PredictArgs& a = args_;
    auto* pred =
        subcommand(app, "predict",
                   "a classifier's label and class probabilities (or a regressor's value) for "
                   "every sequence; writes CSV");
    pred->add_option("--input", a.input, "sequences (FASTA/FASTQ or a table)")->required();
    pred->add_option("--out", a.out, "CSV output ('-': stdout)")->capture_default_str();
  }

  int run(const cluster::Topology& topo, const cluster::EnvMap&) override {
    const PredictArgs& a = args_;
    require_one_process(topo, "predict");
    init_logging("infer", a.common.log_level);
    check_output(a.out, checked_reads(a.common.model_dir, {a.input}));
    auto loaded = load(a.common, topo.local_rank);
    SequenceInput input(a.input, "sequence", loaded.codec->keeps_case());
    const uint64_t n = input.count();
    OutputFile out(a.out);
    std::ostream& os = out.stream();
    const auto& o = loaded.model->spec();
    const bool classify = o.task == models::Task::kClassification;
    os << "id," << (classify ? "label" : "value");
    for (int64_t k = 0; classify && k < o.num_labels; ++k) os << ",prob_" << k;
    os << '\n';
    const auto counts =
        predict(loaded.model, *loaded.codec, input, n,
                bounded_batch_size(a.common.batch_size, o.max_seq_length), loaded.device,
                [&](const std::string& id, const std::vector<float>& v) {
                  write_prediction(os, classify, id, v);
                });
    report_truncated(counts, longest_input(o));
    out.commit();
    return 0;
  }
};

}  // namespace

std::unique_ptr<Command> add_predict(CLI::App& app) { return std::make_unique<Predict>(app); }

}  // namespace dnallm::infer::cli
