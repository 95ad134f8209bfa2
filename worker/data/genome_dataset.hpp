// Windows over genomes (FASTA/FASTQ, or a packed genome store), for pre-training and evaluation.
//
// Note [Genome storage]: a GenomeDataset reads its bases from a GenomeSource
// (genome_source.hpp), one of two:
//   - FASTA/FASTQ files, decompressed once when the dataset is built and held in memory at
//     1 byte per base (validated A C G T N). The bundled genomes are plain gzip, which faidx
//     cannot index; holding ~5 Mbases (5 MB per genome, per rank) is cheaper and simpler than
//     a decompressed cache beside a possibly read-only data directory. The bound: total bases
//     <= GenomeOptions::max_bases (default 4 Gbases, i.e. up to 4 GB of host memory per rank);
//     larger inputs are refused with Error(kUsage), saying to pack them.
//   - a packed genome store (`dnallm-data pack`, genome_store.hpp): 2 bits a base plus N and
//     soft-mask run tables, memory-mapped read-only. Nothing is decoded at start; a window is
//     decoded when a loader thread asks for it, every rank of a node shares the page cache, and
//     memory does not grow with the corpus (the contig index aside).
// Both give the same windows for the same genome: the regions, the draws and the tiling below
// depend on the record lengths and N positions only.
//
// Sampling ("random"): window i of an epoch is drawn from the sample's rng: a region
// weighted by its number of window starts, then a uniform start. "tile": window i is the
// i-th window of a strided tiling over all regions (the sampler shuffles the order); the tiling
// is computed, not stored: each region's tile count, and the tiles the N policy drops (16 bytes
// a region + 8 bytes a dropped tile).
// N runs: n_policy "skip" rejects windows whose N fraction exceeds max_n_fraction (random:
// redraw up to 64 times; tile: such tiles are left out of the tiling); "mask" keeps them
// and the objective never scores N positions.
// Split: eval_fraction f holds out the last floor(len * f) bases of every record; the
// train split is the rest. Windows never cross the boundary, nor a record's end.
//
// Note [Genome regions]: BED files (genome_regions.hpp) narrow where windows come from, as
// HyenaDNA's and Caduceus's hg38 splits do. A record's regions are its split's range (above),
//   - kTrain and kAll: intersected with `include` (data.train_regions) when given, less
//     `held_out` (data.eval_regions: never trained on);
//   - kEval with `held_out`: the held-out intervals instead of the record's tail
//     (eval_fraction is then 0);
// less `exclude` (data.exclude_regions) in every split. Each interval left is a region of its
// own: windows never cross an interval's end, so none overlaps a base outside the set. A BED
// name that is no record of the genome, or an interval past its record's end, is
// Error(kBadData) naming the BED file and line: a BED of another assembly (chr1 vs 1, hg19 vs
// hg38) fails at the start rather than training on nothing.
//
// Note [Genome weights]: by default a random window comes from a file in proportion to the
// window starts it holds (its bases, less what the split and the regions leave out). A corpus
// of many genomes (a multi-species set, one file a species) is mixed otherwise, as
// multilingual LM recipes and Megatron's blended datasets do:
//   - file_weights (data.weights): one weight per file of the source (GenomeSource::file_count:
//     the files of data.train_files after expansion, in order; a store's packed files, in the
//     order `dnallm-data inspect` lists them); file f is drawn with probability w_f / sum w;
//   - temperature (data.sampling_temperature) T: probability proportional to B_f^(1/T), B_f the
//     file's bases in the split; T = 1 is the default mix, T > 1 flattens it (towards uniform
//     over files), T < 1 sharpens it.
// A window is then a uniform start among the chosen file's starts. A draw takes the file first
// (uniform01), then the start (uniform), from the sample's rng: the stream depends on the
// sample index and seed only, so N ranks see 1 rank's windows and a resume at another world
// size continues it. Files whose split holds no window are left out (a warning when they had
// a weight); `tile` reads every window once an epoch and takes no weights. Without weights or
// temperature the draw is a single uniform over all starts, as before.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "worker/data/dataset.hpp"
#include "worker/data/genome_regions.hpp"
#include "worker/data/genome_source.hpp"
#include "worker/data/sequence_reader.hpp"

