// The tokenizer of a Hugging Face model directory, as that model's family tokenizes DNA, in
// the directory's own id space (torch-free).
//
// Supported layouts (anything else throws Error(kUsage) naming the file and what is supported):
//   - DNABERT (tokenizer_class "BertTokenizer", or a vocab.txt with [CLS]/[SEP]): every
//     regular piece of vocab.txt (or tokenizer.json's WordPiece vocab) is a k-mer of one
//     length k; a sequence becomes [CLS] + its overlapping k-mers + [SEP], a k-mer that is
//     not in the vocabulary (one with N) is [UNK]. This is what BertTokenizer gives for the
//     k-mers written space-separated, the input DNABERT expects.
//   - Nucleotide Transformer (tokenizer_class "EsmTokenizer", vocab.txt): EsmTokenizer's
//     split, the longest vocabulary piece at each position (non-overlapping 6-mers, single
//     bases for N and leftovers), framed <cls> ... <eos>.
//   - tokenizer.json with a WordLevel model and a pre-tokenizer that isolates every
//     character (Split on ""): one token a base, the TemplateProcessing post-processor's
//     special tokens around it.
//   - tokenizer.json with a BPE model (DNABERT-2, GENA-LM): the tokenizers library's merges
//     (hf_bpe.hpp lists the options read and the ones refused), then the TemplateProcessing
//     post-processor's special tokens ([CLS] ... [SEP] for DNABERT-2). Ids identical to the
//     library's for the upper-cased text (tests/hf/check_bpe.py).
// tokenizer.json's "truncation" and "padding" are not applied: transformers' tokenizer call
// does not apply them either unless asked (truncation=True, padding=...).
// Padding: to the longest sequence of a batch with the pad token, on the right (or left when
// tokenizer_config.json says padding_side = "left").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dnallm::data {

class HfBpe;

// Ids of the roles a model's special tokens play (-1: the vocabulary has none).
struct HfSpecialTokens {
  int64_t pad = -1, unk = -1, cls = -1, sep = -1, mask = -1, bos = -1, eos = -1;
};

struct HfBatch {
  std::vector<int64_t> input_ids;       // [rows, seq_len] row-major
  std::vector<int64_t> attention_mask;  // [rows, seq_len]
  int64_t rows = 0, seq_len = 0;
};

class HfTokenizer {
 public:
  enum class Scheme { kOverlappingKmer, kLongestMatch, kCharacter, kBpe };

  // Reads the tokenizer files of `dir` (tokenizer_config.json, vocab.txt, tokenizer.json).
  static HfTokenizer load(const std::string& dir);

  // `bases`: A/C/G/T/N (upper-cased here). Ids with the family's special tokens around them.
  // BPE: Error(kBadData) for a byte that is not printable ASCII (hf_bpe.hpp).
  std::vector<int64_t> encode(std::string_view bases) const;
  // encode() without the post-processor's special tokens around the sequence. `keep_case`:
  // lower-case bases are read as the reference tokenizer reads them (none of these
  // vocabularies has lower-case pieces: a k-mer or character holding one is the unknown token,
  // BPE's unknown characters follow its fuse_unk, and the longest-match split (EsmTokenizer's
  // trie) makes a run of characters that start no piece one unknown token; a tokenizer that
  // upper-cases its text, Caduceus', reads them as bases: upper_cases_input()).
  std::vector<int64_t> encode_unframed(std::string_view bases, bool keep_case = false) const;
  // encode() each sequence and pad them to the longest.
  HfBatch encode_batch(const std::vector<std::string>& sequences) const;

  Scheme scheme() const { return scheme_; }
  int k() const { return k_; }  // k-mer length (k-mer and longest-match schemes), else 0
  size_t bpe_merges() const;    // the BPE model's merges (kBpe), else 0
  int64_t vocab_size() const { return static_cast<int64_t>(pieces_.size()); }
  const HfSpecialTokens& special() const { return special_; }
  const std::string& piece(int64_t id) const { return pieces_.at(static_cast<size_t>(id)); }
  int64_t id_of(const std::string& piece) const;  // -1 when absent
  // The special tokens encode() puts before and after the sequence.
  const std::vector<int64_t>& prefix() const { return prefix_; }
  const std::vector<int64_t>& suffix() const { return suffix_; }
  bool pads_left() const { return pad_left_; }
  const std::string& tokenizer_class() const { return tokenizer_class_; }
  // Whether the reference upper-cases the text before it splits it (CaduceusTokenizer's
  // _tokenize: list(text.upper())): lower-case bases are then bases whatever `keep_case` says.
  bool upper_cases_input() const { return upper_cases_; }

  // The character tokenizer that HyenaDNA's and Caduceus' hub code define in Python
  // (HyenaDNATokenizer, CaduceusTokenizer; a download holds at most its tokenizer_config.json):
  // [CLS] [SEP] [BOS] [MASK] [PAD] [RESERVED] [UNK] = ids 0-6, then the bases A C G T N; a
  // sequence becomes its bases + [SEP]; padding on the left unless tokenizer_config.json says
  // otherwise. Reads <dir>/tokenizer_config.json when present (its class must be
  // `tokenizer_class`, its "characters" the bases). HyenaDNATokenizer keeps the case (a
  // lower-case base is [UNK]); CaduceusTokenizer upper-cases the text (upper_cases_input()).
  static HfTokenizer dna_characters(const std::string& dir, const std::string& tokenizer_class);

  // A BPE tokenizer from the documents themselves (tokenizer_config.json, maybe {}, and
  // tokenizer.json): what load() reads for a BPE model; `where` names them in messages.
  static HfTokenizer from_bpe_json(const nlohmann::json& config, const nlohmann::json& tj,
                                   const std::string& where);

  // The same tokenizer built from parts (export of this project's own tokenizers).
  HfTokenizer(Scheme scheme, std::vector<std::string> pieces, HfSpecialTokens special, int k,
              std::string tokenizer_class);

 private:
  HfTokenizer() = default;
  void index();
  void encode_into(std::string_view bases, std::vector<int64_t>& ids, bool keep_case) const;
  void read_template(const nlohmann::json& tj, const std::string& where);
  // load's three kinds of tokenizer, into this one (tokenizer_class_ and pad_left_ already set).
  void load_esm(const std::string& dir, const nlohmann::json& config, const nlohmann::json& tj,
                bool has_tj, bool has_vocab);
  void load_bert(const std::string& dir, const nlohmann::json& config, const nlohmann::json& tj,
                 bool has_tj, bool has_vocab);
  void load_word_level(const std::string& dir, const nlohmann::json& config,
                       const nlohmann::json& tj, bool has_vocab);

  Scheme scheme_ = Scheme::kCharacter;
  std::vector<std::string> pieces_;     // by id
  std::map<std::string, int64_t> ids_;  // piece -> id
  HfSpecialTokens special_;
  std::vector<int64_t> prefix_, suffix_;  // framing around the sequence
  int k_ = 0;
  size_t max_piece_ = 1;
  bool pad_left_ = false;
  bool upper_cases_ = false;  // upper_cases_input()
  std::string tokenizer_class_;
  std::shared_ptr<const HfBpe> bpe_;  // kBpe
};

}  // namespace dnallm::data
