// What data.train_files / data.eval_files (and `dnallm-data pack`'s inputs) may list.
//
// Note [Data file lists]: each entry is one of
//   - a file: kept as written (relative to the working directory);
//   - a glob (`*`, `?` or `[`, e.g. "genomes/*.fa.gz"): the files it matches, sorted;
//   - a genome store directory (it holds genome-store.json): the store, kept as written; it
//     must be the only entry (a store packs many files into one);
//   - another directory: the sequence and table files under it (recursively; a name ending in
//     .fa .fasta .fna .fas .ffn .fq .fastq, gzip'ed or not, .csv .tsv .jsonl), sorted by path;
//     hidden files and folders (a leading '.') are left out;
//   - "@LIST": the file LIST holds one entry a line (a file, glob or directory, never another
//     @LIST); blank lines and lines starting with '#' are ignored; a relative entry is relative
//     to LIST's folder.
// A glob or directory that gives no file, and a LIST that cannot be read, are Error(kUsage)
// naming the key and the entry. The order is the list's, each glob and directory sorted, so
// every rank expands the same list to the same files in the same order.
#pragma once

#include <string>
#include <vector>

namespace dnallm::data {

// Expands `entries` (Note [Data file lists]); `key` names them in messages ("data.train_files").
std::vector<std::string> expand_data_files(const std::vector<std::string>& entries,
                                           const std::string& key);

}  // namespace dnallm::data
