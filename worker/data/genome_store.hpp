// Reads a packed genome store (Note [Genome store format], genome_store_format.hpp) by
// memory-mapping its files read-only: nothing is decoded when it opens, a window is decoded
// from its 2-bit bytes and the N runs that cross it when asked, and every process that maps the
// store shares the page cache. A GenomeSource, so GenomeDataset trains from it as from FASTA.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "worker/data/genome_source.hpp"
#include "worker/data/genome_store_format.hpp"

namespace dnallm::data {

class GenomeStore final : public GenomeSource {
 public:
  // Opens and checks the store in `dir`: the manifest, its format and version, every file's
  // size, the chunk table's hash and the contig index. Error(kStoreCorrupt) (exit 5) naming the
  // file when anything does not match; Error(kBadData) for a directory that is no store or a
  // store of another format version. Warns when a source file changed since it was packed.
  static std::shared_ptr<const GenomeStore> open(const std::string& dir);
  ~GenomeStore() override;
  GenomeStore(const GenomeStore&) = delete;
  GenomeStore& operator=(const GenomeStore&) = delete;

  size_t record_count() const override;
  int64_t record_length(size_t record) const override;
  std::string record_name(size_t record) const override;
  void read(size_t record, int64_t pos, int64_t len, std::string& out) const override;
  int64_t count_n(size_t record, int64_t pos, int64_t len, int64_t limit) const override;
  // read() with the soft-masked bases lower-case: what SequenceReader reads with
  // set_keep_case(true).
  size_t file_count() const override { return sources_.size(); }
  size_t record_file(size_t record) const override;
  std::string file_name(size_t file) const override { return sources_[file]; }
  void read_keep_case(size_t record, int64_t pos, int64_t len, std::string& out) const;

  const std::string& dir() const { return dir_; }
  uint64_t total_bases() const { return total_bases_; }
  // The manifest as written (genome-store.json).
  const std::string& manifest_text() const { return manifest_text_; }
  // Hashes every chunk of every file (dnallm-data verify): Error(kStoreCorrupt) naming the file
  // and byte range of the first damaged chunk. `progress(done, total)` (bytes) is called as it
  // goes, from this thread.
  void verify_all(const std::function<void(uint64_t, uint64_t)>& progress = nullptr) const;

 private:
  struct Files;
  explicit GenomeStore(std::string dir);
  void load_manifest();
  void check_contigs() const;

  std::string dir_;
  std::string manifest_text_;
  uint64_t total_bases_ = 0;
  uint64_t contigs_ = 0;
  std::vector<std::string> sources_;  // the manifest's "sources" paths
  std::unique_ptr<Files> files_;
};

}  // namespace dnallm::data
