// dnallm-eval: scores an exported model (dnallm-train's <checkpoint.dir>/final) on a FASTA
// file (language models: bits per base) or a labelled table (classifiers: accuracy, MCC, macro F1).
// Prints ONE JSON object on stdout.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <string_view>

#include <nlohmann/json.hpp>

#include "cluster/topology.hpp"
#include "core/classification.hpp"
#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/output_file.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/pipeline.hpp"
#include "worker/data/sequence_reader.hpp"
#include "worker/infer/inference.hpp"
#include "worker/infer/scoring.hpp"
#include "worker/models/model_dir.hpp"
#include "worker/models/model_dir_options.hpp"
#include "worker/models/transformer/transformer.hpp"
#include "worker/train/data_source.hpp"
#include "worker/train/trainer.hpp"

namespace {

using namespace dnallm;

// --max-bases: a language model's score counts the first `limit` windows, each once. Rows
// past them keep their inputs (the batch shape stays) but lose their labels, so they are not
// scored. (The loader itself stops at the end of the file: Note [Evaluation covers each
// sample once] in worker/data/pipeline.hpp.)
class FirstRowsSource final : public train::BatchSource {
 public:
  FirstRowsSource(train::BatchSource& inner, uint64_t limit) : inner_(inner), limit_(limit) {}
  data::Batch next() override {
    data::Batch b = inner_.next();
    const uint64_t rows = static_cast<uint64_t>(b.rows);
    const uint64_t keep = delivered_ >= limit_ ? 0 : std::min(rows, limit_ - delivered_);
    delivered_ += rows;
    if (keep < rows && b.labels.size() == rows * static_cast<uint64_t>(b.seq_len)) {
      for (size_t i = keep * static_cast<size_t>(b.seq_len); i < b.labels.size(); ++i) {
        if (b.labels[i] == data::kIgnoreIndex) continue;
        b.labels[i] = data::kIgnoreIndex;
        --b.num_label_tokens;
      }
    }
    return b;
  }
  void rewind() override {
    inner_.rewind();
    delivered_ = 0;
  }

 private:
  train::BatchSource& inner_;
  uint64_t limit_;
  uint64_t delivered_ = 0;
};

// Entropy (bits) of the A/C/G/T frequencies of the first `max_bases` bases (0: all).
double order0_bits_per_base(const std::string& path, int64_t max_bases) {
  data::SequenceReader reader(path);
  if (max_bases > 0) reader.set_max_bases(max_bases);  // Note [Long records]
  data::SequenceRecord record;
  constexpr std::string_view kBases = "ACGT";
  double counts[4] = {0, 0, 0, 0};
  int64_t seen = 0;
  while ((max_bases <= 0 || seen < max_bases) && reader.next(record)) {
    for (char c : record.bases) {
      if (max_bases > 0 && seen >= max_bases) break;
      ++seen;
      const auto base = kBases.find(c);  // anything else (N, lower case) counts as seen only
      if (base != std::string_view::npos) ++counts[base];
    }
  }
  const double total = counts[0] + counts[1] + counts[2] + counts[3];
  double h = 0.0;
  for (double c : counts) {
    if (c > 0) h -= c / total * std::log2(c / total);
  }
  return total > 0 ? h : 0.0;
}

// One DNA sequence a line; upper-cased unless `keep_case` (Note [Sequence codec]).
std::vector<std::string> read_sequences(const std::string& path, bool keep_case) {
  std::ifstream f(path);
  DNALLM_CHECK(f.good(), ExitCode::kBadData, "cannot read {}: {}", path, errno_string());
  std::vector<std::string> out;
  std::string line;
  int64_t number = 0;
  while (std::getline(f, line)) {
    ++number;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty()) continue;
    for (auto& c : line) {
      const char upper = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      DNALLM_CHECK(upper == 'A' || upper == 'C' || upper == 'G' || upper == 'T' || upper == 'N',
                   ExitCode::kBadData,
                   "{}:{}: '{}' is not a base (A, C, G, T, N): give one DNA sequence a line", path,
                   number, c);
      if (!keep_case) c = upper;
    }
    out.push_back(line);
  }
  DNALLM_CHECK(!out.empty(), ExitCode::kBadData, "{} holds no sequence", path);
  return out;
}

struct EvalArgs {
  std::string model_dir, fasta, table;
  std::string log_level = "warn", device_spec = "auto";
  std::string logits_in, logits_out, adapter_dir, tokenizer_dir, base_dir;
  int64_t max_bases = 0, batch_size = 8, seed = 42, window = 0;
  bool uppercase = false;
};

