// The BPE model of a Hugging Face tokenizer.json (the tokenizers library's "BPE"), as DNA
// models use it: DNABERT-2 (zhihan1996/DNABERT-2-117M), GENA-LM. Torch-free; HfTokenizer
// (hf_tokenizer.hpp) reads the file and frames the ids with the post-processor's tokens.
//
// Implemented, exactly as the tokenizers library (0.23) encodes (Note [BPE merge order]):
//   - normalizer null (or a Unicode normal form: NFC/NFD/NFKC/NFKD, the identity on the
//     ASCII text accepted here);
//   - pre_tokenizer null (the text is one word), Whitespace (words are the runs of
//     \w+ and of [^\w\s]+) or WhitespaceSplit (split at whitespace);
//   - model "BPE": vocab, merges as "a b" strings or ["a", "b"] pairs (rank = position),
//     unk_token (a character outside the vocabulary; none: the character is dropped, as
//     the library drops it), fuse_unk, ignore_merges, dropout null or 0;
//   - added_tokens: each must be model.vocab's token of that id; a text that holds one is
//     refused at encode time (the library would split it out as that token).
// Refused with Error(kUsage) naming the file and the field: dropout > 0, byte_fallback,
// continuing_subword_prefix, end_of_word_suffix, any other normalizer or pre-tokenizer, a
// merge naming a token outside the vocabulary (or whose concatenation is not in it), a merge
// given twice. Note [Untrusted files] applies: the JSON is parsed strictly and bounded by the
// caller; every count here is bounded by the file's size.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace dnallm::data {

class HfBpe {
 public:
  enum class PreTokenizer { kNone, kWhitespace, kWhitespaceSplit };

  // `tj`: the whole tokenizer.json; `pieces`: its model.vocab by id (already checked: dense,
  // unique); `where`: the file, for messages.
  static std::shared_ptr<const HfBpe> parse(const nlohmann::json& tj,
                                            const std::vector<std::string>& pieces,
                                            const std::string& where);

  // Appends the ids of `text` to `out`. `text` must be printable ASCII or whitespace
  // (Error(kBadData) otherwise: the library's Unicode classes are not reproduced here) and
  // hold no added token.
  void encode(std::string_view text, std::vector<int64_t>& out) const;

  int64_t unk() const { return unk_; }
  size_t merges() const { return merges_; }
  PreTokenizer pre_tokenizer() const { return pre_; }

 private:
  struct Merge {
    uint32_t rank;
    uint32_t new_id;
  };
  static uint64_t key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }
  // The merges in an open-addressing table (linear probing, at most half full): the lookup of
  // the encode loop, two or three per merge.
  const Merge* find(uint32_t a, uint32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }
  size_t slot(uint64_t k) const {
    return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> 32) & mask_;
  }
  const Merge* insert(uint64_t k, Merge m);         // the existing entry when `k` is there already
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // no id is 2^32 - 1 (bounded file)
  void encode_word(std::string_view word, std::vector<int64_t>& out) const;
  // model.merges into the table, each checked against vocab_ (parse, after the vocabulary).
  void read_merges(const nlohmann::json& model);

  std::string where_;
  std::unordered_map<std::string, uint32_t> vocab_;  // piece -> id
  std::array<int64_t, 128> char_id_{};               // id of each one-character piece, or -1
  std::vector<uint64_t> keys_;                       // (left id, right id) or kEmpty
  std::vector<Merge> values_;                        // rank, merged id
  size_t mask_ = 0, merges_ = 0;
  std::vector<std::string> added_;  // added tokens' contents
  int64_t unk_ = -1;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  PreTokenizer pre_ = PreTokenizer::kNone;
};

}  // namespace dnallm::data
