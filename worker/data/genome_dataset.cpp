#include "worker/data/genome_dataset.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::data {
namespace {

// FASTA/FASTQ records held in memory (Note [Genome storage]).
class MemoryGenome final : public GenomeSource {
 public:
  // `files` names the files and `record_files` the file of each record; both empty: one file.
  explicit MemoryGenome(std::vector<SequenceRecord> records, std::vector<std::string> files = {},
                        std::vector<size_t> record_files = {})
      : records_(std::move(records)),
        files_(std::move(files)),
        record_files_(std::move(record_files)) {}
  size_t file_count() const override { return files_.empty() ? 1 : files_.size(); }
  size_t record_file(size_t record) const override {
    return record_files_.empty() ? 0 : record_files_[record];
  }
  std::string file_name(size_t file) const override { return files_.empty() ? "" : files_[file]; }
  size_t record_count() const override { return records_.size(); }
  int64_t record_length(size_t record) const override {
    return static_cast<int64_t>(records_[record].bases.size());
  }
  std::string record_name(size_t record) const override { return records_[record].name; }
  void read(size_t record, int64_t pos, int64_t len, std::string& out) const override {
    out.append(records_[record].bases, static_cast<size_t>(pos), static_cast<size_t>(len));
  }
  int64_t count_n(size_t record, int64_t pos, int64_t len, int64_t limit) const override {
    const std::string& s = records_[record].bases;
    int64_t n = 0;
    for (int64_t i = pos; i < pos + len; ++i) {
      if (s[static_cast<size_t>(i)] == 'N' && ++n > limit) break;
    }
    return n;
  }

 private:
  std::vector<SequenceRecord> records_;
  std::vector<std::string> files_;
  std::vector<size_t> record_files_;
};

}  // namespace

GenomeDataset::GenomeDataset(const std::vector<std::string>& files, GenomeOptions options)
    : options_(std::move(options)) {
  if (files.empty())
    fail(ExitCode::kUsage, "no sequence files given (data.train_files / data.eval_files)");
  int64_t bases = 0;
  std::vector<SequenceRecord> records;
  std::vector<size_t> record_files;
  for (const auto& f : files) {
    SequenceReader reader(f, options_.format, options_.on_bad_record);
    SequenceRecord rec;
    while (reader.next(rec)) {
      bases += static_cast<int64_t>(rec.bases.size());
      if (bases > options_.max_bases) {
        fail(ExitCode::kUsage,
             "{}: the genome files hold more than {} bases, the bound for reading FASTA/FASTQ "
             "into memory (1 byte per base, per rank); pack them once into a genome store "
             "(dnallm-data pack STORE_DIR FILES...) and set data.train_files = [\"STORE_DIR\"] "
             "(docs/data.md)",
             f, options_.max_bases);
      }
      records.push_back(std::move(rec));
      record_files.push_back(static_cast<size_t>(&f - files.data()));
    }
    skipped_ += reader.skipped_records();
    if (reader.skipped_records() > 0) {
      spdlog::warn("{}: skipped {} bad records (data.on_bad_record = \"skip\")", f,
                   reader.skipped_records());
    }
  }
  source_ = std::make_shared<MemoryGenome>(std::move(records), files, std::move(record_files));
  std::string origin = files.front();
  if (files.size() > 1) origin += fmt::format(" (+{} files)", files.size() - 1);
  build(origin);
}

GenomeDataset::GenomeDataset(std::vector<SequenceRecord> records, GenomeOptions options,
                             std::string origin)
    : options_(std::move(options)), source_(std::make_shared<MemoryGenome>(std::move(records))) {
  build(std::move(origin));
}

GenomeDataset::GenomeDataset(std::shared_ptr<const GenomeSource> source, GenomeOptions options,
                             std::string origin)
    : options_(std::move(options)), source_(std::move(source)) {
  build(std::move(origin));
}

