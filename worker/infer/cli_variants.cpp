// dnallm-infer variants and mutagenesis: Note [Zero-shot variant effects] (variants.hpp).
#include <algorithm>
#include <cctype>
#include <cmath>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/sequence_reader.hpp"
#include "worker/infer/cli_common.hpp"
#include "worker/infer/variant_io.hpp"
#include "worker/infer/variants.hpp"

namespace dnallm::infer::cli {
namespace {

struct VariantArgs {
  CommonArgs common;
  std::string reference, vcf, out = "-";
  VariantOptions options;
};

struct MutagenesisArgs {
  CommonArgs common;
  std::string input, record, region, out = "-";
  VariantOptions options;
};

void add_variant_options(CLI::App& cmd, VariantOptions& o) {
  cmd.add_option("--window", o.window,
                 "bases of context centred on the variant (0: the bases the model's positions "
                 "hold, at most 1024; docs/published-models.md)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd.add_flag("--rc-average", o.rc_average,
               "average the score with the reverse-complement strand's");
}

// Note [Variant windows]: the sites whose window was narrowed to fit the model's positions.
void warn_narrowed(const VariantScorer& scorer) {
  if (scorer.narrowed_sites() == 0) return;
  spdlog::warn(
      "{} sites had their {}-base window narrowed around the variant to fit the model's "
      "positions (runs of N or short tokens make more tokens than the window's bases hold)",
      scorer.narrowed_sites(), scorer.window());
}

char upper_base(char c) { return static_cast<char>(std::toupper(static_cast<unsigned char>(c))); }

// What `variants` skipped, for the closing lines.
struct VariantCounts {
  int64_t records = 0, scored = 0, not_snv = 0, unscored = 0;
};

// `rec`'s contig length in `genome`, after checking that the reference has the contig and holds
// REF at POS (exit 3 naming chrom:pos otherwise).
int64_t checked_contig_length(const ReferenceGenome& genome, const VcfRecord& rec,
                              const VariantArgs& a) {
  const int64_t length = genome.length(rec.chrom);
  DNALLM_CHECK(length >= 0, ExitCode::kBadData,
               "--vcf {}: contig \"{}\" ({}:{}) is not in --reference {} ({} contigs): give "
               "the reference the VCF was called against (contig names must match)",
               a.vcf, rec.chrom, rec.chrom, rec.pos + 1, a.reference, genome.contigs());
  DNALLM_CHECK(rec.pos >= 0 && rec.pos + static_cast<int64_t>(rec.ref.size()) <= length,
               ExitCode::kBadData, "--vcf {}: {}:{} lies past the contig's end ({} bases)", a.vcf,
               rec.chrom, rec.pos + 1, length);
  const auto actual =
      genome.fetch(rec.chrom, rec.pos, rec.pos + static_cast<int64_t>(rec.ref.size()));
  DNALLM_CHECK(actual == rec.ref, ExitCode::kBadData,
               "--vcf {}: {}:{} has REF {} but the reference holds {} there: the VCF was called "
               "against another reference (or another version of it)",
               a.vcf, rec.chrom, rec.pos + 1, rec.ref, actual);
  return length;
}

class Variants final : public CommandWith<VariantArgs> {
 public:
  explicit Variants(CLI::App& app) {
    VariantArgs& a = args_;
    auto* cmd = subcommand(
        app, "variants",
        "zero-shot effect of every single-nucleotide variant of a VCF: log-likelihood ratio of the "
        "alternative against the reference allele (causal models) or the masked marginal (masked "
        "models); writes TSV chrom, pos, ref, alt, score in VCF order (docs/published-models.md)");
    cmd->add_option("--reference", a.reference,
                    "reference FASTA (plain, or bgzip with its .fai/.gzi; indexed on first use)")
        ->required();
    cmd->add_option("--vcf", a.vcf, "variants (VCF/BCF, plain or bgzip)")->required();
    cmd->add_option("--out", a.out, "TSV output ('-': stdout)")->capture_default_str();
    add_variant_options(*cmd, a.options);
  }

