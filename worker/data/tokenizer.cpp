#include "worker/data/tokenizer.hpp"

#include <unistd.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include "core/error.hpp"
#include "core/output_file.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/hf_tokenizer.hpp"

namespace dnallm::data {
namespace {

using nlohmann::json;

// Base index of a nucleotide, -1 for anything else (N).
int base_index(char c) {
  switch (c) {
    case 'A':
      return 0;
    case 'C':
      return 1;
    case 'G':
      return 2;
    case 'T':
      return 3;
    default:
      return -1;
  }
}
constexpr std::array<char, 4> kBases = {'A', 'C', 'G', 'T'};

// Fields every tokenizer's JSON carries for readers of exported models (informational:
// from_json rebuilds from the kind-specific fields).
json with_common(json j, const Tokenizer& t) {
  json specials = json::object();
  const auto& names = special_token_names();
  for (size_t id = 0; id < names.size(); ++id) specials[names[id]] = id;
  j["special_tokens"] = specials;
  j["vocab_size"] = t.vocab_size();
  return j;
}

class CharTokenizer final : public Tokenizer {
 public:
  cfg::TokenizerKind tokenizer_kind() const override { return cfg::TokenizerKind::kChar; }
  int64_t vocab_size() const override { return kFirstRegularId + 5; }
  std::vector<int64_t> encode(std::string_view bases) const override {
    std::vector<int64_t> ids(bases.size());
    for (size_t i = 0; i < bases.size(); ++i) {
      int b = base_index(bases[i]);
      ids[i] = b >= 0 ? kFirstRegularId + b : (bases[i] == 'N' ? kFirstRegularId + 4 : kUnkId);
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (int64_t id : ids) {
      if (id >= kFirstRegularId && id < kFirstRegularId + 4)
        out.push_back(kBases[id - kFirstRegularId]);
      else if (id == kFirstRegularId + 4 || id == kUnkId)
        out.push_back('N');
    }
    return out;
  }
  int64_t bases_for_tokens(int64_t tokens) const override { return tokens; }
  std::string id_to_piece(int64_t id) const override {
    if (id < kFirstRegularId) return special_token_names().at(static_cast<size_t>(id));
    return std::string(1, "ACGTN"[id - kFirstRegularId]);
  }
  int64_t n_id() const override { return kFirstRegularId + 4; }
  json to_json() const override {
    return with_common(json{{"kind", "char"}, {"version", 1}}, *this);
  }
};

class KmerTokenizer final : public Tokenizer {
 public:
  KmerTokenizer(int k, int stride) : k_(k), stride_(stride) {}
  cfg::TokenizerKind tokenizer_kind() const override { return cfg::TokenizerKind::kKmer; }
  int64_t vocab_size() const override { return kFirstRegularId + (int64_t{1} << (2 * k_)); }
  std::vector<int64_t> encode(std::string_view bases) const override {
    std::vector<int64_t> ids;
    if (static_cast<int64_t>(bases.size()) < k_) return ids;
    ids.reserve((bases.size() - k_) / stride_ + 1);
    for (size_t start = 0; start + k_ <= bases.size(); start += stride_) {
      int64_t value = 0;
      bool has_n = false;
      for (int j = 0; j < k_; ++j) {
        int b = base_index(bases[start + j]);
        if (b < 0) {
          has_n = true;
          break;
        }
        value = value * 4 + b;
      }
      ids.push_back(has_n ? kUnkId : kFirstRegularId + value);
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    bool first = true;
    for (int64_t id : ids) {
      if (id < kFirstRegularId && id != kUnkId) continue;
      std::string piece = id == kUnkId ? std::string(k_, 'N') : id_to_piece(id);
      if (first || stride_ == k_)
        out += piece;
      else
        out += piece.substr(k_ - stride_);
      first = false;
    }
    return out;
  }
  int64_t bases_for_tokens(int64_t tokens) const override {
    if (tokens <= 0) return 0;
    return stride_ == 1 ? tokens + k_ - 1 : tokens * k_;
  }
  std::string id_to_piece(int64_t id) const override {
    if (id < kFirstRegularId) return special_token_names().at(static_cast<size_t>(id));
    int64_t value = id - kFirstRegularId;
    std::string piece(k_, 'A');
    for (int j = k_ - 1; j >= 0; --j) {
      piece[j] = kBases[value & 3];
      value >>= 2;
    }
    return piece;
  }
  json to_json() const override {
    return with_common(json{{"kind", "kmer"}, {"version", 1}, {"k", k_}, {"stride", stride_}},
                       *this);
  }

 private:
  int k_;
  int stride_;
};

// The Nucleotide Transformer split (EsmTokenizer's): non-overlapping k-mers, a single base for
// N and for what is left over.
class NtTokenizer final : public Tokenizer {
 public:
  explicit NtTokenizer(int k) : k_(k), kmers_(int64_t{1} << (2 * k)) {
    DNALLM_CHECK(k >= 2 && k <= 8, ExitCode::kUsage,
                 "tokenizer.k = {} is out of range for kind = \"nt\": use 2..8 (6 for the "
                 "Nucleotide Transformer)",
                 k);
  }
  cfg::TokenizerKind tokenizer_kind() const override { return cfg::TokenizerKind::kNt; }
  int64_t vocab_size() const override { return kFirstRegularId + kmers_ + 5; }
  std::vector<int64_t> encode(std::string_view bases) const override {
    std::vector<int64_t> ids;
    ids.reserve(bases.size() / size_t(k_) + 8);
    for (size_t i = 0; i < bases.size();) {
      int64_t value = 0;
      int j = 0;
      for (; j < k_ && i + size_t(j) < bases.size(); ++j) {
        const int b = base_index(bases[i + size_t(j)]);
        if (b < 0) break;
        value = value * 4 + b;
      }
      if (j == k_) {
        ids.push_back(kFirstRegularId + value);
        i += size_t(k_);
      } else {
        ids.push_back(single_id(bases[i]));
        ++i;
      }
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      if (id >= kFirstRegularId) out += id_to_piece(id);
    }
    return out;
  }
  int64_t bases_for_tokens(int64_t tokens) const override { return tokens <= 0 ? 0 : tokens * k_; }
  std::string id_to_piece(int64_t id) const override {
    if (id < kFirstRegularId) return special_token_names().at(static_cast<size_t>(id));
    int64_t value = id - kFirstRegularId;
    if (value >= kmers_) return std::string(1, "ACGTN"[value - kmers_]);
    std::string piece(size_t(k_), 'A');
    for (int j = k_ - 1; j >= 0; --j) {
      piece[size_t(j)] = kBases[value & 3];
      value >>= 2;
    }
    return piece;
  }
  int64_t n_id() const override { return kFirstRegularId + kmers_ + 4; }
  json to_json() const override {
    json specials = json::object();
    const auto& names = special_token_names();
    for (size_t id = 0; id < names.size(); ++id) specials[names[id]] = id;
    return json{{"kind", "nt"},
                {"version", 1},
                {"k", k_},
                {"special_tokens", specials},
                {"vocab_size", vocab_size()}};
  }

