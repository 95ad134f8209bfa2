// [data]: the keys of DataConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

void data_keys(std::vector<KeyDesc>& out) {
  SectionKeys<DataConfig>(out, "data", &Config::data)
      .key("train_files", &DataConfig::train_files,
           "FASTA/FASTQ (plain, gzip, BGZF) or CSV/TSV/JSONL files to train on")
      .key("eval_files", &DataConfig::eval_files, "held-out files for evaluation")
      .choice("format", &DataConfig::format,
              "file format; `auto`: from the first file's extension (sequence files without a "
              "known one are recognised by their first character)")
      .choice("on_bad_record", &DataConfig::on_bad_record,
              "a malformed record: `error` stops the run (exit 3, naming file and line); "
              "`skip` drops it and counts it")
      .choice("sampling", &DataConfig::sampling,
              "genomes: `random` windows, or `tile`: windows at a fixed stride")
      .range("window_stride", &DataConfig::window_stride, 0, kInf,
             "`tile`: bases between window starts; 0 = window length")
      .choice("n_policy", &DataConfig::n_policy, "runs of N: `skip` windows with N, or `mask` them")
      .range("max_n_fraction", &DataConfig::max_n_fraction, 0, 1,
             "`skip`: windows with more N than this are skipped")
      .range("reverse_complement", &DataConfig::reverse_complement, 0, 1,
             "RC augmentation: probability of reverse-complementing a training window (genomes) "
             "or record (tables: the label is kept); evaluation reads the data as written. "
             "Also spelled `rc_augment`")
      .range("eval_fraction", &DataConfig::eval_fraction, 0, 0.9,
             "hold out the last fraction of each genome for evaluation")
      .range("samples_per_epoch", &DataConfig::samples_per_epoch, 0, kInf,
             "`random`: windows per epoch; 0 = genome length / window")
      .key("sequence_column", &DataConfig::sequence_column,
           "tables (CSV/TSV header, JSONL field): the column holding the sequence")
      .key("label_column", &DataConfig::label_column,
           "tables: the column holding the label (`model.task` classification or regression)")
      .range("mlm_probability", &DataConfig::mlm_probability, 0.001, 0.999,
             "masked LM: fraction of tokens selected")
      .range("dataloader_num_workers", &DataConfig::dataloader_num_workers, 0, 64,
             "background threads preparing batches")
      .range("prefetch_factor", &DataConfig::prefetch_factor, 1, 64, "batches queued per worker")
      .key("pin_memory", &DataConfig::pin_memory, "pinned host buffers when training on CUDA")
      .key("group_by_length", &DataConfig::group_by_length,
           "tables: batch records of similar length together")
      .key("packing", &DataConfig::packing, "pack short records into `max_seq_length` rows")
      .key("cache_dir", &DataConfig::cache_dir,
           "where .fai / offset indexes go when the data directory is read-only")
      .key("seq_len_warmup", &DataConfig::seq_len_warmup,
           "staged sequence-length warm-up (HyenaDNA's; Note [Sequence-length warm-up]), e.g. "
           "`[{steps = 100, seq_len = 1024}, {steps = 100, seq_len = 4096}]`: the first 100 "
           "optimizer steps at 1024 tokens a row, the next 100 at 4096, the rest at "
           "`model.max_seq_length`. Tokens per step stay constant: a stage's micro-batch holds "
           "`micro_batch_size` x `max_seq_length` / `seq_len` rows, each window of the full "
           "length cut into that many pieces, so the samples of a step, the resume point and "
           "the data order at any world size are those without warm-up. Lengths grow, each "
           "divides `model.max_seq_length`; genome pre-training only (docs/long-context.md)");
}

}  // namespace dnallm::config_detail
