// Note [Sequence codec]: how a loaded model's own tokenizer turns DNA into framed token ids,
// whatever directory it came from (Note [One model loader], worker/models/model_dir.hpp).
// dnallm-eval and dnallm-infer see a model and its codec and nothing else:
//   - a directory of ours (final/, best/, a checkpoint's export): our tokenizer.json in our id
//     layout, framed as in training ([CLS] tokens [SEP] for encoders, [CLS] tokens for causal
//     models; data::encode_sample);
//   - a Hugging Face directory: its own tokenizer files in its own ids (data::HfTokenizer),
//     framed by its post-processor (DNABERT-2's [CLS] .. [SEP], NT's <cls> .., HyenaDNA's and
//     Caduceus' .. [SEP]), padded on the side it pads.
// Case: a Hugging Face tokenizer reads lower-case (soft-masked) bases as its reference does,
// by default (none of the published DNA vocabularies has lower-case pieces, so they become its
// unknown token: one per k-mer or base, one per run for NT's split; Caduceus' tokenizer
// upper-cases its text, so they are bases there); set_uppercase(true) (--uppercase) reads them
// as bases. Ours upper-case every base, as training did.
// Torch-free: worker/data's tests build it without LibTorch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dnallm::data {

class Tokenizer;
class HfTokenizer;

class SequenceCodec {
 public:
  virtual ~SequenceCodec() = default;

  // The ids of `bases` with the model's framing around them, at most `max_tokens` in all (the
  // regular tokens are cut at the end to fit; `cut` says so). max_tokens <= 0: no limit.
  virtual std::vector<int64_t> frame(std::string_view bases, int64_t max_tokens,
                                     bool* cut = nullptr) const = 0;
  // frame() without the special tokens after the sequence: a prompt to continue (HyenaDNA's
  // trailing [SEP] would end it).
  virtual std::vector<int64_t> frame_prompt(std::string_view bases, int64_t max_tokens,
                                            bool* cut = nullptr) const = 0;
  // The regular tokens of `bases` alone, no framing.
  virtual std::vector<int64_t> encode(std::string_view bases) const = 0;
  // The special tokens frame() adds before and after the sequence, and before it alone.
  virtual int64_t framing_tokens() const = 0;
  virtual int64_t prefix_tokens() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t pad_id() const = 0;
  virtual int64_t mask_id() const = 0;  // -1: none
  virtual int64_t unk_id() const = 0;   // -1: none
  // Transformers pads this model's batches on the left (HyenaDNA, Caduceus).
  virtual bool pads_left() const { return false; }
  virtual bool is_special(int64_t id) const = 0;
  // The bases a regular token stands for ("" for a special token or [UNK]).
  virtual std::string bases_of(int64_t id) const = 0;
  // The id of a regular piece, -1 when the vocabulary has none.
  virtual int64_t id_of(const std::string& piece) const = 0;
  // Whether each token stands for its own bases, left to right, without overlap (one token a
  // base, NT's 6-mers, BPE): what variant scoring and bits per base need. False for DNABERT's
  // overlapping k-mers.
  virtual bool tiles_bases() const = 0;
  // The regular tokens decoded back to bases (generation).
  virtual std::string decode(const std::vector<int64_t>& ids) const;
  // --uppercase: read lower-case bases as bases (a Hugging Face tokenizer; ours always do).
  virtual void set_uppercase(bool /*on*/) {}
  // Whether lower-case bases reach the tokenizer as they are (readers then keep the case).
  virtual bool keeps_case() const { return false; }
  // What it is, for logs: "ours (char)", "DNABERT-2 BPE tokenizer.json", ...
  virtual std::string describe() const = 0;
};

// Counts what lower-case input became, for the warning that says it (LowerCaseReport::warn).
struct LowerCaseReport {
  int64_t lower_bases = 0;     // lower-case bases read
  int64_t unknown_tokens = 0;  // unknown tokens in the sequences that held them
  // Adds a sequence and its ids.
  void add(std::string_view bases, const std::vector<int64_t>& ids, int64_t unk_id);
  // Logs a warning when lower-case bases became unknown tokens (nothing otherwise).
  void warn() const;
};

// Our tokenizer with our objectives' framing: [CLS] tokens [SEP] (`encoder`) or [CLS] tokens.
std::shared_ptr<SequenceCodec> make_own_codec(std::shared_ptr<const Tokenizer> tokenizer,
                                              bool encoder);
// A Hugging Face directory's tokenizer, as transformers frames and pads with it.
std::shared_ptr<SequenceCodec> make_hub_codec(std::shared_ptr<const HfTokenizer> tokenizer);

}  // namespace dnallm::data