  int run(const cluster::Topology& topo, const cluster::EnvMap& env) override {
    const VariantArgs& a = args_;
    init_logging("infer", a.common.log_level);
    set_log_identity(topo.rank);
    check_output(a.out, checked_reads(a.common.model_dir, {a.vcf, a.reference}));
    RowShares::check(topo, a.out);
    ReferenceGenome genome(a.reference);
    // Note [Row shares]: this rank scores the records [begin, end) of the VCF; every rank checks
    // every record, so a bad one is the same exit 3 on all of them.
    int64_t records = 0;
    if (topo.world_size > 1) {
      VcfReader count(a.vcf);
      for (VcfRecord r; count.next(r);) ++records;
    }
    VcfReader vcf(a.vcf);
    auto loaded = load(a.common, topo.local_rank);
    VariantOptions vo = a.options;
    vo.batch_size = a.common.batch_size;
    RowShares out(topo, env, a.out, "chrom\tpos\tref\talt\tscore\n");
    const auto [share_begin, share_end] = out.share(records);
    std::ostream& os = out.rows();
    // The sites in flight, in VCF order, with the alternatives scored (the others are not SNVs).
    struct Site {
      VcfRecord record;
      std::vector<size_t> scored;  // indices into record.alts
    };
    std::vector<Site> sites;
    size_t first = 0;  // the index of sites[0]
    VariantCounts counts;
    int64_t soft_masked = 0;  // sites whose window holds lower-case bases
    VariantScorer scorer(loaded.model, *loaded.codec, vo, loaded.device,
                         [&](size_t site, const std::vector<double>& scores) {
                           const auto& s = sites[site - first];
                           for (size_t k = 0; k < s.scored.size(); ++k) {
                             if (std::isnan(scores[k])) {
                               ++counts.unscored;
                               continue;
                             }
                             os << s.record.chrom << '\t' << s.record.pos + 1 << '\t'
                                << s.record.ref << '\t' << s.record.alts[s.scored[k]] << '\t'
                                << fmt::format("{:.6f}", scores[k]) << '\n';
                             ++counts.scored;
                           }
                         });
    Progress progress("variants", 0);
    VcfRecord rec;
    for (int64_t index = 0; vcf.next(rec); ++index) {
      const int64_t length = checked_contig_length(genome, rec, a);
      if (topo.world_size > 1 && (index < share_begin || index >= share_end)) continue;
      ++counts.records;
      Site site{rec, {}};
      VariantSite query;
      if (is_snv_allele(rec.ref)) {
        for (size_t k = 0; k < rec.alts.size(); ++k) {
          if (!is_snv_allele(rec.alts[k])) continue;
          site.scored.push_back(k);
          query.alts.push_back(rec.alts[k][0]);
        }
      }
      counts.not_snv += static_cast<int64_t>(rec.alts.size() - site.scored.size());
      if (site.scored.empty()) continue;
      const auto [begin, end] = centred_window(rec.pos, scorer.window(), length);
      query.window = genome.fetch(rec.chrom, begin, end, loaded.codec->keeps_case());
      soft_masked += std::any_of(query.window.begin(), query.window.end(),
                                 [](char c) { return std::islower(static_cast<unsigned char>(c)); })
                         ? 1
                         : 0;
      query.offset = rec.pos - begin;
      sites.push_back(std::move(site));
      scorer.add(std::move(query));
      progress.advance(1);
      // Sites already written go (the scorer calls back in order, a batch at a time).
      if (sites.size() >= 4 * static_cast<size_t>(vo.batch_size)) {
        scorer.flush();
        first += sites.size();
        sites.clear();
      }
    }
    scorer.flush();
    progress.finish();
    out.commit();
    spdlog::info(
        "{}{} VCF records: {} alternatives scored; {} not single-nucleotide (indels, "
        "multi-base or symbolic alleles) skipped; {} with an alternative piece outside the "
        "vocabulary skipped; {} model rows",
        topo.world_size > 1 ? fmt::format("rank {}'s share: ", topo.rank) : std::string(),
        counts.records, counts.scored, counts.not_snv, counts.unscored, scorer.forward_rows());
    if (soft_masked > 0) {
      spdlog::warn(
          "{} sites have lower-case (soft-masked) bases in their window, which the model's "
          "own tokenizer reads as unknown tokens; give --uppercase to read them as bases",
          soft_masked);
    }
    warn_narrowed(scorer);
    if (counts.not_snv + counts.unscored > 0) {
      spdlog::warn("{} alternatives were not scored (see the line above)",
                   counts.not_snv + counts.unscored);
    }
    return 0;
  }
};

class Mutagenesis final : public CommandWith<MutagenesisArgs> {
 public:
  explicit Mutagenesis(CLI::App& app) {
    MutagenesisArgs& a = args_;
    auto* cmd = subcommand(
        app, "mutagenesis",
        "in-silico saturation mutagenesis: every substitution of a region scored as `variants` "
        "scores a SNV; writes TSV pos, ref, A, C, G, T");
    cmd->add_option("--input", a.input, "FASTA/FASTQ holding the sequence")->required();
    cmd->add_option("--record", a.record, "the record's name (default: the first record)");
    cmd->add_option("--region", a.region, "START-END, 1-based and inclusive")->required();
    cmd->add_option("--out", a.out, "TSV output ('-': stdout)")->capture_default_str();
    add_variant_options(*cmd, a.options);
  }