namespace dnallm::data {

enum class Split { kAll, kTrain, kEval };

struct GenomeOptions {
  int64_t window_bases = 510;  // bases per window, > 0
  cfg::Sampling sampling = cfg::Sampling::kRandom;
  int64_t window_stride = 0;  // tile: bases between starts; 0 = window_bases
  cfg::NPolicy n_policy = cfg::NPolicy::kSkip;
  double max_n_fraction = 0.0;      // skip: largest tolerated N fraction of a window
  double reverse_complement = 0.0;  // probability of reverse-complementing a window
  double eval_fraction = 0.0;       // held-out tail of each record
  Split split = Split::kAll;
  int64_t samples_per_epoch = 0;                    // random: 0 = total region bases / window_bases
  cfg::DataFormat format = cfg::DataFormat::kAuto;  // auto, fasta, fastq
  BadRecordPolicy on_bad_record = BadRecordPolicy::kError;
  int64_t max_bases = int64_t{4} << 30;  // See Note [Genome storage]
  // Note [Genome weights]: one per file (empty: by size), and the size temperature.
  std::vector<double> file_weights;
  double temperature = 1.0;
  // Note [Genome regions]; null: none.
  std::shared_ptr<const GenomeRegions> include, held_out, exclude;
};

class GenomeDataset final : public Dataset {
 public:
  // Reads every file (Error(kBadData) on bad data, Error(kUsage) on bad options).
  GenomeDataset(const std::vector<std::string>& files, GenomeOptions options);
  // From records already in memory (tests, eval on a string); `origin` names them in messages.
  GenomeDataset(std::vector<SequenceRecord> records, GenomeOptions options, std::string origin);
  // From any source (a packed genome store); `origin` names it in messages.
  GenomeDataset(std::shared_ptr<const GenomeSource> source, GenomeOptions options,
                std::string origin);

  uint64_t size() const override { return size_; }
  Sample get(uint64_t index, SampleRng& rng) const override;
  int64_t skipped_records() const override { return skipped_; }
  std::string describe() const override;

  int64_t total_bases() const { return total_bases_; }
  const GenomeSource& source() const { return *source_; }

 private:
  struct Region {
    int64_t record;
    int64_t begin, end;    // [begin, end) within the record
    uint64_t starts;       // random: window starts in the region (>= 1)
    uint64_t first_start;  // cumulative starts before this region
    uint64_t first_tile;   // tile: cumulative tiles (before the N policy) before this region
  };
  void build(std::string origin);
  void check_regions(const GenomeSource& src) const;
  void build_tiling(int64_t w);
  void build_file_mix();
  bool window_ok(size_t record, int64_t pos, int64_t len) const;
  // tile: the start (region, position) of kept tile `index`.
  std::pair<const Region*, int64_t> tile(uint64_t index) const;

  GenomeOptions options_;
  std::shared_ptr<const GenomeSource> source_;
  std::vector<Region> regions_;
  uint64_t total_starts_ = 0;
  // tile: tiles of all regions before the N policy, and the ones it drops (sorted ids).
  uint64_t total_tiles_ = 0;
  int64_t tile_stride_ = 0;
  std::vector<uint64_t> dropped_tiles_;
  // Note [Genome weights] (empty: unweighted): the cumulative probability of each file with
  // windows, its regions (indices into regions_) and their cumulative starts within the file.
  struct FileMix {
    double cdf;
    std::vector<size_t> regions;
    std::vector<uint64_t> first_start;  // starts before each of `regions` in this file
    uint64_t starts;
  };
  std::vector<FileMix> mix_;
  uint64_t size_ = 0;
  int64_t total_bases_ = 0;
  int64_t skipped_ = 0;
  std::string origin_;
};

}  // namespace dnallm::data