void add_options(CLI::App& app, EvalArgs& a) {
  models::add_model_dir_options(app, a.model_dir, a.base_dir, a.uppercase);
  auto* fasta_opt = app.add_option("--fasta", a.fasta, "FASTA/FASTQ file (plain or gzip) to score");
  auto* table_opt = app.add_option("--table", a.table, "labelled table for a classification model");
  fasta_opt->excludes(table_opt);
  auto* logits_opt = app.add_option(
      "--logits", a.logits_in,
      "one DNA sequence a line: tokenize them with the model's own tokenizer, pad, and write "
      "input_ids, attention_mask and logits to --out (a Hugging Face directory or our export)");
  logits_opt->excludes(fasta_opt)->excludes(table_opt);
  app.add_option("--out", a.logits_out, "safetensors file that --logits writes");
  app.add_option("--adapter", a.adapter_dir,
                 "PEFT LoRA adapter directory applied on --model (with --logits; also writes "
                 "merged_logits)");
  app.add_option("--tokenizer", a.tokenizer_dir,
                 "directory of the tokenizer files when not in --model (with --logits)");
  app.add_option("--max-bases", a.max_bases, "score about this many bases (0: the whole file)");
  app.add_option("--window", a.window,
                 "--fasta on a Hugging Face model: bases a scored window (0: the model's length, "
                 "at most 4096 causal, 512 masked; docs/published-models.md)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", a.batch_size, "sequences per forward pass")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--device", a.device_spec,
                 "auto (cuda:LOCAL_RANK when there is a GPU) | cpu | cuda | cuda:N")
      ->capture_default_str();
  app.add_option("--seed", a.seed, "seed of the masked-LM masking");
  app.add_option("--log-level", a.log_level, "trace|debug|info|warn|error");
}

// --logits: the model's own tokenizer (Note [Sequence codec]), padded as it pads, one forward
// pass, and the layout of the Hugging Face fixtures' expected.safetensors (input_ids,
// attention_mask, logits; with an adapter also merged_logits, after merging it into the base).
// A sequence longer than the model's positions is an error, not cut; a model that computes past
// them (rotary, ALiBi, long convolutions) takes up to kMaxLogitsTokens (issue 22: a 10 MB line
// allocated gigabytes of attention before it was bounded).
constexpr int64_t kMaxLogitsTokens = 8192;

// Every file --logits reads, which --out must not be (Note [Outputs never inputs],
// core/output_file.cpp): the sequences and the files of each model directory it names.
std::vector<std::string> logits_reads(const EvalArgs& a) {
  std::vector<std::string> reads{a.logits_in};
  for (const std::string* dir : {&a.model_dir, &a.adapter_dir, &a.tokenizer_dir, &a.base_dir}) {
    std::error_code ec;
    if (dir->empty() || !std::filesystem::is_directory(*dir, ec)) continue;
    for (const auto& e : std::filesystem::directory_iterator(*dir, ec)) {
      reads.push_back(e.path().string());
    }
  }
  return reads;
}

int write_logits(const EvalArgs& a) {
  DNALLM_CHECK(a.logits_out != "-", ExitCode::kUsage,
               "--out -: --logits writes a safetensors file, not standard output; name a file");
  check_output(a.logits_out, logits_reads(a));
  require_regular_output(a.logits_out, "--out",
                         "the safetensors file is written beside it and renamed over it");
  auto loaded = a.adapter_dir.empty()
                    ? models::load_model_dir(a.model_dir, a.base_dir, a.tokenizer_dir)
                    : models::load_model_dir(a.adapter_dir, a.model_dir, a.tokenizer_dir);
  loaded.codec->set_uppercase(a.uppercase);
  const auto sequences = read_sequences(a.logits_in, loaded.codec->keeps_case());
  data::LowerCaseReport lower_case;
  const auto& o = loaded.model->spec();
  const int64_t positions = o.usable_positions();
  const int64_t limit =
      o.extends_past_max_length ? std::max(kMaxLogitsTokens, positions) : positions;
  std::vector<std::vector<int64_t>> rows;
  for (size_t i = 0; i < sequences.size(); ++i) {
    bool cut = false;
    rows.push_back(loaded.codec->frame(sequences[i], limit, &cut));
    lower_case.add(sequences[i], rows.back(), loaded.codec->unk_id());
    DNALLM_CHECK(
        !cut, ExitCode::kBadData,
        "{}: sequence {} ({} bases) needs more than the {} positions of {}{}: cut it "
        "into windows of at most that many tokens",
        a.logits_in, i + 1, sequences[i].size(), limit, a.model_dir,
        o.extends_past_max_length ? " (the most --logits runs)" : " (max_position_embeddings)");
  }
  lower_case.warn();
  const auto in =
      infer::pad_batch(rows, loaded.codec->pad_id(), torch::kCPU, loaded.codec->pads_left());
  torch::InferenceMode inference;
  std::vector<std::pair<std::string, torch::Tensor>> out = {{"input_ids", in.input_ids},
                                                            {"attention_mask", in.attention_mask}};
  out.emplace_back("logits", loaded.model->forward(in).logits.to(torch::kFloat32));
  if (loaded.source.layout == models::DirLayout::kPeftAdapter) {
    loaded.model->merge_lora();
    out.emplace_back("merged_logits", loaded.model->forward(in).logits.to(torch::kFloat32));
  }
  models::save_safetensors(a.logits_out, out, {{"format", "pt"}});
  nlohmann::ordered_json summary;
  summary["model"] = a.model_dir;
  summary["out"] = a.logits_out;
  summary["rows"] = in.input_ids.size(0);
  summary["tokens"] = in.input_ids.size(1);
  summary["logits"] = out[2].second.sizes().vec();
  std::cout << summary.dump() << std::endl;
  return 0;
}

