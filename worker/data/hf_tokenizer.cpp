#include "worker/data/hf_tokenizer.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/hf_bpe.hpp"

namespace dnallm::data {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

bool present(const std::string& path) {
  std::error_code ec;
  return std::filesystem::symlink_status(path, ec).type() != std::filesystem::file_type::not_found;
}

// Note [Untrusted files] (core/untrusted_file.hpp): regular files of bounded size, strict JSON.
bool read_json(const std::string& path, json& out) {
  if (!present(path)) return false;
  out = parse_json_strict(
      read_bounded_file(path, kMaxTokenizerFileBytes, ExitCode::kUsage, "tokenizer file"), path,
      ExitCode::kUsage);
  DNALLM_CHECK(out.is_object(), ExitCode::kUsage,
               "{} is not a JSON object: repair or re-download the file", path);
  return true;
}

std::vector<std::string> read_lines(const std::string& path) {
  const std::string text =
      read_bounded_file(path, kMaxTokenizerFileBytes, ExitCode::kUsage, "vocabulary");
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(begin, end - begin);
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    lines.push_back(std::move(line));
    begin = end + 1;
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines;
}

// Every piece once: two ids for one token would make encoding ambiguous.
void check_unique(const std::vector<std::string>& pieces, const std::string& where) {
  std::map<std::string, size_t> first;
  for (size_t i = 0; i < pieces.size(); ++i) {
    auto [it, fresh] = first.emplace(pieces[i], i);
    DNALLM_CHECK(fresh, ExitCode::kUsage,
                 "{}: token \"{}\" appears twice (ids {} and {}): the vocabulary is damaged; "
                 "repair or re-download it",
                 where, clip_for_message(pieces[i]), it->second, i);
  }
}

bool is_bases(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return c == 'A' || c == 'C' || c == 'G' || c == 'T' || c == 'N';
  });
}

// tokenizer.json's {"piece": id} vocabulary as pieces indexed by id.
std::vector<std::string> pieces_by_id(const json& vocab, const std::string& dir) {
  DNALLM_CHECK(vocab.is_object(), ExitCode::kUsage,
               "{}/tokenizer.json: model.vocab is not an object of token: id", dir);
  std::vector<std::string> pieces(vocab.size());
  std::vector<bool> taken(vocab.size(), false);
  for (const auto& [piece, id] : vocab.items()) {
    DNALLM_CHECK(id.is_number_integer(), ExitCode::kUsage,
                 "{}/tokenizer.json: the id of \"{}\" is not an integer", dir,
                 clip_for_message(piece));
    const auto i = id.get<int64_t>();
    DNALLM_CHECK(i >= 0 && i < int64_t(vocab.size()), ExitCode::kUsage,
                 "{}/tokenizer.json: id {} of \"{}\" is outside the vocabulary", dir, i,
                 clip_for_message(piece));
    DNALLM_CHECK(!taken[size_t(i)], ExitCode::kUsage,
                 "{}/tokenizer.json: tokens \"{}\" and \"{}\" have the same id {}: the "
                 "vocabulary is damaged; repair or re-download it",
                 dir, clip_for_message(pieces[size_t(i)]), clip_for_message(piece), i);
    taken[size_t(i)] = true;
    pieces[size_t(i)] = piece;
  }
  return pieces;
}

// vocab.txt and tokenizer.json's vocabulary, when both are there, must be the same list:
// else which one a reader uses decides every id.
void check_same_vocabulary(const std::vector<std::string>& from_txt, const json& tj,
                           const std::string& dir) {
  if (!tj.is_object() || !tj.contains("model") || !tj["model"].is_object() ||
      !tj["model"].contains("vocab") || !tj["model"]["vocab"].is_object()) {
    return;
  }
  const auto from_json = pieces_by_id(tj["model"]["vocab"], dir);
  size_t i = 0;
  while (i < from_txt.size() && i < from_json.size() && from_txt[i] == from_json[i]) ++i;
  if (i == from_txt.size() && i == from_json.size()) return;
  fail(ExitCode::kUsage,
       "{}: vocab.txt and tokenizer.json disagree at id {} (\"{}\" vs \"{}\"; {} and {} "
       "tokens): the files are from different tokenizers; keep the matching pair",
       dir, i, i < from_txt.size() ? clip_for_message(from_txt[i]) : "(end)",
       i < from_json.size() ? clip_for_message(from_json[i]) : "(end)", from_txt.size(),
       from_json.size());
}

