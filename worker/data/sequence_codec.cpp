#include "worker/data/sequence_codec.hpp"

#include <algorithm>
#include <map>
#include <utility>

#include <cctype>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"

namespace dnallm::data {
namespace {

bool is_base_piece(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return c == 'A' || c == 'C' || c == 'G' || c == 'T' || c == 'N';
  });
}

// The regular tokens cut to what fits `max_tokens` with `framing` special tokens around them.
void fit(std::vector<int64_t>& tokens, int64_t max_tokens, int64_t framing, bool* cut) {
  const int64_t budget = std::max<int64_t>(max_tokens - framing, 0);
  const bool too_long = max_tokens > 0 && static_cast<int64_t>(tokens.size()) > budget;
  if (too_long) tokens.resize(static_cast<size_t>(budget));
  if (cut != nullptr) *cut = too_long;
}

class OwnCodec final : public SequenceCodec {
 public:
  // What the tokenizer's pieces say is read once here, not per call: tiles_bases() and id_of()
  // are asked per window and per alternative allele (to_json() of a BPE tokenizer embeds its
  // whole model).
  OwnCodec(std::shared_ptr<const Tokenizer> t, bool encoder) : t_(std::move(t)), encoder_(encoder) {
    if (t_->tokenizer_kind() == cfg::TokenizerKind::kKmer) {
      const auto j = t_->to_json();
      tiles_ = j.value("stride", 1) == j.value("k", 1);
    }
    for (int64_t id = kFirstRegularId; id < t_->vocab_size(); ++id) {
      ids_.emplace(t_->id_to_piece(id), id);
    }
  }

  std::vector<int64_t> frame(std::string_view bases, int64_t max_tokens, bool* cut) const override {
    auto tokens = encode(bases);
    fit(tokens, max_tokens, framing_tokens(), cut);
    std::vector<int64_t> ids;
    ids.reserve(tokens.size() + 2);
    ids.push_back(kClsId);
    ids.insert(ids.end(), tokens.begin(), tokens.end());
    if (encoder_) ids.push_back(kSepId);
    return ids;
  }
  std::vector<int64_t> frame_prompt(std::string_view bases, int64_t max_tokens,
                                    bool* cut) const override {
    auto tokens = encode(bases);
    fit(tokens, max_tokens, 1, cut);
    tokens.insert(tokens.begin(), kClsId);
    return tokens;
  }
  std::vector<int64_t> encode(std::string_view bases) const override {
    std::string upper(bases);  // ours read upper-case bases, as in training
    for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return t_->encode(upper);
  }
  int64_t framing_tokens() const override { return encoder_ ? 2 : 1; }
  int64_t prefix_tokens() const override { return 1; }
  int64_t vocab_size() const override { return t_->vocab_size(); }
  int64_t pad_id() const override { return kPadId; }
  int64_t mask_id() const override { return kMaskId; }
  int64_t unk_id() const override { return kUnkId; }
  bool is_special(int64_t id) const override { return t_->is_special(id); }
  std::string bases_of(int64_t id) const override {
    if (id < 0 || id >= t_->vocab_size() || t_->is_special(id)) return "";
    auto piece = t_->id_to_piece(id);
    return is_base_piece(piece) ? piece : std::string();
  }
  int64_t id_of(const std::string& piece) const override {
    const auto it = ids_.find(piece);
    return it == ids_.end() ? -1 : it->second;
  }
  bool tiles_bases() const override { return tiles_; }
  std::string decode(const std::vector<int64_t>& ids) const override { return t_->decode(ids); }
  std::string describe() const override { return fmt::format("ours ({})", t_->kind()); }

 private:
  std::shared_ptr<const Tokenizer> t_;
  bool encoder_;
  bool tiles_ = true;                   // not overlapping k-mers
  std::map<std::string, int64_t> ids_;  // regular pieces, first id of each
};

class HubCodec final : public SequenceCodec {
 public:
  explicit HubCodec(std::shared_ptr<const HfTokenizer> t) : t_(std::move(t)) {
    special_ = {t_->special().pad,  t_->special().unk, t_->special().cls, t_->special().sep,
                t_->special().mask, t_->special().bos, t_->special().eos};
  }

