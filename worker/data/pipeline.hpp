// Builds the data pipeline from a dnallm::Config: what the trainer calls.
//
//   auto tok   = dnallm::data::make_tokenizer(config);
//   auto train = dnallm::data::make_train_loader(config, tok, rank, world_size, resume_state);
//   auto eval  = dnallm::data::make_eval_loader(config, tok, rank, world_size);  // may be null
//   Batch b    = train->next();      // step-major, micro-step-minor order
//   json st    = train->state().to_json();   // save with the checkpoint, after a step
//
// Window length (genomes): token_budget = max_seq_length - 2 ([CLS] t.. [SEP]) for masked
// LM, - 1 for causal LM; bases = tokenizer.bases_for_tokens(token_budget) (char: the same;
// k-mer stride 1: + k - 1; stride k: × k; BPE: an estimate, truncated to the budget).
//
// Which data: data.train_files / eval_files list files, globs, directories, @LIST files or one
// genome store (Note [Data file lists], data_files.hpp). data.format "auto" decides by
// extension (.fa/.fasta/.fna/.fq/.fastq[.gz], .csv, .tsv, .jsonl). Genomes use GenomeDataset
// (over FASTA/FASTQ read into memory, or a memory-mapped store: Note [Genome storage]), tables
// TableDataset.
// Eval data: data.eval_files when given (tiled, not shuffled); else, with
// data.eval_fraction > 0, the held-out tail of the training genomes, or with data.eval_regions
// its BED intervals of them; else none (nullptr). The train split of genomes excludes what is
// held out; data.train_regions and data.exclude_regions narrow it (Note [Genome regions],
// genome_dataset.hpp).
#pragma once

#include <memory>
#include <optional>

#include "core/config.hpp"
#include "worker/data/data_loader.hpp"
#include "worker/data/genome_dataset.hpp"
#include "worker/data/tokenizer.hpp"

namespace dnallm::data {

// Genome window length in bases for this config and tokenizer.
int64_t window_bases(const Config& config, const Tokenizer& tokenizer);

ObjectiveOptions objective_options(const Config& config);

// `split`: kTrain for train_files (minus the held-out tail), kEval for eval_files or the tail.
std::shared_ptr<const Dataset> make_dataset(const Config& config, const Tokenizer& tokenizer,
                                            Split split);

// Loader options from the config for this rank (train: shuffled; eval: in order, accum 1).
LoaderOptions loader_options(const Config& config, int rank, int world_size, bool train);

// `first_step`: the optimizer steps done before `resume`'s cursor (the resumed step; Note
// [Sequence-length warm-up]). data.seq_len_warmup on tables is Error(kUsage). `train_set`: the
// training set already opened (make_dataset(config, *tokenizer, kTrain): a warm spare opens
// it before it knows its rank); null: opened here.
std::unique_ptr<DataLoader> make_train_loader(
    const Config& config, std::shared_ptr<const Tokenizer> tokenizer, int rank, int world_size,
    const std::optional<SamplerState>& resume = std::nullopt, int64_t first_step = 0,
    std::shared_ptr<const Dataset> train_set = nullptr);

// nullptr when the config has no evaluation data.
// Note [Evaluation covers each sample once]: an evaluation scores the first
// min(dataset size, `max_samples`) samples of the eval stream (in order), each exactly once
// over all ranks together: rank r takes its slices of each global micro-batch of
// micro_batch_size x world_size samples, and micro-batches past the end come out short or
// empty (rows == 0). `max_samples` 0 means training.eval_batches x micro_batch_size x
// world_size: each rank runs at most eval_batches micro-batches, and a set smaller than that
// is scored once, not wrapped around (which counted rows twice on 2 ranks).
std::unique_ptr<DataLoader> make_eval_loader(const Config& config,
                                             std::shared_ptr<const Tokenizer> tokenizer, int rank,
                                             int world_size, uint64_t max_samples = 0);

}  // namespace dnallm::data
