// Tokenizers for DNA: single nucleotide ("char"), k-mer ("kmer", DNABERT style), the
// Nucleotide Transformer split ("nt"), BPE through SentencePiece ("bpe") and a Hugging Face
// directory's BPE tokenizer.json ("hf", DNABERT-2's).
//
// Special tokens have fixed ids in every tokenizer, first in the vocabulary:
//   [PAD]=0  [UNK]=1  [CLS]=2  [SEP]=3  [MASK]=4
// Regular tokens start at kFirstRegularId (5).
//
// encode() takes bases already validated and upper-cased by a reader (A C G T N) and
// returns ids without special tokens; framing ([CLS] ... [SEP]) is the objective's job
// (objectives.hpp). A tokenizer is immutable after construction and safe to use from many
// threads at once.
//
// Serialisation: to_json() ({"kind", "version", kind-specific fields, "special_tokens":
// {"[PAD]": 0, ...}, "vocab_size"}) holds everything needed to rebuild an equal tokenizer (the BPE
// model proto is embedded, base64). Checkpoints and exported models store it; loading
// compares with operator== and refuses a mismatch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.hpp"

namespace dnallm {
struct TokenizerConfig;
struct Config;
}  // namespace dnallm

namespace dnallm::data {

inline constexpr int64_t kPadId = 0;
inline constexpr int64_t kUnkId = 1;
inline constexpr int64_t kClsId = 2;
inline constexpr int64_t kSepId = 3;
inline constexpr int64_t kMaskId = 4;
inline constexpr int64_t kFirstRegularId = 5;
inline constexpr int64_t kNumSpecialTokens = 5;

// Names of the special tokens, indexed by id.
const std::vector<std::string>& special_token_names();

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual cfg::TokenizerKind tokenizer_kind() const = 0;  // the tokenizer.kind it implements
  // Its tokenizer.kind spelled ("char", "kmer", "nt", "bpe", "hf"): tokenizer.json's "kind".
  std::string kind() const { return cfg::spelling(tokenizer_kind()); }
  virtual int64_t vocab_size() const = 0;  // special tokens included
  // `bases`: upper-case A/C/G/T/N. Ids in [0, vocab_size), no special tokens added.
  virtual std::vector<int64_t> encode(std::string_view bases) const = 0;
  // Inverse of encode() for sequences without N runs in k-mers; special ids are dropped.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // Bases that produce `tokens` tokens (window sizing). BPE: an estimate; encode() output is
  // truncated to the token budget by the objective.
  virtual int64_t bases_for_tokens(int64_t tokens) const = 0;
  // The piece string of one id (special tokens by name).
  virtual std::string id_to_piece(int64_t id) const = 0;

  // The id of the single-base "N" token, or -1 when N has no token of its own (k-mers with
  // an N are [UNK]). Objectives never mask nor score it.
  virtual int64_t n_id() const { return -1; }

  virtual nlohmann::json to_json() const = 0;

  bool is_special(int64_t id) const { return id < kFirstRegularId; }
};

bool operator==(const Tokenizer& a, const Tokenizer& b);
// Throws Error(kUsage) naming `where` (a checkpoint or model directory) when `saved` (from
// to_json()) does not describe the same tokenizer as `current`: resuming or fine-tuning
// with another vocabulary would silently mis-train.
void require_same_tokenizer(const Tokenizer& current, const nlohmann::json& saved,
                            const std::string& where);
inline bool operator!=(const Tokenizer& a, const Tokenizer& b) { return !(a == b); }

// Rebuilds a tokenizer from to_json() output. Throws Error(kUsage) on a malformed document.
std::shared_ptr<const Tokenizer> tokenizer_from_json(const nlohmann::json& j);
void save_tokenizer(const Tokenizer& tokenizer, const std::string& path);  // JSON file
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& path);

// Single nucleotide: A=5 C=6 G=7 T=8 N=9; vocab 10.
std::shared_ptr<const Tokenizer> make_char_tokenizer();

// k-mers, k in 3..8, stride 1 (overlapping: L - k + 1 tokens) or k (non-overlapping:
// floor(L / k) tokens). Id of a k-mer = 5 + its base-4 value with A<C<G<T (lexicographic,
// as DNABERT's vocab.txt); a k-mer containing N is [UNK]. vocab = 5 + 4^k.
std::shared_ptr<const Tokenizer> make_kmer_tokenizer(int k, int stride);

// tokenizer.kind = "nt": the Nucleotide Transformer split (what EsmTokenizer does with its
// 6-mer vocab.txt) for training: non-overlapping k-mers, a single base for N and for what is
// left over; vocab = our 5 special tokens, the 4^k k-mers (A<C<G<T order), then A C G T N.
// Fine-tuning an esm directory maps these pieces onto its vocabulary by name.
std::shared_ptr<const Tokenizer> make_nt_tokenizer(int k);

// BPE over SentencePiece. Trains on `sample_lines` (each a chunk of bases) to `vocab_size`
// pieces (special tokens included), deterministic for the same input. Throws Error(kUsage)
// if vocab_size is too small for the alphabet.
std::shared_ptr<const Tokenizer> train_bpe_tokenizer(const std::vector<std::string>& sample_lines,
                                                     int64_t vocab_size);
// Loads a SentencePiece .model file (trained by train_bpe_tokenizer and saved with
// save_bpe_model) and checks the special-token ids.
std::shared_ptr<const Tokenizer> load_bpe_model(const std::string& path);
void save_bpe_model(const Tokenizer& bpe, const std::string& path);

// tokenizer.kind = "hf": a Hugging Face directory's own BPE tokenizer.json (DNABERT-2), for
// fine-tuning that model (model.init_from): its merges exactly (HfTokenizer: the tokenizers
// library's ids), its ids renamed to our layout (Note [Hugging Face BPE in our id layout]):
// our five special tokens, then its other tokens in its id order. Throws Error(kUsage) for a
// directory without a BPE tokenizer.json.
std::shared_ptr<const Tokenizer> load_hf_bpe_tokenizer(const std::string& dir);

// From the config: char / kmer directly; hf from tokenizer.path, else model.init_from; bpe loads
// tokenizer.path when it exists, else trains on the first 1 Mbases of data.train_files and saves to
// tokenizer.path (atomic rename). Training is deterministic, so ranks that start together and all
// train get the same model, but each spends ~10 s of CPU: for multi-rank runs train once beforehand
// (one process with the same config) and point tokenizer.path at the file.
// Throws Error(kUsage) for bad options (k out of range, stride not 1 or k, unknown kind).
std::shared_ptr<const Tokenizer> make_tokenizer(const Config& config);

}  // namespace dnallm::data
