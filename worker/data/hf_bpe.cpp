#include "worker/data/hf_bpe.hpp"

#include <algorithm>
#include <limits>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"

namespace dnallm::data {
namespace {

using nlohmann::json;

bool is_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool is_word(unsigned char c) {  // ASCII \w
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// A string field of model that may be null or absent ("" counts as absent, as in the library).
std::string optional_string(const json& model, const char* key, const std::string& where) {
  if (!model.contains(key) || model[key].is_null()) return "";
  DNALLM_CHECK(model[key].is_string(), ExitCode::kUsage,
               "{}: model.{} is not a string or null: repair or re-download the file", where, key);
  return model[key].get<std::string>();
}

bool optional_bool(const json& model, const char* key, const std::string& where) {
  if (!model.contains(key) || model[key].is_null()) return false;
  DNALLM_CHECK(model[key].is_boolean(), ExitCode::kUsage,
               "{}: model.{} is not true or false: repair or re-download the file", where, key);
  return model[key].get<bool>();
}

// The BPE model's options: only those this encoder reproduces (Error(kUsage) for the others).
void check_model_options(const json& model, const std::string& where) {
  static const char* const kKnown[] = {"type",
                                       "dropout",
                                       "unk_token",
                                       "continuing_subword_prefix",
                                       "end_of_word_suffix",
                                       "fuse_unk",
                                       "byte_fallback",
                                       "ignore_merges",
                                       "vocab",
                                       "merges"};
  for (const auto& [key, value] : model.items()) {
    DNALLM_CHECK(std::find(std::begin(kKnown), std::end(kKnown), key) != std::end(kKnown),
                 ExitCode::kUsage,
                 "{}: model.{} is an option of the BPE model not supported here (a newer "
                 "tokenizers format?): supported are dropout null, unk_token, fuse_unk, "
                 "ignore_merges",
                 where, clip_for_message(key));
  }
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    DNALLM_CHECK(model["dropout"].is_number(), ExitCode::kUsage,
                 "{}: model.dropout is not a number or null", where);
    const double p = model["dropout"].get<double>();
    DNALLM_CHECK(p == 0.0, ExitCode::kUsage,
                 "{}: model.dropout = {} (BPE-dropout: random merges) is not supported: set it to "
                 "null for inference and fine-tuning",
                 where, p);
  }
  DNALLM_CHECK(!optional_bool(model, "byte_fallback", where), ExitCode::kUsage,
               "{}: model.byte_fallback = true is not supported (DNA tokenizers map an unknown "
               "character to unk_token): set it to false",
               where);
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const std::string v = optional_string(model, key, where);
    DNALLM_CHECK(v.empty(), ExitCode::kUsage,
                 "{}: model.{} = \"{}\" is not supported (DNA BPE tokenizers have none): "
                 "supported is null",
                 where, key, clip_for_message(v));
  }
}

// The added tokens' contents (the model's own tokens: DNABERT-2's five special tokens), each
// checked to be model.vocab's token of its id.
std::vector<std::string> added_token_contents(const json& tj,
                                              const std::vector<std::string>& pieces,
                                              const std::string& where) {
  std::vector<std::string> added;
  if (tj.contains("added_tokens") && !tj["added_tokens"].is_null()) {
    for (const auto& t : tj["added_tokens"]) {
      // (an id of 1e25 is a JSON number too: converting it to int64 is undefined behaviour)
      DNALLM_CHECK(t.is_object() && t.contains("id") && t["id"].is_number_integer() &&
                       t.contains("content") && t["content"].is_string(),
                   ExitCode::kUsage,
                   "{}: an added token is not {{\"id\": integer, \"content\": string, ...}}: "
                   "the file is damaged; repair or re-download it",
                   where);
      const auto id = t.at("id").get<int64_t>();
      const auto& content = t.at("content").get_ref<const std::string&>();
      DNALLM_CHECK(id >= 0 && id < int64_t(pieces.size()) && pieces[size_t(id)] == content,
                   ExitCode::kUsage,
                   "{}: added token \"{}\" (id {}) is not model.vocab's token of that id: added "
                   "tokens beyond the BPE vocabulary are not supported",
                   where, clip_for_message(content), id);
      if (!content.empty()) added.push_back(content);
    }
  }
  return added;
}

// The normalizer (checked: none or a Unicode normal form) and the pre-tokenizer.
HfBpe::PreTokenizer pre_tokenizer_of(const json& tj, const std::string& where) {
  const json normalizer = tj.value("normalizer", json());
  if (!normalizer.is_null()) {
    const std::string type = normalizer.is_object() ? normalizer.value("type", "") : "";
    DNALLM_CHECK(type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD",
                 ExitCode::kUsage,
                 "{}: normalizer {} is not supported for a BPE model: supported are null and the "
                 "Unicode normal forms (NFC, NFD, NFKC, NFKD)",
                 where, clip_for_message(normalizer.dump(), 200));
  }
  const json pre = tj.value("pre_tokenizer", json());
  if (!pre.is_null()) {
    const std::string type = pre.is_object() ? pre.value("type", "") : "";
    DNALLM_CHECK(type == "Whitespace" || type == "WhitespaceSplit", ExitCode::kUsage,
                 "{}: pre_tokenizer {} is not supported for a BPE model: supported are null, "
                 "Whitespace and WhitespaceSplit",
                 where, clip_for_message(pre.dump(), 200));
    return type == "Whitespace" ? HfBpe::PreTokenizer::kWhitespace
                                : HfBpe::PreTokenizer::kWhitespaceSplit;
  }
  return HfBpe::PreTokenizer::kNone;
}

}  // namespace

