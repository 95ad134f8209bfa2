// The BPE tokenizer.json reader (worker/data/hf_bpe.cpp) on small hand-made files: encoding
// against a textbook reference (repeatedly merge the lowest-rank adjacent pair, the leftmost
// of equal ranks: the rule the tokenizers library follows, checked against the library
// itself by tests/hf/check_bpe.py), the library's documented tie-breaking and unknown-
// character rules, and the refusals (exit code 2, one line naming the file and the field).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/config.hpp"
#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/process.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"

namespace dnallm::data {
namespace {

using dnallm::testing::expect_error;

namespace fs = std::filesystem;
using nlohmann::json;
using nlohmann::ordered_json;

const std::vector<std::string> kSpecials = {"[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"};

class HfBpeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = dnallm::testing::make_test_case_dir("hf_bpe");
    std::ofstream(dir_ / "tokenizer_config.json")
        << R"({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]",
              "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]",
              "unk_token": "[UNK]"})";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // DNABERT-2's layout: the five special tokens, then the pieces; merges as "a b" strings.
  static ordered_json dnabert2(const std::vector<std::string>& pieces,
                               const std::vector<std::pair<std::string, std::string>>& merges) {
    ordered_json vocab = ordered_json::object();
    ordered_json added = ordered_json::array();
    for (const auto& s : kSpecials) {
      added.push_back({{"id", vocab.size()}, {"content", s}, {"special", true}});
      vocab[s] = vocab.size();
    }
    for (const auto& p : pieces) vocab[p] = vocab.size();
    ordered_json m = ordered_json::array();
    for (const auto& [a, b] : merges) m.push_back(a + " " + b);
    ordered_json single =
        ordered_json::array({{{"SpecialToken", {{"id", "[CLS]"}, {"type_id", 0}}}},
                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                             {{"SpecialToken", {{"id", "[SEP]"}, {"type_id", 0}}}}});
    return {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"added_tokens", added},
            {"normalizer", nullptr},
            {"pre_tokenizer", {{"type", "Whitespace"}}},
            {"post_processor",
             {{"type", "TemplateProcessing"},
              {"single", single},
              {"special_tokens",
               {{"[CLS]", {{"id", "[CLS]"}, {"ids", {1}}, {"tokens", {"[CLS]"}}}},
                {"[SEP]", {{"id", "[SEP]"}, {"ids", {2}}, {"tokens", {"[SEP]"}}}}}}}},
            {"decoder", nullptr},
            {"model",
             {{"type", "BPE"},
              {"dropout", nullptr},
              {"unk_token", "[UNK]"},
              {"continuing_subword_prefix", nullptr},
              {"end_of_word_suffix", nullptr},
              {"fuse_unk", false},
              {"byte_fallback", false},
              {"vocab", vocab},
              {"merges", m}}}};
  }
  void write(const ordered_json& tj) { std::ofstream(dir_ / "tokenizer.json") << tj.dump(1); }
  HfTokenizer load(const ordered_json& tj) {
    write(tj);
    return HfTokenizer::load(dir_.string());
  }
  // Expects load (or encode of `text`) to fail with `code`, one line holding every needle.
  void expect_refused(const ordered_json& tj, const std::vector<std::string>& needles,
                      const std::string& text = "", ExitCode code = ExitCode::kUsage) {
    write(tj);
    try {
      auto t = HfTokenizer::load(dir_.string());
      (void)t.encode(text);
      FAIL() << "accepted; expected: " << needles.front();
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.code(), code) << what;
      for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      EXPECT_LT(what.size(), 600u) << what;
    }
  }
  std::vector<std::string> pieces_of(const HfTokenizer& t, const std::vector<int64_t>& ids) {
    std::vector<std::string> out;
    for (auto id : ids) out.push_back(t.piece(id));
    return out;
  }
  fs::path dir_;
};

