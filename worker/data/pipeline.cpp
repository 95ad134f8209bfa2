#include "worker/data/pipeline.hpp"

#include <algorithm>
#include <filesystem>

#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/data_files.hpp"
#include "worker/data/genome_cache.hpp"
#include "worker/data/genome_store.hpp"
#include "worker/data/sequence_reader.hpp"
#include "worker/data/table_dataset.hpp"

namespace dnallm::data {
namespace {

// BPE training sample: the first 1 Mbases of the training genomes (~10 s of one core for a
// 4096 vocabulary on E. coli; 2 Mbases took 2.5 times that).
constexpr size_t kBpeSampleBases = 1'000'000;

bool is_table_format(cfg::DataFormat f) {
  return f == cfg::DataFormat::kCsv || f == cfg::DataFormat::kTsv || f == cfg::DataFormat::kJsonl;
}

cfg::DataFormat resolve_format(const Config& config, const std::vector<std::string>& files) {
  if (config.data.format != cfg::DataFormat::kAuto) return config.data.format;
  if (files.empty()) return cfg::DataFormat::kFasta;
  return format_from_extension(files.front());  // kAuto: sequence readers sniff the first character
}

// Up to `max_bases` bases of the training genomes, in lines of 2,000 bases, for BPE training.
std::vector<std::string> bpe_sample(const Config& config, size_t max_bases) {
  std::vector<std::string> lines;
  size_t total = 0;
  const auto files = expand_data_files(config.data.train_files, "data.train_files");
  if (is_genome_store(files.front())) {
    const auto store = GenomeStore::open(files.front());
    for (size_t r = 0; r < store->record_count() && total < max_bases; ++r) {
      const auto len = static_cast<size_t>(store->record_length(r));
      for (size_t pos = 0; pos < len && total < max_bases; pos += 2000) {
        lines.emplace_back();
        store->read(r, static_cast<int64_t>(pos),
                    static_cast<int64_t>(std::min<size_t>(2000, len - pos)), lines.back());
        total += lines.back().size();
      }
    }
    return lines;
  }
  for (const auto& f : files) {
    SequenceReader reader(f, config.data.format, config.data.on_bad_record);
    SequenceRecord rec;
    while (total < max_bases && reader.next(rec)) {
      for (size_t pos = 0; pos < rec.bases.size() && total < max_bases; pos += 2000) {
        lines.push_back(rec.bases.substr(pos, 2000));
        total += lines.back().size();
      }
    }
  }
  return lines;
}

// tokenizer.kind = "hf": the directory's own tokenizer.json.
std::shared_ptr<const Tokenizer> hf_tokenizer(const Config& config) {
  const auto& t = config.tokenizer;
  const std::string& dir = t.path.empty() ? config.model.init_from : t.path;
  DNALLM_CHECK(!dir.empty(), ExitCode::kUsage,
               "tokenizer.kind = \"hf\" needs tokenizer.path (a Hugging Face model directory "
               "with a BPE tokenizer.json, e.g. DNABERT-2's) or model.init_from");
  return load_hf_bpe_tokenizer(dir);
}

// tokenizer.kind = "bpe": the model at tokenizer.path, else one trained on the data.
std::shared_ptr<const Tokenizer> bpe_tokenizer(const Config& config) {
  const auto& t = config.tokenizer;
  if (!t.path.empty() && std::filesystem::exists(t.path)) return load_bpe_model(t.path);
  if (config.data.train_files.empty()) {
    fail(ExitCode::kUsage,
         "tokenizer.kind = \"bpe\" needs tokenizer.path (a trained model) or data.train_files to "
         "train on");
  }
  spdlog::info("training a BPE tokenizer (vocab {}) on up to {} bases of {}", t.vocab_size,
               kBpeSampleBases, config.data.train_files.front());
  auto tok = train_bpe_tokenizer(bpe_sample(config, kBpeSampleBases), t.vocab_size);
  if (!t.path.empty()) save_bpe_model(*tok, t.path);
  return tok;
}

}  // namespace

std::shared_ptr<const Tokenizer> make_tokenizer(const Config& config) {
  const auto& t = config.tokenizer;
  switch (t.kind) {
    case cfg::TokenizerKind::kChar:
      return make_char_tokenizer();
    case cfg::TokenizerKind::kKmer:
      return make_kmer_tokenizer(static_cast<int>(t.k), static_cast<int>(t.stride));
    case cfg::TokenizerKind::kNt:
      return make_nt_tokenizer(static_cast<int>(t.k));
    case cfg::TokenizerKind::kBpe:
      return bpe_tokenizer(config);
    case cfg::TokenizerKind::kHf:
      return hf_tokenizer(config);
  }
  fail(ExitCode::kFailure, "make_tokenizer: tokenizer.kind {} has no tokenizer",
       static_cast<int>(t.kind));
}

ObjectiveOptions objective_options(const Config& config) {
  ObjectiveOptions o;
  o.objective = objective_from(config.model.arch, config.model.task);
  o.max_seq_length = config.model.max_seq_length;
  o.mlm_probability = config.data.mlm_probability;
  o.packing = config.data.packing;
  o.num_labels = config.model.num_labels;
  if (o.mlm_probability < 0 || o.mlm_probability > 1) {
    fail(ExitCode::kUsage, "data.mlm_probability = {} must be in [0, 1]", o.mlm_probability);
  }
  if (token_budget(o) <= 0) {
    fail(ExitCode::kUsage, "model.max_seq_length = {} leaves no room for tokens", o.max_seq_length);
  }
  return o;
}

int64_t window_bases(const Config& config, const Tokenizer& tokenizer) {
  return tokenizer.bases_for_tokens(token_budget(objective_options(config)));
}

std::shared_ptr<const Dataset> make_dataset(const Config& config, const Tokenizer& tokenizer,
                                            Split split) {
  const auto& d = config.data;
  const bool eval_files = split == Split::kEval && !d.eval_files.empty();
  const std::string key = eval_files ? "data.eval_files" : "data.train_files";
  if ((eval_files ? d.eval_files : d.train_files).empty())
    fail(ExitCode::kUsage, "{} is empty: give at least one file", key);
  // Note [Data file lists] (data_files.hpp): globs, directories, @LIST files, a genome store.
  const auto files = expand_data_files(eval_files ? d.eval_files : d.train_files, key);
  const bool store = is_genome_store(files.front());
  const cfg::DataFormat format = store ? cfg::DataFormat::kFasta : resolve_format(config, files);
  const auto policy = d.on_bad_record;
  const bool any_regions =
      !d.train_regions.empty() || !d.eval_regions.empty() || !d.exclude_regions.empty();
  const bool mixed = !d.weights.empty() || d.sampling_temperature != 1.0;
  if (is_table_format(format) && mixed) {
    fail(ExitCode::kUsage,
         "data.weights / data.sampling_temperature mix the windows of genome files, but {} is a "
         "table; remove them",
         files.front());
  }
  if (is_table_format(format) && any_regions) {
    fail(ExitCode::kUsage,
         "data.train_regions / eval_regions / exclude_regions are BED intervals of genomes, but "
         "{} is a table; remove them",
         files.front());
  }
  if (!d.eval_regions.empty() && !d.eval_files.empty()) {
    fail(ExitCode::kUsage,
         "data.eval_regions holds out intervals of the training genomes and data.eval_files "
         "names other files to evaluate on: set one");
  }
  if (is_table_format(format)) {
    TableOptions t;
    t.format = format;
    t.sequence_column = d.sequence_column;
    t.label_column = d.label_column;
    t.task = config.model.task;
    t.num_labels = config.model.num_labels;
    t.on_bad_record = policy;
    t.cache_dir = d.cache_dir;
    t.reverse_complement = split == Split::kTrain ? d.reverse_complement : 0.0;  // eval: as written
    if (split == Split::kTrain && !d.eval_files.empty()) {
      // train tables are whole; eval tables come from eval_files
    } else if (split == Split::kEval && !eval_files) {
      fail(ExitCode::kUsage,
           "evaluation on tables needs data.eval_files (eval_fraction splits genomes only)");
    }
    auto table = std::make_shared<TableDataset>(files, t);
    spdlog::info("data ({}): {}", split == Split::kEval ? "eval" : "train", table->describe());
    return table;
  }
  if (config.model.task != cfg::Task::kPretrain) {
    fail(ExitCode::kUsage,
         "model.task = \"{}\" needs labelled tables (csv, tsv, jsonl with data.label_column), but "
         "{} is a {} file",
         cfg::spelling(config.model.task), files.front(),
         format == cfg::DataFormat::kAuto ? "sequence" : cfg::spelling(format));
  }
  GenomeOptions g;
  g.window_bases = window_bases(config, tokenizer);
  g.sampling = d.sampling;
  g.window_stride = d.window_stride;
  g.n_policy = d.n_policy;
  g.max_n_fraction = d.max_n_fraction;
  g.reverse_complement = d.reverse_complement;
  g.eval_fraction = d.eval_fraction;
  g.samples_per_epoch = d.samples_per_epoch;
  g.format = format;
  g.on_bad_record = policy;
  if (split == Split::kTrain) {
    g.split = d.eval_fraction > 0 ? Split::kTrain : Split::kAll;
  } else {
    // Evaluation: deterministic tiling, no augmentation.
    g.split = eval_files ? Split::kAll : Split::kEval;
    g.sampling = cfg::Sampling::kTile;
    g.window_stride = 0;
    g.reverse_complement = 0.0;
    g.samples_per_epoch = 0;
  }
  // Note [Genome regions] (genome_dataset.hpp).
  auto bed = [](const std::string& path) -> std::shared_ptr<const GenomeRegions> {
    return path.empty() ? nullptr : std::make_shared<const GenomeRegions>(read_bed(path));
  };
  if (!eval_files) {
    g.include = split == Split::kTrain ? bed(d.train_regions) : nullptr;
    if (split == Split::kTrain) {  // Note [Genome weights]: training windows only
      g.file_weights = d.weights;
      g.temperature = d.sampling_temperature;
    }
    g.held_out = bed(d.eval_regions);
  }
  g.exclude = bed(d.exclude_regions);
  // Note [Genome storage] (genome_dataset.hpp): a store is memory-mapped, files read; Note
  // [Genome cache] (genome_cache.hpp): large files are packed once into a cached store.
  std::string store_dir = store ? files.front() : "";
  if (!store) {
    GenomeCacheOptions c;
    c.threshold_bases = d.pack_threshold_bases;
    c.cache_dir = d.cache_dir;
    c.format = format;
    c.skip_bad_records = policy == BadRecordPolicy::kSkip;
    c.key = key;
    store_dir = cached_genome_store(files, c);
  }
  auto ds = !store_dir.empty()
                ? std::make_shared<GenomeDataset>(GenomeStore::open(store_dir), g, store_dir)
                : std::make_shared<GenomeDataset>(files, g);
  spdlog::info("data ({}): {}", split == Split::kEval ? "eval" : "train", ds->describe());
  return ds;
}

LoaderOptions loader_options(const Config& config, int rank, int world_size, bool train) {
  LoaderOptions o;
  o.rank = rank;
  o.world_size = world_size;
  o.micro_batch_size = config.training.micro_batch_size;
  o.grad_accum_steps = train ? config.training.grad_accum_steps : 1;
  o.seed = static_cast<uint64_t>(config.training.seed);
  o.shuffle = train;
  o.num_workers = static_cast<int>(config.data.dataloader_num_workers);
  o.prefetch_factor = static_cast<int>(config.data.prefetch_factor);
  o.group_by_length = config.data.group_by_length;
  o.objective = objective_options(config);
  o.objective.mask_all_selected = !train;
  return o;
}

std::unique_ptr<DataLoader> make_train_loader(const Config& config,
                                              std::shared_ptr<const Tokenizer> tokenizer, int rank,
                                              int world_size,
                                              const std::optional<SamplerState>& resume,
                                              int64_t first_step,
                                              std::shared_ptr<const Dataset> train_set) {
  auto ds = train_set ? std::move(train_set) : make_dataset(config, *tokenizer, Split::kTrain);
  auto options = loader_options(config, rank, world_size, true);
  // Note [Sequence-length warm-up] (data_loader.hpp).
  options.seq_len_warmup = config.data.seq_len_warmup;
  options.first_step = static_cast<uint64_t>(std::max<int64_t>(0, first_step));
  if (!options.seq_len_warmup.empty() && dynamic_cast<const GenomeDataset*>(ds.get()) == nullptr) {
    fail(ExitCode::kUsage,
         "data.seq_len_warmup cuts genome windows into shorter rows, but data.train_files ({}) "
         "are tables, whose records have lengths of their own; remove the warm-up or train on "
         "FASTA/FASTQ",
         config.data.train_files.front());
  }
  return std::make_unique<DataLoader>(ds, std::move(tokenizer), options,
                                      resume ? &*resume : nullptr);
}

std::unique_ptr<DataLoader> make_eval_loader(const Config& config,
                                             std::shared_ptr<const Tokenizer> tokenizer, int rank,
                                             int world_size, uint64_t max_samples) {
  if (config.data.eval_files.empty() && config.data.eval_fraction <= 0 &&
      config.data.eval_regions.empty())
    return nullptr;
  auto ds = make_dataset(config, *tokenizer, Split::kEval);
  auto options = loader_options(config, rank, world_size, false);
  // Note [Evaluation covers each sample once] (pipeline.hpp).
  if (max_samples == 0) {
    max_samples = static_cast<uint64_t>(std::max<int64_t>(1, config.training.eval_batches) *
                                        config.training.micro_batch_size * world_size);
  }
  options.max_samples = std::max<uint64_t>(1, std::min<uint64_t>(ds->size(), max_samples));
  return std::make_unique<DataLoader>(ds, std::move(tokenizer), options);
}

}  // namespace dnallm::data