// Note [Genome regions]: every BED name is a record of the genome, every interval inside it.
void GenomeDataset::check_regions(const GenomeSource& src) const {
  if (options_.include == nullptr && options_.held_out == nullptr && options_.exclude == nullptr)
    return;
  std::map<std::string, int64_t> lengths;
  for (size_t r = 0; r < src.record_count(); ++r)
    lengths.emplace(src.record_name(r), src.record_length(r));
  for (const auto* set :
       {options_.include.get(), options_.held_out.get(), options_.exclude.get()}) {
    if (set == nullptr) continue;
    for (const auto& [name, list] : set->intervals) {
      auto it = lengths.find(name);
      if (it == lengths.end()) {
        std::string some;
        size_t shown = 0;
        for (const auto& [record, len] : lengths) {
          if (shown++ == 5) {
            some += ", ...";
            break;
          }
          some += (some.empty() ? "" : ", ") + record;
        }
        fail(ExitCode::kBadData,
             "{}:{}: '{}' is not a record of {} ({} records: {}); the BED file must name the "
             "genome's own records (chr1 and 1 differ)",
             set->origin, set->first_line.at(name), name, origin_, lengths.size(), some);
      }
      if (list.back().end > it->second) {
        fail(ExitCode::kBadData,
             "{}: interval {}:{}-{} ends past the record, which holds {} bases in {}: a BED file "
             "of another assembly?",
             set->origin, name, list.back().begin, list.back().end, it->second, origin_);
      }
    }
  }
}

void GenomeDataset::build(std::string origin) {
  origin_ = std::move(origin);
  const int64_t w = options_.window_bases;
  if (w <= 0)
    fail(ExitCode::kUsage,
         "window length {} bases must be positive (model.max_seq_length too small)", w);
  if (options_.eval_fraction < 0 || options_.eval_fraction >= 1) {
    fail(ExitCode::kUsage, "data.eval_fraction = {} must be in [0, 1)", options_.eval_fraction);
  }
  if (options_.held_out != nullptr && options_.eval_fraction > 0) {
    fail(ExitCode::kUsage,
         "data.eval_regions and data.eval_fraction = {} both choose the held-out bases: set one",
         options_.eval_fraction);
  }
  const bool eval_regions = options_.split == Split::kEval && options_.held_out != nullptr;
  if (options_.split == Split::kEval && options_.eval_fraction <= 0 && !eval_regions) {
    fail(ExitCode::kUsage,
         "an eval split of the training genomes needs data.eval_fraction > 0, data.eval_regions "
         "or data.eval_files");
  }
  const GenomeSource& src = *source_;
  if (src.record_count() == 0) fail(ExitCode::kBadData, "{}: no sequence records", origin_);
  check_regions(src);
  const bool any_regions =
      options_.include != nullptr || options_.held_out != nullptr || options_.exclude != nullptr;
  total_bases_ = 0;
  for (size_t r = 0; r < src.record_count(); ++r) {
    const int64_t len = src.record_length(r);
    total_bases_ += len;
    auto held = static_cast<int64_t>(std::floor(static_cast<double>(len) * options_.eval_fraction));
    int64_t begin = 0, end = len;
    if (options_.split == Split::kTrain) end = len - held;
    if (options_.split == Split::kEval && !eval_regions) begin = len - held;
    if (end - begin <= 0) continue;
    // Note [Genome regions].
    std::vector<Interval> pieces{Interval{begin, end}};
    if (any_regions) {
      const std::string name = src.record_name(r);
      static const std::vector<Interval> kNone;
      auto of =
          [&](const std::shared_ptr<const GenomeRegions>& set) -> const std::vector<Interval>& {
        auto it = set->intervals.find(name);
        return it == set->intervals.end() ? kNone : it->second;
      };
      if (eval_regions) {
        pieces = intersect(pieces, of(options_.held_out));
      } else if (options_.split != Split::kEval) {
        if (options_.include != nullptr) pieces = intersect(pieces, of(options_.include));
        if (options_.held_out != nullptr) pieces = subtract(pieces, of(options_.held_out));
      }
      if (options_.exclude != nullptr) pieces = subtract(pieces, of(options_.exclude));
    }
    for (const Interval& piece : pieces) {
      const int64_t span = piece.end - piece.begin;
      uint64_t starts = span >= w ? static_cast<uint64_t>(span - w + 1) : 1;
      regions_.push_back(Region{static_cast<int64_t>(r), piece.begin, piece.end, starts,
                                total_starts_, /*first_tile=*/0});
      total_starts_ += starts;
    }
  }
  if (regions_.empty()) {
    fail(ExitCode::kBadData, "{}: no bases left in this split{}", origin_,
         any_regions
             ? " (the BED regions of data.train_regions / eval_regions / exclude_regions leave "
               "none: check their record names and intervals)"
             : "");
  }
  // An all-N (or all-unknown) input has no position to mask or predict: say so here, not
  // later as "no label tokens" (which reads like a data.mlm_probability problem). Blocks, so
  // that the first base ends the scan of an in-memory genome.
  constexpr int64_t kBlock = int64_t{1} << 16;
  bool any_base = false;
  for (const auto& g : regions_) {
    for (int64_t pos = g.begin; pos < g.end && !any_base; pos += kBlock) {
      const int64_t len = std::min(kBlock, g.end - pos);
      any_base = src.count_n(static_cast<size_t>(g.record), pos, len, len - 1) < len;
    }
    if (any_base) break;
  }
  if (!any_base)
    fail(ExitCode::kBadData,
         "{}: the sequences hold no A, C, G or T (only N or other symbols), so there is nothing "
         "to learn; check the input files",
         origin_);
  int64_t region_bases = 0;
  for (const auto& g : regions_) region_bases += g.end - g.begin;
  if (options_.sampling == cfg::Sampling::kTile) {
    if (!options_.file_weights.empty() || options_.temperature != 1.0) {
      fail(ExitCode::kUsage,
           "data.weights and data.sampling_temperature choose how often random windows come "
           "from each file, but data.sampling = \"tile\" reads every window once an epoch: "
           "set data.sampling = \"random\" or remove them");
    }
    build_tiling(w);
  } else {
    build_file_mix();
    size_ = options_.samples_per_epoch > 0
                ? static_cast<uint64_t>(options_.samples_per_epoch)
                : static_cast<uint64_t>(std::max<int64_t>(1, region_bases / w));
  }
  if (size_ == 0) {
    fail(ExitCode::kBadData,
         "{}: no window of {} bases passes data.n_policy = \"skip\" "
         "(max_n_fraction {}); use n_policy = \"mask\"",
         origin_, w, options_.max_n_fraction);
  }
}