// The textbook definition, O(n^2) per word: while some adjacent pair has a merge, merge the
// one of lowest rank (leftmost among equal ranks). Unknown characters are [UNK], one each.
std::vector<std::string> reference_bpe(
    const std::string& word, const std::vector<std::pair<std::string, std::string>>& merges,
    const std::map<std::string, int>& vocab) {
  std::map<std::pair<std::string, std::string>, size_t> rank;
  for (size_t i = 0; i < merges.size(); ++i) rank.emplace(merges[i], i);
  std::vector<std::string> s;
  for (char c : word) s.push_back(vocab.count(std::string(1, c)) ? std::string(1, c) : "[UNK]");
  for (;;) {
    size_t best = s.size(), best_rank = SIZE_MAX;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      auto it = rank.find({s[i], s[i + 1]});
      if (it != rank.end() && it->second < best_rank) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best == s.size()) return s;
    s[best] += s[best + 1];
    s.erase(s.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
}

// Random merges over A/C/G/T built in rank order, as a trainer would (each merge's parts
// exist before it), and random words with N (not in the vocabulary): ours == reference.
TEST_F(HfBpeTest, MatchesTheTextbookMergeOrderOnRandomVocabularies) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 20; ++round) {
    std::vector<std::string> pieces = {"A", "C", "G", "T"};
    std::vector<std::pair<std::string, std::string>> merges;
    std::map<std::string, int> vocab;
    for (const auto& p : pieces) vocab[p] = 1;
    std::set<std::pair<std::string, std::string>> used;
    const int wanted = 5 + static_cast<int>(rng() % 60);
    for (int tries = 0; static_cast<int>(merges.size()) < wanted && tries < 10000; ++tries) {
      const std::string a = pieces[rng() % pieces.size()];
      const std::string b = pieces[rng() % pieces.size()];
      if (a.size() + b.size() > 12 || used.count({a, b}) || vocab.count(a + b)) continue;
      used.insert({a, b});
      merges.emplace_back(a, b);
      pieces.push_back(a + b);
      vocab[a + b] = 1;
    }
    const auto t = load(dnabert2(pieces, merges));
    ASSERT_EQ(t.scheme(), HfTokenizer::Scheme::kBpe);
    ASSERT_EQ(t.bpe_merges(), merges.size());
    for (int w = 0; w < 50; ++w) {
      std::string word;
      const size_t n = 1 + rng() % (w < 40 ? 30 : 400);
      const char* alphabet = round % 2 ? "ACGT" : "AAAAACGTN";
      for (size_t i = 0; i < n; ++i) word += alphabet[rng() % (round % 2 ? 4 : 9)];
      const auto ids = t.encode(word);
      ASSERT_GE(ids.size(), 2u);
      EXPECT_EQ(ids.front(), t.id_of("[CLS]"));
      EXPECT_EQ(ids.back(), t.id_of("[SEP]"));
      const std::vector<int64_t> inner(ids.begin() + 1, ids.end() - 1);
      ASSERT_EQ(pieces_of(t, inner), reference_bpe(word, merges, vocab))
          << "round " << round << " word " << word;
    }
  }
}

// The library's rules, as its own tests and documentation state them: equal ranks merge
// leftmost first; rank, not position, decides otherwise; a merge needs both parts present.
TEST_F(HfBpeTest, TieBreakingAndRankOrder) {
  auto t = load(dnabert2({"A", "C", "G", "AA"}, {{"A", "A"}}));
  EXPECT_EQ(pieces_of(t, t.encode("AAA")), (std::vector<std::string>{"[CLS]", "AA", "A", "[SEP]"}));
  EXPECT_EQ(pieces_of(t, t.encode("aaaaa")),
            (std::vector<std::string>{"[CLS]", "AA", "AA", "A", "[SEP]"}));
  t = load(dnabert2({"A", "C", "G", "CG", "AC"}, {{"C", "G"}, {"A", "C"}}));
  EXPECT_EQ(pieces_of(t, t.encode("ACG")), (std::vector<std::string>{"[CLS]", "A", "CG", "[SEP]"}));
  t = load(dnabert2({"A", "C", "G", "AC", "CG"}, {{"A", "C"}, {"C", "G"}}));
  EXPECT_EQ(pieces_of(t, t.encode("ACG")), (std::vector<std::string>{"[CLS]", "AC", "G", "[SEP]"}));
}