// The evaluation configuration of an exported model: its own framing and tokenizer, the whole
// `input` once, every N kept (masked).
Config eval_config(const models::ModelSpec& o, const data::Tokenizer& tokenizer,
                   const std::string& input, const EvalArgs& a) {
  Config config;
  // The framing (bert: masked, gpt: causal) is what evaluation needs of model.arch.
  config.model.arch = o.causal() ? cfg::Arch::kGpt : cfg::Arch::kBert;
  config.model.task = models::config_task(o.task);
  config.model.max_seq_length = o.usable_positions();
  config.model.num_labels = o.num_labels;
  config.tokenizer.kind = tokenizer.tokenizer_kind();
  config.data.eval_files = {input};
  config.training.micro_batch_size = a.batch_size;
  config.training.seed = a.seed;
  config.data.n_policy = cfg::NPolicy::kMask;
  config.data.max_n_fraction = 1.0;
  return config;
}

// What one scoring pass reads: the model on its device and `batches` batches of `source`.
struct Scoring {
  models::LanguageModel model{nullptr};
  torch::Device device{torch::kCPU};
  train::LoaderSource* source = nullptr;
  int64_t batches = 0;
};

// Classifier: accuracy, MCC, macro F1/precision/recall and mean loss over the rows with a
// label in range.
void score_classifier(Scoring& s, nlohmann::ordered_json& out) {
  const int64_t labels = s.model->spec().num_labels;
  ConfusionMatrix confusion(labels, std::vector<double>(labels, 0.0));
  double nll = 0, rows = 0;
  for (int64_t i = 0; i < s.batches; ++i) {
    auto batch = s.source->next();
    auto in = train::to_inputs(batch, s.model, s.device);
    auto result = s.model->forward(in);
    nll += result.loss_sum.item<double>();
    // One read of the batch's predictions (not one per row: each is a device sync).
    const auto pred = result.logits.argmax(-1).to(torch::kCPU).contiguous();
    const int64_t* predicted = pred.data_ptr<int64_t>();
    for (int64_t r = 0; r < batch.rows; ++r) {
      const auto truth = batch.labels[r];
      if (truth < 0 || truth >= labels) continue;
      confusion[truth][predicted[r]] += 1;
      rows += 1;
    }
  }
  // Note [Classification scores] (core/classification.hpp): scikit-learn's definitions.
  const auto scores = classification_scores(confusion);
  out["accuracy"] = scores.accuracy;
  out["mcc"] = scores.mcc;
  out["f1"] = scores.f1;
  out["precision"] = scores.precision;
  out["recall"] = scores.recall;
  out["loss"] = rows > 0 ? nll / rows : 0.0;
  out["rows"] = static_cast<int64_t>(rows);
}

// Regressor: mean squared error over every row.
void score_regressor(Scoring& s, nlohmann::ordered_json& out) {
  double se = 0, rows = 0;
  for (int64_t i = 0; i < s.batches; ++i) {
    auto batch = s.source->next();
    auto in = train::to_inputs(batch, s.model, s.device);
    se += s.model->forward(in).loss_sum.item<double>();
    rows += double(batch.rows);
  }
  out["mse"] = rows > 0 ? se / rows : 0.0;
  out["rows"] = static_cast<int64_t>(rows);
}

