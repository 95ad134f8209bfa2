#include "worker/data/genome_dataset.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/log.hpp"

namespace dnallm::data {

GenomeDataset::GenomeDataset(const std::vector<std::string>& files, GenomeOptions options)
    : options_(std::move(options)) {
  if (files.empty())
    fail(ExitCode::kUsage, "no sequence files given (data.train_files / data.eval_files)");
  int64_t bases = 0;
  for (const auto& f : files) {
    SequenceReader reader(f, options_.format, options_.on_bad_record);
    SequenceRecord rec;
    while (reader.next(rec)) {
      bases += static_cast<int64_t>(rec.bases.size());
      if (bases > options_.max_bases) {
        fail(ExitCode::kUsage,
             "{}: the genome files hold more than {} bases, the in-memory bound (1 byte per base); "
             "list fewer or smaller files in data.train_files / data.eval_files",
             f, options_.max_bases);
      }
      records_.push_back(std::move(rec));
    }
    skipped_ += reader.skipped_records();
    if (reader.skipped_records() > 0) {
      spdlog::warn("{}: skipped {} bad records (data.on_bad_record = \"skip\")", f,
                   reader.skipped_records());
    }
  }
  std::string origin = files.front();
  if (files.size() > 1) origin += fmt::format(" (+{} files)", files.size() - 1);
  build(origin);
}

GenomeDataset::GenomeDataset(std::vector<SequenceRecord> records, GenomeOptions options,
                             std::string origin)
    : options_(std::move(options)), records_(std::move(records)) {
  build(std::move(origin));
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
  if (options_.split == Split::kEval && options_.eval_fraction <= 0) {
    fail(ExitCode::kUsage,
         "an eval split of the training genomes needs data.eval_fraction > 0 (or data.eval_files)");
  }
  if (records_.empty()) fail(ExitCode::kBadData, "{}: no sequence records", origin_);
  total_bases_ = 0;
  for (size_t r = 0; r < records_.size(); ++r) {
    const auto len = static_cast<int64_t>(records_[r].bases.size());
    total_bases_ += len;
    auto held = static_cast<int64_t>(std::floor(static_cast<double>(len) * options_.eval_fraction));
    int64_t begin = 0, end = len;
    if (options_.split == Split::kTrain) end = len - held;
    if (options_.split == Split::kEval) begin = len - held;
    if (end - begin <= 0) continue;
    uint64_t starts = end - begin >= w ? static_cast<uint64_t>(end - begin - w + 1) : 1;
    regions_.push_back(Region{static_cast<int32_t>(r), begin, end, starts, total_starts_});
    total_starts_ += starts;
  }
  if (regions_.empty()) fail(ExitCode::kBadData, "{}: no bases left in this split", origin_);
  // An all-N (or all-unknown) input has no position to mask or predict: say so here, not
  // later as "no label tokens" (which reads like a data.mlm_probability problem).
  bool any_base = false;
  for (const auto& g : regions_) {
    const std::string& s = records_[g.record].bases;
    for (int64_t i = g.begin; i < g.end && !any_base; ++i) {
      const char c = s[static_cast<size_t>(i)];
      any_base = c == 'A' || c == 'C' || c == 'G' || c == 'T' || c == 'a' || c == 'c' || c == 'g' ||
                 c == 't';
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
    int64_t stride = options_.window_stride > 0 ? options_.window_stride : w;
    for (size_t i = 0; i < regions_.size(); ++i) {
      const auto& g = regions_[i];
      const std::string& s = records_[g.record].bases;
      for (int64_t pos = g.begin; pos < g.end; pos += stride) {
        int64_t len = std::min(w, g.end - pos);
        if (len < w && pos != g.begin) break;  // drop the ragged tail unless it is the only tile
        if (options_.n_policy == cfg::NPolicy::kSkip && !window_ok(s, pos, len)) continue;
        tiles_.emplace_back(static_cast<int32_t>(i), pos);
      }
    }
    size_ = tiles_.size();
  } else {
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

bool GenomeDataset::window_ok(const std::string& s, int64_t pos, int64_t len) const {
  auto limit = static_cast<int64_t>(std::floor(options_.max_n_fraction * static_cast<double>(len)));
  int64_t n = 0;
  for (int64_t i = pos; i < pos + len; ++i) {
    if (s[i] == 'N' && ++n > limit) return false;
  }
  return true;
}

Sample GenomeDataset::get(uint64_t index, SampleRng& rng) const {
  const int64_t w = options_.window_bases;
  Sample sample;
  if (options_.sampling == cfg::Sampling::kTile) {
    const auto& t = tiles_.at(index % tiles_.size());
    const auto& g = regions_[t.first];
    int64_t len = std::min(w, g.end - t.second);
    sample.bases = records_[g.record].bases.substr(t.second, len);
  } else {
    // Random window: up to 64 draws for one passing the N policy; the last draw otherwise.
    for (int attempt = 0; attempt < 64; ++attempt) {
      uint64_t u = rng.uniform(total_starts_);
      auto it = std::upper_bound(regions_.begin(), regions_.end(), u,
                                 [](uint64_t v, const Region& g) { return v < g.first_start; });
      const Region& g = *(it - 1);
      int64_t pos = g.begin + static_cast<int64_t>(u - g.first_start);
      int64_t len = std::min(w, g.end - pos);
      const std::string& s = records_[g.record].bases;
      if (options_.n_policy == cfg::NPolicy::kSkip && attempt < 63 && !window_ok(s, pos, len))
        continue;
      sample.bases = s.substr(pos, len);
      break;
    }
  }
  if (options_.reverse_complement > 0 && rng.uniform01() < options_.reverse_complement) {
    sample.bases = reverse_complement(sample.bases);
  }
  return sample;
}

std::string GenomeDataset::describe() const {
  return fmt::format("genome {}: {} records, {} bases, {} {} windows of {} bases per epoch",
                     origin_, records_.size(), total_bases_, size_,
                     cfg::spelling(options_.sampling), options_.window_bases);
}

}  // namespace dnallm::data