TEST_F(HfBpeTest, UnknownCharactersFuseUnkAndNoUnkToken) {
  auto tj = dnabert2({"A", "C", "G", "T", "AA"}, {{"A", "A"}});
  auto t = load(tj);
  EXPECT_EQ(pieces_of(t, t.encode("ANNAA")),
            (std::vector<std::string>{"[CLS]", "A", "[UNK]", "[UNK]", "AA", "[SEP]"}));
  tj["model"]["fuse_unk"] = true;
  t = load(tj);
  EXPECT_EQ(pieces_of(t, t.encode("ANNAA")),
            (std::vector<std::string>{"[CLS]", "A", "[UNK]", "AA", "[SEP]"}));
  EXPECT_EQ(t.special().unk, t.id_of("[UNK]"));
  tj["model"]["unk_token"] = nullptr;  // the library drops the character: A and A meet
  t = load(tj);
  EXPECT_EQ(pieces_of(t, t.encode("ANNA")), (std::vector<std::string>{"[CLS]", "AA", "[SEP]"}));
  EXPECT_EQ(t.special().unk, -1);
}

TEST_F(HfBpeTest, PairMergesIgnoreMergesAndPreTokenizers) {
  auto tj =
      dnabert2({"A", "C", "G", "T", "AC", "GT", "ACG"}, {{"A", "C"}, {"G", "T"}, {"AC", "G"}});
  const auto legacy = load(tj);
  tj["model"]["merges"] = ordered_json::array({{"A", "C"}, {"G", "T"}, {"AC", "G"}});
  const auto pairs = load(tj);
  EXPECT_EQ(legacy.encode("ACGTACG"), pairs.encode("ACGTACG"));
  EXPECT_EQ(pieces_of(pairs, pairs.encode("ACGT")),
            (std::vector<std::string>{"[CLS]", "AC", "GT", "[SEP]"}));
  tj["model"]["ignore_merges"] = true;  // a word that is a token is taken whole
  const auto whole = load(tj);
  EXPECT_EQ(pieces_of(whole, whole.encode("ACG")),
            (std::vector<std::string>{"[CLS]", "ACG", "[SEP]"}));
  EXPECT_EQ(pieces_of(whole, whole.encode("ACGT")),
            (std::vector<std::string>{"[CLS]", "AC", "GT", "[SEP]"}));
  // Whitespace: words are \w+ and [^\w\s]+ runs; merges never cross them.
  EXPECT_EQ(pieces_of(pairs, pairs.encode("AC GT-AC")),
            (std::vector<std::string>{"[CLS]", "AC", "GT", "[UNK]", "AC", "[SEP]"}));
  tj["pre_tokenizer"] = nullptr;  // one word: the space is an unknown character
  tj["model"]["ignore_merges"] = false;
  const auto one_word = load(tj);
  EXPECT_EQ(pieces_of(one_word, one_word.encode("A CGT")),
            (std::vector<std::string>{"[CLS]", "A", "[UNK]", "C", "GT", "[SEP]"}));
}

TEST_F(HfBpeTest, SpecialTokensAndPadding) {
  const auto t = load(dnabert2({"A", "C", "G", "T", "AC"}, {{"A", "C"}}));
  EXPECT_EQ(t.vocab_size(), 10);
  EXPECT_EQ(t.special().pad, 3);  // DNABERT-2: [PAD] is id 3
  EXPECT_EQ(t.special().cls, 1);
  EXPECT_EQ(t.special().sep, 2);
  EXPECT_EQ(t.special().mask, 4);
  const auto b = t.encode_batch({"ACAC", "A"});
  EXPECT_EQ(b.seq_len, 4);
  EXPECT_EQ(b.input_ids, (std::vector<int64_t>{1, 9, 9, 2, 1, 5, 2, 3}));
  EXPECT_EQ(b.attention_mask, (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 0}));
}