// The length k of every DNA piece of a k-mer vocabulary (DNABERT: one k).
int kmer_length(const std::vector<std::string>& pieces, const std::string& dir) {
  int k = 0;
  for (const auto& p : pieces) {
    if (!is_bases(p)) continue;
    if (k == 0) k = static_cast<int>(p.size());
    DNALLM_CHECK(static_cast<int>(p.size()) == k, ExitCode::kUsage,
                 "{}: the vocabulary mixes k-mers of length {} and {} (\"{}\"): only one k-mer "
                 "length (DNABERT) is supported",
                 dir, k, p.size(), p);
  }
  DNALLM_CHECK(k > 0, ExitCode::kUsage,
               "{}: the vocabulary holds no DNA k-mer: not a DNABERT-style tokenizer", dir);
  return k;
}

// The content of a special-token entry of tokenizer_config.json ("[CLS]" or {"content": ...}).
std::string token_text(const json& config, const char* key) {
  if (!config.contains(key) || config[key].is_null()) return "";
  const auto& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content")) return v["content"].get<std::string>();
  return "";
}

// The id of the token tokenizer_config.json names for `key` (else `fallback`), -1 if none.
int64_t role_id(const HfTokenizer& t, const json& config, const char* key,
                const std::string& fallback) {
  std::string text = token_text(config, key);
  if (text.empty()) text = fallback;
  return text.empty() ? int64_t{-1} : t.id_of(text);
}

}  // namespace

// TemplateProcessing "single": special tokens before and after $A, with the ids its
// special_tokens table gives (what the library adds), else the vocabulary's.
void HfTokenizer::read_template(const json& tj, const std::string& where) {
  const auto& post = tj.value("post_processor", json());
  if (post.is_null()) return;
  DNALLM_CHECK(post.is_object() && post.value("type", std::string()) == "TemplateProcessing",
               ExitCode::kUsage,
               "{}: post_processor {} is not supported: supported is TemplateProcessing", where,
               clip_for_message(post.dump(), 200));
  const auto& table = post.value("special_tokens", json::object());
  bool seen_sequence = false;
  for (const auto& item : post.at("single")) {
    if (item.contains("Sequence")) {
      DNALLM_CHECK(!seen_sequence, ExitCode::kUsage,
                   "{}: post_processor.single holds the sequence twice", where);
      seen_sequence = true;
      continue;
    }
    const auto name = item.at("SpecialToken").at("id").get<std::string>();
    std::vector<int64_t> ids;
    if (table.contains(name)) {
      ids = table[name].at("ids").get<std::vector<int64_t>>();
    } else {
      ids = {id_of(name)};
    }
    for (const auto id : ids) {
      DNALLM_CHECK(id >= 0 && id < vocab_size(), ExitCode::kUsage,
                   "{}: post_processor's \"{}\" (id {}) is not in the vocabulary", where,
                   clip_for_message(name), id);
      (seen_sequence ? suffix_ : prefix_).push_back(id);
    }
  }
}