// Note [Genome weights].
void GenomeDataset::build_file_mix() {
  if (options_.file_weights.empty() && options_.temperature == 1.0) return;
  const GenomeSource& src = *source_;
  const size_t files = src.file_count();
  if (!options_.file_weights.empty() && options_.file_weights.size() != files) {
    std::string some;
    for (size_t f = 0; f < files && f < 4; ++f) some += (f ? ", " : "") + src.file_name(f);
    if (files > 4) some += ", ...";
    fail(ExitCode::kUsage,
         "data.weights gives {} weight(s), but {} holds {} file(s) ({}): give one weight per "
         "file, in that order",
         options_.file_weights.size(), origin_, files, some);
  }
  if (options_.temperature <= 0)
    fail(ExitCode::kUsage, "data.sampling_temperature = {} must be > 0", options_.temperature);
  std::vector<FileMix> by_file(files, FileMix{0.0, {}, {}, 0});
  std::vector<double> bases(files, 0.0);
  for (size_t i = 0; i < regions_.size(); ++i) {
    const Region& g = regions_[i];
    FileMix& m = by_file[src.record_file(static_cast<size_t>(g.record))];
    m.regions.push_back(i);
    m.first_start.push_back(m.starts);
    m.starts += g.starts;
    bases[src.record_file(static_cast<size_t>(g.record))] += static_cast<double>(g.end - g.begin);
  }
  std::vector<double> p(files, 0.0);
  double total = 0, natural = 0;
  for (size_t f = 0; f < files; ++f) {
    natural += bases[f];
    const double weight = options_.file_weights.empty()
                              ? std::pow(bases[f], 1.0 / options_.temperature)
                              : options_.file_weights[f];
    if (by_file[f].starts == 0) {
      if (!options_.file_weights.empty() && weight > 0)
        spdlog::warn("data.weights: {} has weight {} but no window in this split; left out",
                     src.file_name(f), weight);
      continue;
    }
    p[f] = weight;
    total += weight;
  }
  if (!(total > 0) || !std::isfinite(total)) {
    fail(ExitCode::kUsage,
         "data.weights gives no weight to a file with windows in this split of {}: give at "
         "least one such file a weight > 0",
         origin_);
  }
  double cdf = 0;
  std::string shown;
  for (size_t f = 0; f < files; ++f) {
    if (p[f] <= 0) continue;
    cdf += p[f] / total;
    by_file[f].cdf = cdf;
    if (mix_.size() < 8) {
      shown += fmt::format("{}{} {:.1f}% (by size {:.1f}%)", shown.empty() ? "" : ", ",
                           src.file_name(f), 100 * p[f] / total, 100 * bases[f] / natural);
    }
    mix_.push_back(std::move(by_file[f]));
  }
  mix_.back().cdf = 1.0;  // rounding: every draw < 1 finds a file
  spdlog::info("data: windows drawn from {} file(s) by {}: {}{}", mix_.size(),
               options_.file_weights.empty()
                   ? fmt::format("data.sampling_temperature = {}", options_.temperature)
                   : std::string("data.weights"),
               shown, mix_.size() > 8 ? ", ..." : "");
}