  std::vector<int64_t> frame(std::string_view bases, int64_t max_tokens, bool* cut) const override {
    auto tokens = t_->encode_unframed(bases, keep_case_);
    fit(tokens, max_tokens, framing_tokens(), cut);
    std::vector<int64_t> ids = t_->prefix();
    ids.insert(ids.end(), tokens.begin(), tokens.end());
    ids.insert(ids.end(), t_->suffix().begin(), t_->suffix().end());
    return ids;
  }
  std::vector<int64_t> frame_prompt(std::string_view bases, int64_t max_tokens,
                                    bool* cut) const override {
    auto tokens = t_->encode_unframed(bases, keep_case_);
    fit(tokens, max_tokens, static_cast<int64_t>(t_->prefix().size()), cut);
    std::vector<int64_t> ids = t_->prefix();
    ids.insert(ids.end(), tokens.begin(), tokens.end());
    return ids;
  }
  std::vector<int64_t> encode(std::string_view bases) const override {
    return t_->encode_unframed(bases, keep_case_);
  }
  int64_t framing_tokens() const override {
    return static_cast<int64_t>(t_->prefix().size() + t_->suffix().size());
  }
  int64_t prefix_tokens() const override { return static_cast<int64_t>(t_->prefix().size()); }
  int64_t vocab_size() const override { return t_->vocab_size(); }
  int64_t pad_id() const override { return std::max<int64_t>(t_->special().pad, 0); }
  int64_t mask_id() const override { return t_->special().mask; }
  int64_t unk_id() const override { return t_->special().unk; }
  void set_uppercase(bool on) override { keep_case_ = !on; }
  bool keeps_case() const override { return keep_case_ && !t_->upper_cases_input(); }
  bool pads_left() const override { return t_->pads_left(); }
  bool is_special(int64_t id) const override {
    if (id < 0 || id >= t_->vocab_size()) return true;
    for (const auto s : special_) {
      if (s == id) return true;
    }
    return !is_base_piece(t_->piece(id));
  }
  std::string bases_of(int64_t id) const override {
    if (is_special(id)) return "";
    return t_->piece(id);
  }
  int64_t id_of(const std::string& piece) const override { return t_->id_of(piece); }
  bool tiles_bases() const override {
    return t_->scheme() != HfTokenizer::Scheme::kOverlappingKmer;
  }
  std::string describe() const override {
    static const char* const kSchemes[] = {"overlapping k-mers", "longest match",
                                           "one token a base", "BPE"};
    return fmt::format("the directory's {} ({})",
                       t_->tokenizer_class().empty() ? "tokenizer.json" : t_->tokenizer_class(),
                       kSchemes[static_cast<int>(t_->scheme())]);
  }

 private:
  std::shared_ptr<const HfTokenizer> t_;
  std::vector<int64_t> special_;
  bool keep_case_ = true;
};

}  // namespace

void LowerCaseReport::add(std::string_view bases, const std::vector<int64_t>& ids, int64_t unk_id) {
  int64_t lower = 0;
  for (const char c : bases) lower += std::islower(static_cast<unsigned char>(c)) ? 1 : 0;
  if (lower == 0) return;
  lower_bases += lower;
  for (const auto id : ids) unknown_tokens += id == unk_id ? 1 : 0;
}

void LowerCaseReport::warn() const {
  if (lower_bases == 0 || unknown_tokens == 0) return;
  spdlog::warn(
      "{} lower-case (soft-masked) bases were tokenized as the model's own tokenizer reads them: "
      "it has no lower-case tokens, so the sequences holding them have {} unknown tokens; give "
      "--uppercase to read them as bases",
      lower_bases, unknown_tokens);
}

std::string SequenceCodec::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (const auto id : ids) out += bases_of(id);
  return out;
}

std::shared_ptr<SequenceCodec> make_own_codec(std::shared_ptr<const Tokenizer> tokenizer,
                                              bool encoder) {
  return std::make_shared<OwnCodec>(std::move(tokenizer), encoder);
}

std::shared_ptr<SequenceCodec> make_hub_codec(std::shared_ptr<const HfTokenizer> tokenizer) {
  return std::make_shared<HubCodec>(std::move(tokenizer));
}

}  // namespace dnallm::data