std::shared_ptr<const HfBpe> HfBpe::parse(const json& tj, const std::vector<std::string>& pieces,
                                          const std::string& where) {
  auto b = std::shared_ptr<HfBpe>(new HfBpe());
  b->where_ = where;
  const json& model = tj.at("model");
  check_model_options(model, where);
  b->fuse_unk_ = optional_bool(model, "fuse_unk", where);
  b->ignore_merges_ = optional_bool(model, "ignore_merges", where);

  for (size_t i = 0; i < pieces.size(); ++i) b->vocab_.emplace(pieces[i], uint32_t(i));
  for (size_t c = 0; c < b->char_id_.size(); ++c) {
    auto it = b->vocab_.find(std::string(1, static_cast<char>(c)));
    b->char_id_[c] = it == b->vocab_.end() ? -1 : int64_t{it->second};
  }
  const std::string unk = optional_string(model, "unk_token", where);
  if (!unk.empty()) {
    auto it = b->vocab_.find(unk);
    DNALLM_CHECK(it != b->vocab_.end(), ExitCode::kUsage,
                 "{}: model.unk_token \"{}\" is not in model.vocab: repair or re-download the file",
                 where, clip_for_message(unk));
    b->unk_ = it->second;
  }

  b->read_merges(model);
  b->added_ = added_token_contents(tj, pieces, where);
  b->pre_ = pre_tokenizer_of(tj, where);
  return b;
}

void HfBpe::read_merges(const json& model) {
  // Merges: "a b" strings (lines starting "#version" skipped, as the library skips them) or
  // ["a", "b"] pairs, all of one form. Rank = position.
  DNALLM_CHECK(model.contains("merges") && model["merges"].is_array(), ExitCode::kUsage,
               "{}: model.merges is missing or not a list", where_);
  const json& merges = model["merges"];
  size_t capacity = 16;
  while (capacity < 2 * merges.size()) capacity *= 2;
  keys_.assign(capacity, kEmpty);
  values_.resize(capacity);
  mask_ = capacity - 1;
  const bool pairs = !merges.empty() && merges[0].is_array();
  uint32_t rank = 0;
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    std::string a, bb;
    if (pairs) {
      DNALLM_CHECK(
          m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), ExitCode::kUsage,
          "{}: model.merges[{}] is not a pair of strings like the merges before it", where_, i);
      a = m[0].get<std::string>();
      bb = m[1].get<std::string>();
    } else {
      DNALLM_CHECK(m.is_string(), ExitCode::kUsage,
                   "{}: model.merges[{}] is not a string \"a b\" like the merges before it", where_,
                   i);
      const auto& s = m.get_ref<const std::string&>();
      if (s.rfind("#version", 0) == 0) continue;
      const size_t space = s.find(' ');
      DNALLM_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                   ExitCode::kUsage,
                   "{}: model.merges[{}] (\"{}\") is not two tokens separated by one space", where_,
                   i, clip_for_message(s));
      a = s.substr(0, space);
      bb = s.substr(space + 1);
    }
    auto id_of = [&](const std::string& piece) -> uint32_t {
      auto it = vocab_.find(piece);
      DNALLM_CHECK(it != vocab_.end(), ExitCode::kUsage,
                   "{}: model.merges[{}] (\"{} {}\") needs \"{}\", which is not in model.vocab: "
                   "the file is damaged; repair or re-download it",
                   where_, i, clip_for_message(a, 40), clip_for_message(bb, 40),
                   clip_for_message(piece, 80));
      return it->second;
    };
    const uint32_t left = id_of(a), right = id_of(bb), merged = id_of(a + bb);
    const Merge* earlier = insert(key(left, right), Merge{rank, merged});
    DNALLM_CHECK(earlier == nullptr, ExitCode::kUsage,
                 "{}: model.merges[{}] (\"{} {}\") repeats an earlier merge (rank {}): the file "
                 "is damaged; repair or re-download it",
                 where_, i, clip_for_message(a, 40), clip_for_message(bb, 40),
                 earlier ? earlier->rank : 0);
    ++rank;
  }
}

const HfBpe::Merge* HfBpe::insert(uint64_t k, Merge m) {
  size_t i = slot(k);
  for (; keys_[i] != kEmpty; i = (i + 1) & mask_) {
    if (keys_[i] == k) return &values_[i];
  }
  keys_[i] = k;
  values_[i] = m;
  ++merges_;
  return nullptr;
}