// Tiles of a region start at begin, begin + stride, ...: the first always, a later one only
// when a whole window fits (the ragged tail is dropped unless it is the only tile).
void GenomeDataset::build_tiling(int64_t w) {
  tile_stride_ = options_.window_stride > 0 ? options_.window_stride : w;
  total_tiles_ = 0;
  for (auto& g : regions_) {
    g.first_tile = total_tiles_;
    const int64_t span = g.end - g.begin;
    const uint64_t tiles = span >= w ? 1 + static_cast<uint64_t>((span - w) / tile_stride_) : 1;
    if (options_.n_policy == cfg::NPolicy::kSkip) {
      for (uint64_t t = 0; t < tiles; ++t) {
        const int64_t pos = g.begin + static_cast<int64_t>(t) * tile_stride_;
        if (!window_ok(static_cast<size_t>(g.record), pos, std::min(w, g.end - pos)))
          dropped_tiles_.push_back(total_tiles_ + t);
      }
    }
    total_tiles_ += tiles;
  }
  size_ = total_tiles_ - dropped_tiles_.size();
}

std::pair<const GenomeDataset::Region*, int64_t> GenomeDataset::tile(uint64_t index) const {
  // Kept tile k is tile k + j of the full tiling, j the dropped tiles before it: the dropped
  // ids d_i (sorted, distinct) with d_i - i <= k.
  uint64_t lo = 0, hi = dropped_tiles_.size();
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (dropped_tiles_[mid] - mid <= index) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const uint64_t id = index + lo;
  auto it = std::upper_bound(regions_.begin(), regions_.end(), id,
                             [](uint64_t v, const Region& g) { return v < g.first_tile; });
  const Region& g = *(it - 1);
  return {&g, g.begin + static_cast<int64_t>(id - g.first_tile) * tile_stride_};
}

bool GenomeDataset::window_ok(size_t record, int64_t pos, int64_t len) const {
  auto limit = static_cast<int64_t>(std::floor(options_.max_n_fraction * static_cast<double>(len)));
  return source_->count_n(record, pos, len, limit) <= limit;
}

Sample GenomeDataset::get(uint64_t index, SampleRng& rng) const {
  const int64_t w = options_.window_bases;
  Sample sample;
  if (options_.sampling == cfg::Sampling::kTile) {
    const auto [g, pos] = tile(index % size_);
    source_->read(static_cast<size_t>(g->record), pos, std::min(w, g->end - pos), sample.bases);
  } else {
    // Random window: up to 64 draws for one passing the N policy; the last draw otherwise.
    for (int attempt = 0; attempt < 64; ++attempt) {
      const Region* picked = nullptr;
      uint64_t offset = 0;  // the start's offset within *picked
      if (mix_.empty()) {
        uint64_t u = rng.uniform(total_starts_);
        auto it = std::upper_bound(regions_.begin(), regions_.end(), u,
                                   [](uint64_t v, const Region& g) { return v < g.first_start; });
        picked = &*(it - 1);
        offset = u - picked->first_start;
      } else {
        // Note [Genome weights]: the file, then a start among its starts.
        const double x = rng.uniform01();
        auto f = std::upper_bound(mix_.begin(), mix_.end(), x,
                                  [](double v, const FileMix& m) { return v < m.cdf; });
        if (f == mix_.end()) --f;
        const uint64_t u = rng.uniform(f->starts);
        const size_t k =
            static_cast<size_t>(std::upper_bound(f->first_start.begin(), f->first_start.end(), u) -
                                f->first_start.begin() - 1);
        picked = &regions_[f->regions[k]];
        offset = u - f->first_start[k];
      }
      const Region& g = *picked;
      int64_t pos = g.begin + static_cast<int64_t>(offset);
      int64_t len = std::min(w, g.end - pos);
      const auto record = static_cast<size_t>(g.record);
      if (options_.n_policy == cfg::NPolicy::kSkip && attempt < 63 && !window_ok(record, pos, len))
        continue;
      source_->read(record, pos, len, sample.bases);
      break;
    }
  }
  if (options_.reverse_complement > 0 && rng.uniform01() < options_.reverse_complement) {
    sample.bases = reverse_complement(sample.bases);
  }
  return sample;
}

std::string GenomeDataset::describe() const {
  return fmt::format("genome {}: {} records, {} bases, {} {} windows of {} bases per epoch{}",
                     origin_, source_->record_count(), total_bases_, size_,
                     cfg::spelling(options_.sampling), options_.window_bases,
                     mix_.empty() ? "" : fmt::format(", mixed over {} files", mix_.size()));
}

}  // namespace dnallm::data