// 200k bases in one word: linear-logarithmic (a quadratic loop would take minutes here).
TEST_F(HfBpeTest, LongSequences) {
  const auto t = load(dnabert2({"A", "C", "G", "T", "AA", "AC", "GT", "ACGT", "AAAA"},
                               {{"A", "A"}, {"A", "C"}, {"G", "T"}, {"AC", "GT"}, {"AA", "AA"}}));
  std::string s(100000, 'A');
  for (int i = 0; i < 25000; ++i) s += "ACGT";
  const auto ids = t.encode(s);
  ASSERT_EQ(ids.size(), 2u + 25000u + 25000u);
  EXPECT_EQ(ids[1], t.id_of("AAAA"));
  EXPECT_EQ(ids[25000], t.id_of("AAAA"));
  EXPECT_EQ(ids[25001], t.id_of("ACGT"));
  EXPECT_EQ(ids[50000], t.id_of("ACGT"));
}

TEST_F(HfBpeTest, RefusesOptionsItDoesNotImplement) {
  const auto base = dnabert2({"A", "C", "G", "T", "AC"}, {{"A", "C"}});
  auto with = [&](const char* key, ordered_json value) {
    auto tj = base;
    tj["model"][key] = value;
    return tj;
  };
  expect_refused(with("dropout", 0.1), {"tokenizer.json", "model.dropout = 0.1"});
  expect_refused(with("byte_fallback", true), {"tokenizer.json", "model.byte_fallback"});
  expect_refused(with("continuing_subword_prefix", "##"),
                 {"tokenizer.json", "model.continuing_subword_prefix = \"##\""});
  expect_refused(with("end_of_word_suffix", "</w>"), {"model.end_of_word_suffix"});
  expect_refused(with("some_new_option", 1), {"tokenizer.json", "model.some_new_option"});
  expect_refused(with("unk_token", "<unk>"), {"model.unk_token \"<unk>\" is not in model.vocab"});
  auto tj = base;
  tj["normalizer"] = {{"type", "Lowercase"}};
  expect_refused(tj, {"tokenizer.json", "normalizer", "Lowercase"});
  tj = base;
  tj["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  expect_refused(tj, {"tokenizer.json", "pre_tokenizer", "ByteLevel"});
  tj = base;
  tj["post_processor"] = {{"type", "RobertaProcessing"}};
  expect_refused(tj, {"tokenizer.json", "post_processor", "RobertaProcessing"});
  tj = base;
  tj["model"]["type"] = "Unigram";
  expect_refused(tj, {"tokenizer.json", "model type \"Unigram\""});
}

TEST_F(HfBpeTest, RefusesDamagedVocabulariesAndMerges) {
  const auto base = dnabert2({"A", "C", "G", "T", "AC"}, {{"A", "C"}});
  auto tj = base;
  tj["model"]["merges"].push_back("A X");
  expect_refused(tj, {"tokenizer.json", "model.merges[1]", "needs \"X\", which is not in"});
  tj = base;
  tj["model"]["merges"].push_back("C A");  // "CA" is not a token
  expect_refused(tj, {"model.merges[1]", "needs \"CA\""});
  tj = base;
  tj["model"]["merges"].push_back("A C");
  expect_refused(tj, {"model.merges[1]", "repeats an earlier merge (rank 0)"});
  tj = base;
  tj["model"]["merges"].push_back("A  C");
  expect_refused(tj, {"model.merges[1]", "not two tokens separated by one space"});
  tj = base;
  tj["model"]["merges"].push_back(ordered_json::array({"A", "C"}));  // mixed forms
  expect_refused(tj, {"model.merges[1] is not a string"});
  tj = base;
  tj["model"]["vocab"]["AC"] = 5;  // "A" has 5 too
  expect_refused(tj, {"tokens \"A\" and \"AC\" have the same id 5"});
  tj = base;
  tj["added_tokens"][0]["content"] = "<unk>";
  expect_refused(tj, {"added token \"<unk>\" (id 0) is not model.vocab's token"});
  // The same token twice in the file: the strict JSON parse names it.
  write(base);
  std::string text;
  {
    std::ifstream in(dir_ / "tokenizer.json");
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto at = text.find("\"AC\": 9");
  ASSERT_NE(at, std::string::npos);
  text.insert(at, "\"AC\": 10,\n");
  std::ofstream(dir_ / "tokenizer.json") << text;
  expect_error([&] { HfTokenizer::load(dir_.string()); }, ExitCode::kUsage,
               {"key \"AC\" appears twice"});
}

TEST_F(HfBpeTest, RefusesTextItCannotEncodeLikeTheLibrary) {
  const auto base = dnabert2({"A", "C", "G", "T", "AC"}, {{"A", "C"}});
  expect_refused(base, {"byte 0xc3 at position 2", "tokenizer.json", "ASCII"}, "AC\xc3\xa9",
                 ExitCode::kBadData);
  expect_refused(base, {"\"[MASK]\", an added token"}, "ACG[MASK]T", ExitCode::kBadData);
}

// tokenizer.kind = "hf" (Note [Hugging Face BPE in our id layout]): the directory's tokens,
// renamed: the same pieces as HfTokenizer's, our special ids, a round trip through to_json().
TEST_F(HfBpeTest, OurIdLayoutOfTheDirectorysTokenizer) {
  auto tj =
      dnabert2({"A", "C", "G", "T", "AC", "GT", "ACGT"}, {{"A", "C"}, {"G", "T"}, {"AC", "GT"}});
  write(tj);
  const auto theirs = HfTokenizer::load(dir_.string());
  Config config;
  config.tokenizer.kind = cfg::TokenizerKind::kHf;
  config.model.init_from = dir_.string();
  const auto ours = make_tokenizer(config);
  EXPECT_EQ(ours->kind(), "hf");
  EXPECT_EQ(ours->vocab_size(), theirs.vocab_size());  // five special tokens on each side
  for (int64_t id = 0; id < kFirstRegularId; ++id) {
    EXPECT_EQ(ours->id_to_piece(id), special_token_names()[size_t(id)]);
  }
  std::mt19937_64 rng(11);
  for (int i = 0; i < 200; ++i) {
    std::string s;
    for (size_t n = 1 + rng() % 300; n > 0; --n) s += "ACGTN"[rng() % 5];
    const auto ids = ours->encode(s);
    const auto expected = theirs.encode_unframed(s);
    ASSERT_EQ(ids.size(), expected.size());
    for (size_t j = 0; j < ids.size(); ++j) {
      if (expected[j] == theirs.special().unk) {
        EXPECT_EQ(ids[j], kUnkId);
      } else {
        EXPECT_EQ(ours->id_to_piece(ids[j]), theirs.piece(expected[j]));
      }
    }
    std::string without_n;
    for (char c : s) {
      if (c != 'N') without_n += c;
    }
    EXPECT_EQ(ours->decode(ids), without_n);  // [UNK] (an N) is a special id: dropped
  }
  const auto again = tokenizer_from_json(ours->to_json());
  EXPECT_TRUE(*again == *ours);
  EXPECT_EQ(again->encode("ACGTNACGTAC"), ours->encode("ACGTNACGTAC"));
  require_same_tokenizer(*ours, again->to_json(), "a checkpoint");
  // Another merge list is another tokenizer; the message stays one short line.
  tj["model"]["merges"] = ordered_json::array({"A C", "G T"});
  write(tj);
  const auto other = load_hf_bpe_tokenizer(dir_.string());
  try {
    require_same_tokenizer(*other, ours->to_json(), "a checkpoint");
    FAIL() << "another merge list was taken for the same tokenizer";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_LT(std::string(e.what()).size(), 1000u) << e.what();
  }
}

TEST_F(HfBpeTest, KindHfRefusesOtherSchemesAndNeedsADirectory) {
  Config config;
  config.tokenizer.kind = cfg::TokenizerKind::kHf;
  try {
    make_tokenizer(config);
    FAIL() << "no directory accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs tokenizer.path"), std::string::npos) << e.what();
  }
  std::ofstream(dir_ / "tokenizer_config.json") << R"({"tokenizer_class": "EsmTokenizer"})";
  std::ofstream(dir_ / "vocab.txt") << "<cls>\n<pad>\n<eos>\n<unk>\nA\nC\nG\nT\nN\n<mask>\n";
  expect_error([&] { load_hf_bpe_tokenizer(dir_.string()); }, ExitCode::kUsage,
               {"use tokenizer.kind = \"kmer\""});
}

}  // namespace
}  // namespace dnallm::data