HfTokenizer HfTokenizer::from_bpe_json(const json& config, const json& tj,
                                       const std::string& where) {
  try {
    HfTokenizer t;
    t.tokenizer_class_ = config.value("tokenizer_class", std::string());
    t.pad_left_ = config.value("padding_side", std::string("right")) == "left";
    DNALLM_CHECK(tj.contains("model") && tj["model"].contains("vocab"), ExitCode::kUsage,
                 "{}: model.vocab is missing", where);
    t.pieces_ = pieces_by_id(tj["model"]["vocab"], where);
    check_unique(t.pieces_, where);
    t.scheme_ = Scheme::kBpe;
    t.index();
    t.bpe_ = HfBpe::parse(tj, t.pieces_, where);
    t.special_.unk = t.bpe_->unk();
    t.special_.pad = role_id(t, config, "pad_token", "[PAD]");
    t.special_.cls = role_id(t, config, "cls_token", "[CLS]");
    t.special_.sep = role_id(t, config, "sep_token", "[SEP]");
    t.special_.mask = role_id(t, config, "mask_token", "[MASK]");
    t.special_.bos = role_id(t, config, "bos_token", "");
    t.special_.eos = role_id(t, config, "eos_token", "");
    t.read_template(tj, where);
    return t;
  } catch (const json::exception& e) {  // a value of the wrong JSON type
    fail(ExitCode::kUsage, "{}: a value of the wrong type ({}): repair or re-download the file",
         where, clip_for_message(e.what(), 200));
  }
}

HfTokenizer::HfTokenizer(Scheme scheme, std::vector<std::string> pieces, HfSpecialTokens special,
                         int k, std::string tokenizer_class)
    : scheme_(scheme),
      pieces_(std::move(pieces)),
      special_(special),
      k_(k),
      tokenizer_class_(std::move(tokenizer_class)) {
  DNALLM_CHECK(scheme_ != Scheme::kBpe, ExitCode::kFailure,
               "HfTokenizer: a BPE tokenizer is read from its tokenizer.json (load)");
  index();
  if (scheme_ == Scheme::kCharacter) {
    if (special_.bos >= 0) prefix_ = {special_.bos};
  } else {
    if (special_.cls >= 0) prefix_ = {special_.cls};
    const int64_t end = scheme_ == Scheme::kLongestMatch ? special_.eos : special_.sep;
    if (end >= 0) suffix_ = {end};
  }
}

void HfTokenizer::index() {
  ids_.clear();
  max_piece_ = 1;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    ids_.emplace(pieces_[i], static_cast<int64_t>(i));
    if (is_bases(pieces_[i])) max_piece_ = std::max(max_piece_, pieces_[i].size());
  }
}

size_t HfTokenizer::bpe_merges() const { return bpe_ ? bpe_->merges() : 0; }

int64_t HfTokenizer::id_of(const std::string& piece) const {
  auto it = ids_.find(piece);
  return it == ids_.end() ? -1 : it->second;
}

HfTokenizer HfTokenizer::load(const std::string& dir) {
  try {
    HfTokenizer t;
    json config = json::object(), tj;
    read_json(dir + "/tokenizer_config.json", config);
    const bool has_tj = read_json(dir + "/tokenizer.json", tj);
    const bool has_vocab = present(dir + "/vocab.txt");
    const std::string cls = config.value("tokenizer_class", std::string());
    t.tokenizer_class_ = cls;
    t.pad_left_ = config.value("padding_side", std::string("right")) == "left";
    DNALLM_CHECK(!config.contains("auto_map"), ExitCode::kUsage,
                 "{}/tokenizer_config.json: \"auto_map\" asks for remote tokenizer code, which is "
                 "not run here: supported are BertTokenizer (DNABERT k-mers), EsmTokenizer "
                 "(Nucleotide Transformer) and a tokenizers WordLevel tokenizer.json (one token a "
                 "base)",
                 dir);

    if (cls == "EsmTokenizer") {
      t.load_esm(dir, config, tj, has_tj, has_vocab);
      return t;
    }

    if (cls == "BertTokenizer" || cls == "BertTokenizerFast" || cls == "DNATokenizer" ||
        (cls.empty() && has_vocab)) {
      t.load_bert(dir, config, tj, has_tj, has_vocab);
      return t;
    }

    DNALLM_CHECK(has_tj, ExitCode::kUsage,
                 "{}: tokenizer_class \"{}\" without a tokenizer.json is not supported: supported "
                 "are BertTokenizer (DNABERT k-mers, vocab.txt), EsmTokenizer (vocab.txt) and a "
                 "tokenizers WordLevel tokenizer.json",
                 dir, cls);
    const auto& model = tj.value("model", json::object());
    const std::string type = model.value("type", std::string());
    DNALLM_CHECK(type == "WordLevel" || type == "BPE", ExitCode::kUsage,
                 "{}/tokenizer.json: model type \"{}\" is not supported: supported are WordLevel "
                 "(one token a base) and BPE (DNABERT-2); Unigram/WordPiece DNA tokenizers are "
                 "not yet",
                 dir, type);
    DNALLM_CHECK(model.contains("vocab"), ExitCode::kUsage,
                 "{}/tokenizer.json: model.vocab is missing", dir);
    if (type == "BPE") {
      if (has_vocab) check_same_vocabulary(read_lines(dir + "/vocab.txt"), tj, dir);
      return from_bpe_json(config, tj, dir + "/tokenizer.json");
    }
    t.load_word_level(dir, config, tj, has_vocab);
    return t;
  } catch (const json::exception& e) {  // a value of the wrong JSON type
    fail(ExitCode::kUsage,
         "{}: a tokenizer file has a value of the wrong type ({}): repair or "
         "re-download it",
         dir, clip_for_message(e.what(), 200));
  }
}

