// dnallm-data: pack FASTA/FASTQ into a genome store, verify and inspect stores (docs/data.md).
//   dnallm-data pack STORE_DIR INPUT...   files, globs, directories, @LIST files
//   dnallm-data verify STORE_DIR          hash every chunk (exit 5 naming a damaged file)
//   dnallm-data inspect STORE_DIR         print the manifest
// Exit codes: 0 done, 2 bad usage (or an output that cannot be written), 3 bad input data,
// 5 a damaged store.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/data_files.hpp"
#include "worker/data/genome_store.hpp"
#include "worker/data/store_packer.hpp"

namespace dd = dnallm::data;

namespace {

struct DataArgs {
  std::string store;
  std::vector<std::string> inputs;
  std::string input_format = "auto";
  bool replace = false;
  int threads = 1;
  CLI::App* pack = nullptr;
  CLI::App* verify = nullptr;
  CLI::App* inspect = nullptr;
};

void add_commands(CLI::App& app, DataArgs& a) {
  a.pack = app.add_subcommand("pack", "pack FASTA/FASTQ (plain, gzip, BGZF) into a genome store");
  a.pack->add_option("store", a.store, "the store directory to write (must not exist)")->required();
  a.pack
      ->add_option("inputs", a.inputs,
                   "files, globs (quoted), directories (searched recursively) or @LIST (a file "
                   "of such entries, one a line)")
      ->required();
  a.pack->add_option("--format", a.input_format, "the inputs' format: auto, fasta or fastq")
      ->check(CLI::IsMember({"auto", "fasta", "fastq"}));
  a.pack->add_flag("--replace", a.replace, "replace an existing store at STORE (only a store)");
  a.pack->add_option("--threads", a.threads, "BGZF inputs: decompression threads")
      ->check(CLI::Range(1, 64));
  a.verify = app.add_subcommand("verify", "hash every chunk of a store against its manifest");
  a.verify->add_option("store", a.store, "the store directory")->required();
  a.inspect = app.add_subcommand("inspect", "check a store and print its manifest");
  a.inspect->add_option("store", a.store, "the store directory")->required();
}

int pack(const DataArgs& a) {
  dd::PackOptions o;
  using dnallm::cfg::DataFormat;
  o.format = a.input_format == "fasta"   ? DataFormat::kFasta
             : a.input_format == "fastq" ? DataFormat::kFastq
                                         : DataFormat::kAuto;
  o.replace = a.replace;
  o.threads = a.threads;
  const auto files = dd::expand_data_files(a.inputs, "dnallm-data pack inputs");
  if (dd::is_genome_store(files.front())) {
    dnallm::fail(dnallm::ExitCode::kUsage,
                 "{} is already a genome store; pack the FASTA/FASTQ files it was made from",
                 files.front());
  }
  spdlog::info("packing {} file(s) into {}", files.size(), a.store);
  const dd::PackStats s = dd::pack_genome_store(a.store, files, o);
  std::printf(
      "packed %llu bases (%llu contigs, %llu N, %llu soft-masked) from %llu file(s) into %s: "
      "%llu bytes, %.4f bytes/base, %.1f s, %.1f Mbases/s\n",
      static_cast<unsigned long long>(s.bases), static_cast<unsigned long long>(s.contigs),
      static_cast<unsigned long long>(s.n_bases), static_cast<unsigned long long>(s.lower_bases),
      static_cast<unsigned long long>(s.files), a.store.c_str(),
      static_cast<unsigned long long>(s.store_bytes), s.bytes_per_base(), s.seconds,
      s.mbases_per_s());
  return 0;
}

int verify(const DataArgs& a) {
  const auto store = dd::GenomeStore::open(a.store);
  store->verify_all([](uint64_t done, uint64_t total) {
    spdlog::info("verify: {:.1f} of {:.1f} MB", static_cast<double>(done) / 1e6,
                 static_cast<double>(total) / 1e6);
  });
  std::printf("ok: %s (%llu contigs, %llu bases) verified\n", a.store.c_str(),
              static_cast<unsigned long long>(store->record_count()),
              static_cast<unsigned long long>(store->total_bases()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  dnallm::init_logging("data", "info");
  CLI::App app{"dnallm-data: pack FASTA/FASTQ into memory-mapped genome stores (docs/data.md)"};
  app.require_subcommand(1);
  DataArgs args;
  add_commands(app, args);
  return dnallm::run_main("dnallm-data", app, argc, argv, [&] {
    if (*args.pack) return pack(args);
    if (*args.verify) return verify(args);
    std::cout << dd::GenomeStore::open(args.store)->manifest_text();
    return 0;
  });
}