// --fasta on a Hugging Face directory (or a PEFT adapter on one): Note [Likelihood of a genome]
// (bits per base of a causal model, pseudo-log-likelihood of a masked one).
int score_hub(const EvalArgs& a, models::LoadedModel loaded) {
  DNALLM_CHECK(a.table.empty(), ExitCode::kUsage,
               "--table scores a classifier fine-tuned by dnallm-train (its final/ or best/); {} "
               "is {}: fine-tune from it (model.init_from) and score the result",
               a.model_dir, loaded.source.describe());
  const auto device = infer::resolve_device(
      a.device_spec, cluster::detect_topology(cluster::current_env()).local_rank);
  loaded.model->to(device);
  loaded.codec->set_uppercase(a.uppercase);
  infer::LikelihoodOptions lo;
  lo.window = a.window;
  lo.max_bases = a.max_bases;
  lo.batch_size = a.batch_size;
  const auto r = infer::score_likelihood(loaded.model, *loaded.codec, a.fasta, lo, device);
  nlohmann::ordered_json out;
  out["model"] = a.model_dir;
  out["input"] = a.fasta;
  out["device"] = device.str();
  out["metric"] = r.pseudo ? "pseudo_log_likelihood" : "next_token";
  out["bits_per_base"] = r.bits_per_base();
  out["order0_bits_per_base"] = order0_bits_per_base(a.fasta, a.max_bases);
  out["loss"] = r.tokens > 0 ? -r.log_prob / double(r.tokens) : 0.0;
  out["tokens"] = r.tokens;
  out["bases"] = r.bases;
  out["windows"] = r.windows;
  out["window"] = r.window;
  out["forward_passes"] = r.forward_passes;
  std::cout << out.dump() << std::endl;
  return 0;
}

int score(const EvalArgs& a) {
  DNALLM_CHECK(!a.fasta.empty() || !a.table.empty(), ExitCode::kUsage,
               "give --fasta FILE (language model) or --table FILE (classifier)");
  const std::string input = a.fasta.empty() ? a.table : a.fasta;
  DNALLM_CHECK(std::filesystem::is_regular_file(input), ExitCode::kBadData,
               "{} does not exist or is not a file", input);
  auto loaded = models::load_model_dir(a.model_dir, a.base_dir);
  if (loaded.source.layout != models::DirLayout::kOurs) return score_hub(a, std::move(loaded));
  Scoring s;
  s.model = loaded.model;
  const auto& o = s.model->spec();
  auto tokenizer = data::load_tokenizer(a.model_dir + "/tokenizer.json");
  const Config config = eval_config(o, *tokenizer, input, a);
  // The whole file once (Note [Evaluation covers each sample once]); --max-bases cuts below.
  auto loader =
      data::make_eval_loader(config, tokenizer, 0, 1, std::numeric_limits<uint64_t>::max());
  DNALLM_CHECK(loader != nullptr && loader->dataset_size() > 0, ExitCode::kBadData,
               "{} holds no sequence long enough to score", input);
  // The same choice as dnallm-infer's --device (docs/inference.md), after the model and the
  // input were checked: a refusal never loads CUDA (Note [Lazy CUDA]).
  s.device = infer::resolve_device(a.device_spec,
                                   cluster::detect_topology(cluster::current_env()).local_rank);
  s.model->to(s.device);
  s.model->eval();
  uint64_t samples = loader->dataset_size();
  if (a.max_bases > 0) {
    const auto window = data::window_bases(config, *tokenizer);
    samples = std::min<uint64_t>(samples, uint64_t((a.max_bases + window - 1) / window));
  }
  s.batches = int64_t((samples + a.batch_size - 1) / a.batch_size);
  train::LoaderSource source(std::move(loader));
  s.source = &source;

  nlohmann::ordered_json out;
  out["model"] = a.model_dir;
  out["input"] = input;
  out["device"] = s.device.str();
  torch::InferenceMode inference;
  if (o.task == models::Task::kPretrain) {
    FirstRowsSource once(source, samples);
    auto r = train::evaluate(s.model, once, s.batches, s.device, train::bases_of_label(tokenizer));
    out["bits_per_base"] = r.bits_per_base;
    out["order0_bits_per_base"] = order0_bits_per_base(input, a.max_bases);
    out["loss"] = r.loss;
    out["tokens"] = r.tokens;
    out["bases"] = r.bases;
  } else if (o.task == models::Task::kClassification) {
    score_classifier(s, out);
  } else {
    score_regressor(s, out);
  }
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dnallm-eval: score an exported model directory on a FASTA file (bits per base, against "
      "the order-0 entropy of the same bases) or, for a classifier, on a labelled "
      "CSV/TSV/JSONL table (accuracy, MCC, macro F1, precision, recall). Prints one JSON object."};
  EvalArgs a;
  add_options(app, a);
  return run_main("dnallm-eval", app, argc, argv, [&]() -> int {
    init_logging("eval", a.log_level);
    if (a.logits_in.empty()) return score(a);
    DNALLM_CHECK(!a.logits_out.empty(), ExitCode::kUsage, "--logits needs --out FILE.safetensors");
    return write_logits(a);
  });
}
