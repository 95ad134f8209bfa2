// Tables of sequences (CSV, TSV, JSONL) with an optional label column, read lazily.
//
// Note [Record offset index]: the first open of a table scans it once, validates every
// record, and writes an index of the byte offset of each good record (8 bytes a record)
// beside the file as "<file>.dnaidx" (or in data.cache_dir, or, when neither is writable,
// in $TMPDIR/dnallm-index). The index header records the file's size, mtime and the
// parsing options; a stale index is rebuilt. get() reads one offset from the index and one
// line from the table with pread(), so memory does not grow with the file: the resident
// cost is a few buffers of the longest line (the bench measures it, bench/data).
//
// Format: CSV (RFC 4180 quoting) or TSV with a header line naming the columns; JSONL with
// one object per line. Blank lines are ignored. The sequence column is required; the label
// column is required for model.task "classification" (integer in [0, num_labels)) and
// "regression" (a finite number), ignored for "pretrain". Compressed tables are refused
// (no random access): decompress them first.
//
// Bad records (invalid base, empty sequence, missing column, bad label) raise
// Error(kBadData) naming file, line, record and what was found, or with on_bad_record =
// "skip" are left out of the index and counted (skipped_records()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "worker/data/dataset.hpp"
#include "worker/data/sequence_reader.hpp"

namespace dnallm::data {

struct TableOptions {
  cfg::DataFormat format = cfg::DataFormat::kAuto;  // auto (by extension), csv, tsv, jsonl
  std::string sequence_column = "sequence";
  std::string label_column = "label";
  cfg::Task task = cfg::Task::kPretrain;
  int64_t num_labels = 2;
  BadRecordPolicy on_bad_record = BadRecordPolicy::kError;
  std::string cache_dir = "";  // where indexes go when the data dir is read-only
  // Probability of reverse-complementing a record's sequence (training only; the label is
  // kept: strand-agnostic tasks). Drawn from the sample's SampleRng, so resume is exact.
  double reverse_complement = 0.0;
};

class TableDataset final : public Dataset {
 public:
  TableDataset(const std::vector<std::string>& files, TableOptions options);
  ~TableDataset() override;
  TableDataset(const TableDataset&) = delete;
  TableDataset& operator=(const TableDataset&) = delete;

  uint64_t size() const override { return total_records_; }
  Sample get(uint64_t index, SampleRng& rng) const override;  // rng: reverse_complement only
  int64_t skipped_records() const override { return skipped_; }
  std::string describe() const override;

  // Where the index of `file` lives (the first writable candidate is used).
  const std::vector<std::string>& index_paths() const { return index_paths_; }

 private:
  struct File {
    std::string path;
    cfg::DataFormat format = cfg::DataFormat::kAuto;
    int data_fd = -1;
    int index_fd = -1;
    uint64_t records = 0;
    uint64_t first_record = 0;  // cumulative
    int sequence_col = -1;      // csv/tsv
    int label_col = -1;         // csv/tsv; -1 when absent
    std::string header_line;
  };
  void open_file(const std::string& path);
  void read_header(File& f) const;
  bool reuse_index(File& f, const std::vector<std::string>& candidates, uint64_t file_size,
                   int64_t mtime_ns, uint64_t key);
  void build_index(File& f, const std::string& index_path, uint64_t file_size, int64_t mtime_ns,
                   uint64_t key);
  // Parses one line into a sample; false with `why` when the record is bad.
  bool parse_record(const File& f, const std::string& line, Sample& out, std::string& why) const;

  TableOptions options_;
  std::vector<File> files_;
  std::vector<std::string> index_paths_;
  uint64_t total_records_ = 0;
  int64_t skipped_ = 0;
};

// Splits one CSV (quoted fields, "" escapes) or TSV line into fields.
std::vector<std::string> split_table_line(const std::string& line, char separator);

}  // namespace dnallm::data