 private:
  int64_t single_id(char c) const {
    const int b = base_index(c);
    return kFirstRegularId + kmers_ + (b < 0 ? 4 : b);
  }
  int k_;
  int64_t kmers_;
};

// ---- base64 for embedding the SentencePiece model proto in JSON ----
const char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kB64[(v >> s) & 63]);
  }
  if (i < in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    if (i + 1 < in.size()) v |= uint8_t(in[i + 1]) << 8;
    out.push_back(kB64[(v >> 18) & 63]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

std::string base64_decode(const std::string& in) {
  std::array<int, 256> lut;
  lut.fill(-1);
  for (int i = 0; i < 64; ++i) lut[static_cast<uint8_t>(kB64[i])] = i;
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    int v = lut[static_cast<uint8_t>(c)];
    if (v < 0) fail(ExitCode::kUsage, "tokenizer JSON: invalid base64 character in BPE model");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

class BpeTokenizer final : public Tokenizer {
 public:
  // Throws Error(kUsage) if the proto does not load or the special ids differ.
  BpeTokenizer(std::string serialized_proto, double bases_per_token)
      : proto_(std::move(serialized_proto)), bases_per_token_(bases_per_token) {
    auto status = sp_.LoadFromSerializedProto(proto_);
    if (!status.ok()) fail(ExitCode::kUsage, "cannot load the BPE model: {}", status.ToString());
    const auto& names = special_token_names();
    for (size_t id = 0; id < names.size(); ++id) {
      if (sp_.PieceToId(names[id]) != static_cast<int>(id)) {
        fail(ExitCode::kUsage,
             "BPE model has {} at id {}, expected {}: train it with train_bpe_tokenizer()",
             names[id], sp_.PieceToId(names[id]), id);
      }
    }
    if (bases_per_token_ <= 0) {
      // Estimate from the vocabulary: the mean length of the regular pieces.
      double total = 0;
      int n = 0;
      for (int id = kFirstRegularId; id < sp_.GetPieceSize(); ++id) {
        std::string p = sp_.IdToPiece(id);
        if (p.rfind("\xE2\x96\x81", 0) == 0) p = p.substr(3);
        if (p.empty()) continue;
        total += static_cast<double>(p.size());
        ++n;
      }
      bases_per_token_ = n > 0 ? total / n : 1.0;
    }
  }
  cfg::TokenizerKind tokenizer_kind() const override { return cfg::TokenizerKind::kBpe; }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::vector<int64_t> encode(std::string_view bases) const override {
    std::vector<int> ids;
    auto status = sp_.Encode(std::string(bases), &ids);
    DNALLM_CHECK(status.ok(), ExitCode::kFailure, "SentencePiece encode failed: {}",
                 status.ToString());
    std::vector<int64_t> out;
    out.reserve(ids.size());
    for (int id : ids) {
      // The leading word-boundary piece "▁" carries no base: drop it.
      if (sp_.IdToPiece(id) == "\xE2\x96\x81") continue;
      out.push_back(id);
    }
    return out;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> regular;
    for (int64_t id : ids) {
      if (id >= kFirstRegularId) regular.push_back(static_cast<int>(id));
    }
    std::string out;
    auto status = sp_.Decode(regular, &out);
    DNALLM_CHECK(status.ok(), ExitCode::kFailure, "SentencePiece decode failed: {}",
                 status.ToString());
    return out;
  }
  int64_t bases_for_tokens(int64_t tokens) const override {
    return static_cast<int64_t>(static_cast<double>(tokens) * bases_per_token_ * 1.25) + 8;
  }
  std::string id_to_piece(int64_t id) const override { return sp_.IdToPiece(static_cast<int>(id)); }
  int64_t n_id() const override {
    int id = sp_.PieceToId("N");
    return id >= kFirstRegularId ? id : -1;
  }
  json to_json() const override {
    return with_common(json{{"kind", "bpe"},
                            {"version", 1},
                            {"bases_per_token", bases_per_token_},
                            {"model_proto_base64", base64_encode(proto_)}},
                       *this);
  }
  const std::string& proto() const { return proto_; }

 private:
  std::string proto_;
  double bases_per_token_;
  sentencepiece::SentencePieceProcessor sp_;
};

// Feeds in-memory lines to the SentencePiece trainer.
class VectorSentenceIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit VectorSentenceIterator(const std::vector<std::string>& lines) : lines_(lines) {}
  bool done() const override { return index_ >= lines_.size(); }
  void Next() override { ++index_; }
  const std::string& value() const override { return lines_[index_]; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  const std::vector<std::string>& lines_;
  size_t index_ = 0;
};

}  // namespace

const std::vector<std::string>& special_token_names() {
  static const std::vector<std::string> names = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  return names;
}

namespace {

// Note [Hugging Face BPE in our id layout]
// Fine-tuning a model with its own BPE (DNABERT-2) from model.init_from: the data pipeline
// and objectives need our fixed special ids ([PAD]=0 ... [MASK]=4), the model's rows are in
// its own order. This tokenizer encodes exactly as the directory does (HfTokenizer, the
// tokenizers library's ids), then renames the ids: its special tokens (the roles
// tokenizer_config.json names, and every added token marked special) become ours, its other
// tokens follow in its id order; hf_import's vocabulary_map takes every row back by name.
// to_json() embeds both files (canonical JSON), so a checkpoint or an export rebuilds it
// without the directory, and two tokenizers are equal when their files say the same.
class HfBpeTokenizer final : public Tokenizer {
 public:
  HfBpeTokenizer(json config, json tj, const std::string& where)
      : config_(std::move(config)),
        tj_(std::move(tj)),
        hf_(HfTokenizer::from_bpe_json(config_, tj_, where)) {
    const auto& sp = hf_.special();
    std::set<int64_t> special = {sp.pad, sp.unk, sp.cls, sp.sep, sp.mask, sp.bos, sp.eos};
    if (tj_.contains("added_tokens") && tj_["added_tokens"].is_array()) {
      for (const auto& a : tj_["added_tokens"]) {
        if (a.value("special", false)) special.insert(a.at("id").get<int64_t>());
      }
    }
    ours_.assign(static_cast<size_t>(hf_.vocab_size()), kUnkId);
    auto role = [&](int64_t theirs, int64_t ours) {
      if (theirs >= 0) ours_[static_cast<size_t>(theirs)] = ours;
    };
    role(sp.pad, kPadId);
    role(sp.unk, kUnkId);
    role(sp.cls >= 0 ? sp.cls : sp.bos, kClsId);
    role(sp.sep >= 0 ? sp.sep : sp.eos, kSepId);
    role(sp.mask, kMaskId);
    pieces_ = special_token_names();
    double total = 0;
    for (int64_t id = 0; id < hf_.vocab_size(); ++id) {
      if (special.count(id)) continue;
      ours_[static_cast<size_t>(id)] = static_cast<int64_t>(pieces_.size());
      pieces_.push_back(hf_.piece(id));
      total += static_cast<double>(hf_.piece(id).size());
    }
    const auto regular = pieces_.size() - special_token_names().size();
    bases_per_token_ = regular > 0 ? total / static_cast<double>(regular) : 1.0;
    n_id_ = -1;
    for (size_t id = kFirstRegularId; id < pieces_.size(); ++id) {
      if (pieces_[id] == "N") n_id_ = static_cast<int64_t>(id);
    }
  }
  cfg::TokenizerKind tokenizer_kind() const override { return cfg::TokenizerKind::kHf; }
  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  std::vector<int64_t> encode(std::string_view bases) const override {
    auto ids = hf_.encode_unframed(bases);
    for (auto& id : ids) id = ours_[static_cast<size_t>(id)];
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      if (id >= kFirstRegularId && id < vocab_size()) out += pieces_[static_cast<size_t>(id)];
    }
    return out;
  }
  int64_t bases_for_tokens(int64_t tokens) const override {
    return static_cast<int64_t>(static_cast<double>(tokens) * bases_per_token_ * 1.25) + 8;
  }
  std::string id_to_piece(int64_t id) const override { return pieces_.at(static_cast<size_t>(id)); }
  int64_t n_id() const override { return n_id_; }
  json to_json() const override {
    return with_common(json{{"kind", "hf"},
                            {"version", 1},
                            {"hf_tokenizer_config", config_.dump()},
                            {"hf_tokenizer_json", tj_.dump()}},
                       *this);
  }

 private:
  json config_, tj_;
  HfTokenizer hf_;
  std::vector<int64_t> ours_;  // their id -> ours
  std::vector<std::string> pieces_;
  double bases_per_token_ = 1.0;
  int64_t n_id_ = -1;
};

std::shared_ptr<const Tokenizer> hf_bpe_from_text(const std::string& config, const std::string& tj,
                                                  const std::string& where) {
  return std::make_shared<HfBpeTokenizer>(
      config.empty() ? json::object() : parse_json_strict(config, where, ExitCode::kUsage),
      parse_json_strict(tj, where, ExitCode::kUsage), where);
}

}  // namespace

std::shared_ptr<const Tokenizer> load_hf_bpe_tokenizer(const std::string& dir) {
  const auto probe = HfTokenizer::load(dir);  // every check, and the scheme
  DNALLM_CHECK(probe.scheme() == HfTokenizer::Scheme::kBpe, ExitCode::kUsage,
               "tokenizer.kind = \"hf\" reads a BPE tokenizer.json (DNABERT-2); {} has another "
               "scheme: use tokenizer.kind = \"kmer\" (DNABERT), \"nt\" (EsmTokenizer) or "
               "\"char\"",
               dir);
  auto read = [&](const std::string& name) -> std::string {
    const std::string path = dir + "/" + name;
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return "";
    return read_bounded_file(path, kMaxTokenizerFileBytes, ExitCode::kUsage, "tokenizer file");
  };
  return hf_bpe_from_text(read("tokenizer_config.json"), read("tokenizer.json"),
                          dir + "/tokenizer.json");
}

bool operator==(const Tokenizer& a, const Tokenizer& b) { return a.to_json() == b.to_json(); }

void require_same_tokenizer(const Tokenizer& current, const nlohmann::json& saved,
                            const std::string& where) {
  auto other = tokenizer_from_json(saved);
  if (*other == current) return;
  auto summary = [](const Tokenizer& t) {
    auto j = t.to_json();
    j.erase("model_proto_base64");
    j.erase("hf_tokenizer_json");  // the files, embedded: their size would flood the line
    j.erase("hf_tokenizer_config");
    return fmt::format("{} (vocab {})", j.dump(), t.vocab_size());
  };
  fail(ExitCode::kUsage,
       "{} was made with tokenizer {} but this run uses {}: set [tokenizer] to match, or start a "
       "new run",
       where, summary(*other), summary(current));
}

std::shared_ptr<const Tokenizer> make_char_tokenizer() { return std::make_shared<CharTokenizer>(); }

std::shared_ptr<const Tokenizer> make_kmer_tokenizer(int k, int stride) {
  if (k < 3 || k > 8) fail(ExitCode::kUsage, "tokenizer.k = {} is out of range: use 3..8", k);
  if (stride != 1 && stride != k) {
    fail(ExitCode::kUsage,
         "tokenizer.stride = {} with k = {}: use 1 (overlapping) or {} (non-overlapping)", stride,
         k, k);
  }
  return std::make_shared<KmerTokenizer>(k, stride);
}

std::shared_ptr<const Tokenizer> make_nt_tokenizer(int k) {
  return std::make_shared<NtTokenizer>(k);
}

std::shared_ptr<const Tokenizer> train_bpe_tokenizer(const std::vector<std::string>& sample_lines,
                                                     int64_t vocab_size) {
  if (vocab_size < kNumSpecialTokens + 8) {
    fail(ExitCode::kUsage, "tokenizer.vocab_size = {} is too small for BPE: use at least {}",
         vocab_size, kNumSpecialTokens + 8);
  }
  if (sample_lines.empty()) fail(ExitCode::kBadData, "no sequence to train the BPE tokenizer on");
  size_t max_len = 0;
  for (const auto& l : sample_lines) max_len = std::max(max_len, l.size());
  // Deterministic: one thread, no sampling of the input, no shuffling.
  std::string args = fmt::format(
      "--model_type=bpe --vocab_size={} --character_coverage=1.0 --num_threads=1 "
      "--pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 --pad_piece=[PAD] --unk_piece=[UNK] "
      "--bos_piece=[CLS] --eos_piece=[SEP] --user_defined_symbols=[MASK] "
      "--max_sentence_length={} --input_sentence_size=0 --shuffle_input_sentence=false "
      "--split_digits=false --add_dummy_prefix=false --remove_extra_whitespaces=false "
      "--max_sentencepiece_length=16 --hard_vocab_limit=false --minloglevel=2",
      vocab_size, max_len + 1);
  VectorSentenceIterator it(sample_lines);
  std::string proto;
  auto status = sentencepiece::SentencePieceTrainer::Train(args, &it, &proto);
  if (!status.ok()) fail(ExitCode::kUsage, "BPE training failed: {}", status.ToString());
  // bases_per_token is estimated from the vocabulary (not the sample), so a model loaded
  // from its .model file later compares equal to the one trained here.
  return std::make_shared<BpeTokenizer>(proto, 0.0);
}

std::shared_ptr<const Tokenizer> load_bpe_model(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ExitCode::kUsage, "cannot open BPE model {}: {}", path, errno_string());
  std::stringstream ss;
  ss << in.rdbuf();
  return std::make_shared<BpeTokenizer>(ss.str(), 0.0);
}

void save_bpe_model(const Tokenizer& bpe, const std::string& path) {
  auto* b = dynamic_cast<const BpeTokenizer*>(&bpe);
  if (b == nullptr) fail(ExitCode::kUsage, "save_bpe_model: tokenizer is {}, not bpe", bpe.kind());
  std::string tmp = path + ".tmp." + unique_temp_suffix();  // ranks may save at once
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(b->proto().data(), static_cast<std::streamsize>(b->proto().size()));
    if (!out) fail(ExitCode::kFailure, "cannot write {}: {}", tmp, errno_string());
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    fail(ExitCode::kFailure, "cannot rename {} to {}: {}", tmp, path, errno_string());
  }
}

std::shared_ptr<const Tokenizer> tokenizer_from_json(const nlohmann::json& j) {
  try {
    std::string kind = j.at("kind").get<std::string>();
    if (kind == "char") return make_char_tokenizer();
    if (kind == "kmer") return make_kmer_tokenizer(j.at("k").get<int>(), j.at("stride").get<int>());
    if (kind == "nt") return make_nt_tokenizer(j.at("k").get<int>());
    if (kind == "bpe") {
      return std::make_shared<BpeTokenizer>(
          base64_decode(j.at("model_proto_base64").get<std::string>()),
          j.at("bases_per_token").get<double>());
    }
    if (kind == "hf") {
      return hf_bpe_from_text(j.at("hf_tokenizer_config").get<std::string>(),
                              j.at("hf_tokenizer_json").get<std::string>(),
                              "the tokenizer JSON's embedded tokenizer.json");
    }
    fail(ExitCode::kUsage, "tokenizer JSON: unknown kind \"{}\" (char, kmer, nt, bpe, hf)",
         clip_for_message(kind));
  } catch (const json::exception& e) {
    fail(ExitCode::kUsage, "tokenizer JSON is malformed: {}", clip_for_message(e.what(), 200));
  }
}

void save_tokenizer(const Tokenizer& tokenizer, const std::string& path) {
  std::string tmp = path + ".tmp." + unique_temp_suffix();  // ranks may save at once
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << tokenizer.to_json().dump(1) << "\n";
    if (!out) fail(ExitCode::kFailure, "cannot write {}: {}", tmp, errno_string());
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    fail(ExitCode::kFailure, "cannot rename {} to {}: {}", tmp, path, errno_string());
  }
}

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& path) {
  // Note [Untrusted files]: a regular file of bounded size, strict JSON.
  const auto j = parse_json_strict(
      read_bounded_file(path, kMaxTokenizerFileBytes, ExitCode::kUsage, "tokenizer"), path,
      ExitCode::kUsage);
  return tokenizer_from_json(j);
}

}  // namespace dnallm::data