  int run(const cluster::Topology& topo, const cluster::EnvMap& env) override {
    const MutagenesisArgs& a = args_;
    init_logging("infer", a.common.log_level);
    set_log_identity(topo.rank);
    check_output(a.out, checked_reads(a.common.model_dir, {a.input}));
    RowShares::check(topo, a.out);
    int64_t first = 0, last = 0;
    const auto dash = a.region.find('-');
    try {
      DNALLM_CHECK(dash != std::string::npos, ExitCode::kUsage, "");
      first = std::stoll(a.region.substr(0, dash));
      last = std::stoll(a.region.substr(dash + 1));
    } catch (const std::exception&) {
      first = last = 0;
    }
    DNALLM_CHECK(first >= 1 && last >= first, ExitCode::kUsage,
                 "--region {}: give START-END, 1-based and inclusive, START <= END (e.g. 101-200)",
                 a.region);
    auto loaded = load(a.common, topo.local_rank);
    data::SequenceReader reader(a.input);
    reader.set_keep_case(loaded.codec->keeps_case());
    data::SequenceRecord rec;
    bool found = false;
    while (reader.next(rec)) {
      if (a.record.empty() || rec.name == a.record) {
        found = true;
        break;
      }
    }
    DNALLM_CHECK(found, ExitCode::kBadData, "--input {}: {}", a.input,
                 a.record.empty() ? std::string("holds no record")
                                  : fmt::format("no record named \"{}\"", a.record));
    const auto length = static_cast<int64_t>(rec.bases.size());
    DNALLM_CHECK(last <= length, ExitCode::kUsage, "--region {}: the record {} has {} bases",
                 a.region, rec.name, length);
    VariantOptions vo = a.options;
    vo.batch_size = a.common.batch_size;
    // Note [Row shares]: this rank scores the positions [begin, end) of the region.
    RowShares out(topo, env, a.out, "pos\tref\tA\tC\tG\tT\n");
    const auto [share_begin, share_end] = out.share(last - first + 1);
    std::ostream& os = out.rows();
    const std::string bases = "ACGT";
    std::vector<int64_t> positions;  // of the sites added, in order
    VariantScorer scorer(
        loaded.model, *loaded.codec, vo, loaded.device,
        [&](size_t site, const std::vector<double>& scores) {
          const int64_t pos = positions[site];
          const char ref = rec.bases[static_cast<size_t>(pos)];
          os << pos + 1 << '\t' << ref;
          size_t k = 0;
          for (const char b : bases) {
            if (b == upper_base(ref)) {
              os << "\t0";
            } else {
              os << '\t'
                 << (std::isnan(scores[k]) ? std::string("NA") : fmt::format("{:.6f}", scores[k]));
              ++k;
            }
          }
          os << '\n';
        });
    for (int64_t pos = first - 1 + share_begin; pos < first - 1 + share_end; ++pos) {
      const char ref = upper_base(rec.bases[static_cast<size_t>(pos)]);
      VariantSite q;
      for (const char b : bases) {
        if (b != ref) q.alts.push_back(b);
      }
      const auto [begin, end] = centred_window(pos, scorer.window(), length);
      q.window = rec.bases.substr(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
      q.offset = pos - begin;
      positions.push_back(pos);
      scorer.add(std::move(q));
    }
    scorer.flush();
    out.commit();
    spdlog::info("{} positions x 3 substitutions scored ({} model rows)", share_end - share_begin,
                 scorer.forward_rows());
    warn_narrowed(scorer);
    return 0;
  }
};

}  // namespace

std::unique_ptr<Command> add_variants(CLI::App& app) { return std::make_unique<Variants>(app); }

std::unique_ptr<Command> add_mutagenesis(CLI::App& app) {
  return std::make_unique<Mutagenesis>(app);
}

}  // namespace dnallm::infer::cli