// EsmTokenizer (Nucleotide Transformer): vocab.txt, longest match first.
void HfTokenizer::load_esm(const std::string& dir, const json& config, const json& tj, bool has_tj,
                           bool has_vocab) {
  auto role = [&](const char* key, const std::string& fallback) {
    return role_id(*this, config, key, fallback);
  };
  DNALLM_CHECK(has_vocab, ExitCode::kUsage, "{}: EsmTokenizer needs vocab.txt", dir);
  scheme_ = Scheme::kLongestMatch;
  pieces_ = read_lines(dir + "/vocab.txt");
  check_unique(pieces_, dir + "/vocab.txt");
  if (has_tj) check_same_vocabulary(pieces_, tj, dir);
  index();
  special_.unk = role("unk_token", "<unk>");
  special_.pad = role("pad_token", "<pad>");
  special_.mask = role("mask_token", "<mask>");
  special_.cls = role("cls_token", "<cls>");
  special_.eos = role("eos_token", "<eos>");
  special_.bos = id_of("<bos>");
  k_ = static_cast<int>(max_piece_);
  if (special_.cls >= 0) prefix_ = {special_.cls};
  if (special_.eos >= 0) suffix_ = {special_.eos};
}

// BertTokenizer (DNABERT): overlapping k-mers from vocab.txt or tokenizer.json's vocabulary.
void HfTokenizer::load_bert(const std::string& dir, const json& config, const json& tj, bool has_tj,
                            bool has_vocab) {
  auto role = [&](const char* key, const std::string& fallback) {
    return role_id(*this, config, key, fallback);
  };
  if (has_vocab) {
    pieces_ = read_lines(dir + "/vocab.txt");
    check_unique(pieces_, dir + "/vocab.txt");
    if (has_tj) check_same_vocabulary(pieces_, tj, dir);
  } else {
    DNALLM_CHECK(has_tj && tj.contains("model") && tj["model"].contains("vocab"), ExitCode::kUsage,
                 "{}: BertTokenizer needs vocab.txt or tokenizer.json", dir);
    pieces_ = pieces_by_id(tj["model"]["vocab"], dir);
  }
  DNALLM_CHECK(!config.value("do_lower_case", false), ExitCode::kUsage,
               "{}/tokenizer_config.json: do_lower_case = true is not supported (DNA k-mers "
               "are upper case): set it to false",
               dir);
  scheme_ = Scheme::kOverlappingKmer;
  index();
  k_ = kmer_length(pieces_, dir);
  special_.unk = role("unk_token", "[UNK]");
  special_.pad = role("pad_token", "[PAD]");
  special_.cls = role("cls_token", "[CLS]");
  special_.sep = role("sep_token", "[SEP]");
  special_.mask = role("mask_token", "[MASK]");
  DNALLM_CHECK(special_.cls >= 0 && special_.sep >= 0 && special_.unk >= 0, ExitCode::kUsage,
               "{}: BertTokenizer vocabulary lacks [CLS], [SEP] or [UNK]", dir);
  prefix_ = {special_.cls};
  suffix_ = {special_.sep};
}

