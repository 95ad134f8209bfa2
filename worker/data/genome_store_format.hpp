// The packed genome store: the on-disk layout that `dnallm-data pack` writes (store_packer.hpp)
// and GenomeStore memory-maps (genome_store.hpp).
//
// Note [Genome store format] (version 1). A store is a directory:
//   genome-store.json  the manifest, written last: {"format": "dnallm-genome-store",
//                      "version": 1, "bases", "contigs", "n_bases", "lower_bases",
//                      "chunk_bytes", "files": [{"name", "bytes", "first_chunk", "chunks"}],
//                      "checksums_xxh3": hex of checksums.bin, "sources": [{"path", "bytes",
//                      "mtime_ns", "format", "contigs", "bases"}], "packed_by", "packed_at"}
//   bases.2bit         every base of every contig, one after another, 2 bits a base
//                      (A 0, C 1, G 2, T 3; N stored as 0): base i of the store is bits
//                      2*(i%4) .. 2*(i%4)+1 of byte i/4; ceil(bases / 4) bytes
//   n_runs.bin         the runs of N as BaseRun {u64 start, u64 length} in store coordinates,
//                      sorted, none crossing a contig's end (IUPAC ambiguity codes are N, as
//                      SequenceReader reads them)
//   lower_runs.bin     the runs of lower-case (soft-masked) bases, the same way
//   contigs.bin        ContigEntry {u64 offset (store coordinate of its first base), u64 length,
//                      u64 name_offset, u32 name_length, u32 source (index in "sources")}
//   names.bin          the contig names (header up to the first whitespace), concatenated
//   checksums.bin      XXH3-64 of every chunk_bytes chunk of each file above, in "files" order
// Integers are little-endian. Opening checks the manifest, every file's size and the hash of
// checksums.bin; each chunk of the other files is hashed the first time anything in it is read
// (once a process), so a window costs no more than its bytes and a damaged chunk is refused
// where it is read, never used: Error(kStoreCorrupt), exit 5. `dnallm-data verify` hashes every
// chunk. A store of another "version" is refused (Error(kBadData)); repack its sources.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/error.hpp"

namespace dnallm::data {

inline constexpr const char* kStoreFormatName = "dnallm-genome-store";
inline constexpr int kStoreVersion = 1;
inline constexpr const char* kStoreManifest = "genome-store.json";
inline constexpr const char* kStoreBases = "bases.2bit";
inline constexpr const char* kStoreNRuns = "n_runs.bin";
inline constexpr const char* kStoreLowerRuns = "lower_runs.bin";
inline constexpr const char* kStoreContigs = "contigs.bin";
inline constexpr const char* kStoreNames = "names.bin";
inline constexpr const char* kStoreChecksums = "checksums.bin";
// Hashed chunk: 64 KiB (256 Kbases of bases.2bit), so that the first read of a window pages in
// and hashes 64 KiB, and the chunk table is 1/8192 of the store.
inline constexpr uint64_t kStoreChunkBytes = uint64_t{1} << 16;

// A damaged store (a size, hash or manifest that does not match): exit 5, as a corrupt
// checkpoint (DESIGN.md "Exit codes"); the launcher does not restart a worker that reports it.
inline constexpr ExitCode kStoreCorrupt = ExitCode::kCheckpointCorrupt;

struct BaseRun {
  uint64_t start = 0;  // store coordinate
  uint64_t length = 0;
};

struct ContigEntry {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t name_offset = 0;
  uint32_t name_length = 0;
  uint32_t source = 0;
};

static_assert(sizeof(BaseRun) == 16, "BaseRun is 16 bytes on disk");
static_assert(sizeof(ContigEntry) == 32, "ContigEntry is 32 bytes on disk");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the store format is little-endian");

// A source file as the manifest's "sources" record it ("bytes", "mtime_ns"): packing writes it,
// opening a store and the genome cache (genome_cache.hpp) compare it with the file as it is now.
struct FileStamp {
  uint64_t bytes = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp& o) const { return bytes == o.bytes && mtime_ns == o.mtime_ns; }
};
// `path`'s stamp; nullopt where it cannot be stat'ed.
std::optional<FileStamp> file_stamp(const std::string& path);

// Whether `path` is a store directory (holds the manifest; GenomeStore::open validates it).
bool is_genome_store(const std::string& path);

}  // namespace dnallm::data