void HfBpe::encode(std::string_view text, std::vector<int64_t>& out) const {
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    DNALLM_CHECK((c >= 0x20 && c < 0x7f) || (c >= '\t' && c <= '\r'), ExitCode::kBadData,
                 "a sequence holds the byte 0x{:02x} at position {}: the BPE tokenizer of {} takes "
                 "ASCII text (bases A/C/G/T/N)",
                 c, i, where_);
  }
  for (const auto& a : added_) {
    DNALLM_CHECK(text.find(a) == std::string_view::npos, ExitCode::kBadData,
                 "a sequence holds \"{}\", an added token of {}: the library would read it as "
                 "that token; give bases only",
                 clip_for_message(a), where_);
  }
  auto u = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  switch (pre_) {
    case PreTokenizer::kNone:
      encode_word(text, out);
      break;
    case PreTokenizer::kWhitespaceSplit:
      for (size_t i = 0; i < text.size();) {
        if (is_space(u(i))) {
          ++i;
          continue;
        }
        size_t end = i;
        while (end < text.size() && !is_space(u(end))) ++end;
        encode_word(text.substr(i, end - i), out);
        i = end;
      }
      break;
    case PreTokenizer::kWhitespace:  // \w+|[^\w\s]+
      for (size_t i = 0; i < text.size();) {
        if (is_space(u(i))) {
          ++i;
          continue;
        }
        const bool word = is_word(u(i));
        size_t end = i;
        while (end < text.size() && !is_space(u(end)) && is_word(u(end)) == word) ++end;
        encode_word(text.substr(i, end - i), out);
        i = end;
      }
      break;
  }
}

// Note [BPE merge order]
// The tokenizers library merges a word (models/bpe/word.rs, merge_all) by repeatedly taking
// the adjacent pair of lowest merge rank, the leftmost one among equal ranks, from a heap of
// (rank, position) entries over a linked list of symbols; an entry is stale when its left
// symbol was absorbed (length 0) or when the pair now there maps to another merged token.
// Because a symbol only grows by absorbing its right neighbour, the string of the pair at a
// position only grows, so "maps to the same merged id" means "the same pair": the order is
// exactly (rank, position) over the pairs that exist. This is that loop, O(n log n) in the
// word's length (DNA input is one word of up to a chromosome); the order, not the heap, fixes
// the result, so any heap gives the library's ids.
void HfBpe::encode_word(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(std::string(word));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  DNALLM_CHECK(word.size() < size_t(std::numeric_limits<int32_t>::max()), ExitCode::kBadData,
               "a sequence of {} bases is too long for one BPE word (at most 2^31 - 1): cut it "
               "into windows",
               word.size());
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    uint32_t len;  // characters; 0: merged into the symbol on its left
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  auto add = [&](uint32_t id, uint32_t len) {
    const auto n = static_cast<int32_t>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back({id, n - 1, -1, len});
  };
  // Characters outside the vocabulary: one unk_token each, or one for a run (fuse_unk);
  // without unk_token they are dropped, as the library drops them.
  uint32_t unk_run = 0;
  for (char ch : word) {
    const int64_t id = char_id_[static_cast<unsigned char>(ch)];
    if (id >= 0) {
      if (unk_run > 0) add(uint32_t(unk_), unk_run);
      unk_run = 0;
      add(uint32_t(id), 1);
    } else if (unk_ >= 0) {
      if (unk_run > 0 && !fuse_unk_) {
        add(uint32_t(unk_), unk_run);
        unk_run = 0;
      }
      ++unk_run;
    }
  }
  if (unk_run > 0) add(uint32_t(unk_), unk_run);

  struct Entry {
    uint32_t rank, pos, new_id;
  };
  auto later = [](const Entry& x, const Entry& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  std::vector<Entry> heap;
  heap.reserve(sym.size());
  for (size_t i = 0; i + 1 < sym.size(); ++i) {
    if (const Merge* m = find(sym[i].id, sym[i + 1].id)) {
      heap.push_back({m->rank, uint32_t(i), m->new_id});
    }
  }
  std::make_heap(heap.begin(), heap.end(), later);
  auto push = [&](const Merge* m, int32_t pos) {
    heap.push_back({m->rank, uint32_t(pos), m->new_id});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Entry top = heap.back();
    heap.pop_back();
    Symbol& s = sym[top.pos];
    if (s.len == 0 || s.next < 0) continue;
    Symbol& right = sym[size_t(s.next)];
    const Merge* m = find(s.id, right.id);
    if (m == nullptr || m->new_id != top.new_id) continue;  // stale
    s.id = top.new_id;
    s.len += right.len;
    right.len = 0;
    s.next = right.next;
    if (s.next >= 0) sym[size_t(s.next)].prev = int32_t(top.pos);
    if (s.prev >= 0) {
      if (const Merge* p = find(sym[size_t(s.prev)].id, s.id)) push(p, s.prev);
    }
    if (s.next >= 0) {
      if (const Merge* n = find(s.id, sym[size_t(s.next)].id)) push(n, int32_t(top.pos));
    }
  }
  for (const auto& x : sym) {
    if (x.len != 0) out.push_back(x.id);
  }
}

}  // namespace dnallm::data