// A tokenizers WordLevel tokenizer.json: one token a base, or k-mers separated by spaces.
void HfTokenizer::load_word_level(const std::string& dir, const json& config, const json& tj,
                                  bool has_vocab) {
  const auto& model = tj.value("model", json::object());
  auto role = [&](const char* key, const std::string& fallback) {
    return role_id(*this, config, key, fallback);
  };
  const auto& pre = tj.value("pre_tokenizer", json());
  const bool per_char = pre.is_object() && pre.value("type", std::string()) == "Split" &&
                        pre.contains("pattern") && pre["pattern"].value("String", "x").empty() &&
                        pre.value("behavior", std::string()) == "Isolated";
  // Words split at spaces: the input is the overlapping k-mers separated by spaces (DNABERT's
  // convention, what export_hf_tokenizer writes for k-mer tokenizers).
  const bool words = pre.is_object() && pre.value("type", std::string()) == "WhitespaceSplit";
  DNALLM_CHECK(per_char || words, ExitCode::kUsage,
               "{}/tokenizer.json: pre_tokenizer {} is not supported: supported are Split on \"\" "
               "(Isolated), one token a character, and WhitespaceSplit over k-mers",
               dir, pre.dump());
  DNALLM_CHECK(tj.value("normalizer", json()).is_null(), ExitCode::kUsage,
               "{}/tokenizer.json: a normalizer ({}) is not supported", dir,
               tj["normalizer"].dump());
  pieces_ = pieces_by_id(model.at("vocab"), dir);
  if (has_vocab) check_same_vocabulary(read_lines(dir + "/vocab.txt"), tj, dir);
  scheme_ = per_char ? Scheme::kCharacter : Scheme::kOverlappingKmer;
  index();
  if (words) k_ = kmer_length(pieces_, dir);
  special_.unk = id_of(model.value("unk_token", std::string("<unk>")));
  special_.pad = role("pad_token", "<pad>");
  special_.bos = role("bos_token", "<bos>");
  special_.eos = role("eos_token", "<eos>");
  special_.mask = role("mask_token", "");
  special_.cls = role("cls_token", "");
  special_.sep = role("sep_token", "");
  read_template(tj, dir + "/tokenizer.json");
}

HfTokenizer HfTokenizer::dna_characters(const std::string& dir, const std::string& cls) {
  try {
    HfTokenizer t;
    json config = json::object();
    const std::string where = dir + "/tokenizer_config.json";
    read_json(where, config);
    const std::string theirs = config.value("tokenizer_class", cls);
    DNALLM_CHECK(theirs == cls, ExitCode::kUsage,
                 "{}: tokenizer_class \"{}\" is not the {} this model's hub code defines", where,
                 clip_for_message(theirs), cls);
    t.tokenizer_class_ = cls;
    t.scheme_ = Scheme::kCharacter;
    t.pieces_ = {"[CLS]", "[SEP]", "[BOS]", "[MASK]", "[PAD]", "[RESERVED]", "[UNK]"};
    std::vector<std::string> bases = {"A", "C", "G", "T", "N"};
    if (config.contains("characters") && !config["characters"].is_null()) {
      bases = config["characters"].get<std::vector<std::string>>();
      DNALLM_CHECK(!bases.empty() && bases.size() <= 64 &&
                       std::all_of(bases.begin(), bases.end(),
                                   [](const std::string& b) { return b.size() == 1; }),
                   ExitCode::kUsage,
                   "{}: \"characters\" must list single characters (A, C, G, T, N)", where);
    }
    t.pieces_.insert(t.pieces_.end(), bases.begin(), bases.end());
    check_unique(t.pieces_, where);
    t.index();
    t.special_ = {/*pad=*/4,  /*unk=*/6, /*cls=*/0, /*sep=*/1,
                  /*mask=*/3, /*bos=*/2, /*eos=*/1};
    t.suffix_ = {t.special_.sep};
    t.pad_left_ = config.value("padding_side", std::string("left")) == "left";
    // CaduceusTokenizer's _tokenize is list(text.upper()), HyenaDNA's list(text): their ids for
    // lower-case input are tests/data/hf-fixtures/{caduceus,hyenadna}_*/lower_case.json.
    t.upper_cases_ = cls == "CaduceusTokenizer";
    return t;
  } catch (const json::exception& e) {
    fail(ExitCode::kUsage, "{}/tokenizer_config.json: a value of the wrong type ({})", dir,
         clip_for_message(e.what(), 200));
  }
}

