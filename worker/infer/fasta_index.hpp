// Note [Stale indexes]: htslib's faidx trusts a reference's .fai (and a bgzip reference's .gzi)
// as it finds them. One written for another FASTA, or for this one before it was rewritten,
// reads other bases than the records hold: scores silently wrong where a REF happens to match,
// and the other records blamed on the VCF (issue 57). So before faidx opens the reference, an
// index older than its FASTA, or whose entries do not fit the file (each record's header line
// must end where its sequence begins, named as the index names it, and its bases end at a line
// end followed by the next record or the end of the file, with the lines the index says), is
// rebuilt beside it (a temporary file renamed over the old one) where the folder is writable,
// else refused naming the index and how to rebuild it. Torch-free.
#pragma once

#include <string>

namespace dnallm::infer {

// Checks (and where stale and writable, rebuilds) the .fai and .gzi of `fasta` that exist; a
// missing index is left to faidx, which builds it. `label` opens every message ("--reference
// ref.fa"). Error(kBadData) for a stale or damaged index that cannot be rebuilt.
void check_fasta_index(const std::string& fasta, const std::string& label);

// Why `fasta`'s index `fai` does not describe it ("" when every entry fits). `bgzip`: read the
// FASTA through BGZF and its .gzi.
std::string fasta_index_misfit(const std::string& fasta, const std::string& fai, bool bgzip);

}  // namespace dnallm::infer