std::vector<int64_t> HfTokenizer::encode(std::string_view raw) const {
  std::vector<int64_t> ids = prefix_;
  encode_into(raw, ids, /*keep_case=*/false);
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  return ids;
}

std::vector<int64_t> HfTokenizer::encode_unframed(std::string_view raw, bool keep_case) const {
  std::vector<int64_t> ids;
  encode_into(raw, ids, keep_case);
  return ids;
}

void HfTokenizer::encode_into(std::string_view raw, std::vector<int64_t>& ids,
                              bool keep_case) const {
  std::string bases(raw);
  if (!keep_case || upper_cases_) {
    for (auto& c : bases) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  switch (scheme_) {
    case Scheme::kOverlappingKmer:
      for (size_t i = 0; i + size_t(k_) <= bases.size(); ++i) {
        const auto id = id_of(bases.substr(i, size_t(k_)));
        ids.push_back(id >= 0 ? id : special_.unk);
      }
      break;
    case Scheme::kLongestMatch: {
      bool in_unknown_run = false;
      for (size_t i = 0; i < bases.size();) {
        size_t len = std::min(max_piece_, bases.size() - i);
        int64_t id = -1;
        for (; len > 0; --len) {
          id = id_of(bases.substr(i, len));
          if (id >= 0) break;
        }
        if (id < 0) {
          // A run of characters that start no piece is one unknown token, as the trie split
          // of EsmTokenizer leaves it one chunk.
          if (!in_unknown_run) ids.push_back(special_.unk);
          in_unknown_run = true;
          ++i;
        } else {
          in_unknown_run = false;
          ids.push_back(id);
          i += len;
        }
      }
      break;
    }
    case Scheme::kCharacter:
      for (char c : bases) {
        const auto id = id_of(std::string(1, c));
        ids.push_back(id >= 0 ? id : special_.unk);
      }
      break;
    case Scheme::kBpe:
      bpe_->encode(bases, ids);
      break;
  }
}

HfBatch HfTokenizer::encode_batch(const std::vector<std::string>& sequences) const {
  std::vector<std::vector<int64_t>> rows;
  size_t longest = 0;
  for (const auto& s : sequences) {
    rows.push_back(encode(s));
    longest = std::max(longest, rows.back().size());
  }
  DNALLM_CHECK(
      rows.size() <= 1 || special_.pad >= 0 ||
          std::all_of(rows.begin(), rows.end(), [&](const auto& r) { return r.size() == longest; }),
      ExitCode::kUsage, "the tokenizer has no pad token: give sequences of one length");
  HfBatch b;
  b.rows = static_cast<int64_t>(rows.size());
  b.seq_len = static_cast<int64_t>(longest);
  for (const auto& r : rows) {
    const size_t pad = longest - r.size();
    if (pad_left_) {
      b.input_ids.insert(b.input_ids.end(), pad, special_.pad);
      b.attention_mask.insert(b.attention_mask.end(), pad, 0);
    }
    b.input_ids.insert(b.input_ids.end(), r.begin(), r.end());
    b.attention_mask.insert(b.attention_mask.end(), r.size(), 1);
    if (!pad_left_) {
      b.input_ids.insert(b.input_ids.end(), pad, special_.pad);
      b.attention_mask.insert(b.attention_mask.end(), pad, 0);
    }
  }
  return b;
}

}  // namespace dnallm::data
