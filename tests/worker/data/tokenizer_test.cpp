#include "worker/data/tokenizer.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::data {
namespace {

using dnallm::testing::expect_error;

TEST(Tokenizer, SpecialIdsAreFixed) {
  EXPECT_EQ(kPadId, 0);
  EXPECT_EQ(kUnkId, 1);
  EXPECT_EQ(kClsId, 2);
  EXPECT_EQ(kSepId, 3);
  EXPECT_EQ(kMaskId, 4);
  auto tok = make_char_tokenizer();
  EXPECT_EQ(tok->id_to_piece(kMaskId), "[MASK]");
  EXPECT_EQ(tok->id_to_piece(kPadId), "[PAD]");
}

TEST(CharTokenizer, RoundTrip) {
  auto tok = make_char_tokenizer();
  EXPECT_EQ(tok->vocab_size(), 10);
  auto ids = tok->encode("ACGTN");
  EXPECT_EQ(ids, (std::vector<int64_t>{5, 6, 7, 8, 9}));
  EXPECT_EQ(tok->decode(ids), "ACGTN");
  std::string s = testing::random_bases(1000, 3);
  EXPECT_EQ(tok->decode(tok->encode(s)), s);
  EXPECT_EQ(tok->bases_for_tokens(510), 510);
  EXPECT_EQ(tok->n_id(), 9);
}

TEST(KmerTokenizer, OverlappingCountsAndIds) {
  auto tok = make_kmer_tokenizer(3, 1);
  EXPECT_EQ(tok->vocab_size(), 5 + 64);
  auto ids = tok->encode("AAACGT");
  ASSERT_EQ(ids.size(), 4u);                    // L - k + 1
  EXPECT_EQ(ids[0], 5);                         // AAA = 0
  EXPECT_EQ(ids[1], 5 + (0 * 16 + 0 * 4 + 1));  // AAC
  EXPECT_EQ(tok->id_to_piece(ids[3]), "CGT");
  EXPECT_EQ(tok->decode(ids), "AAACGT");
  EXPECT_EQ(tok->bases_for_tokens(510), 512);
  EXPECT_EQ(tok->id_to_piece(5 + 63), "TTT");
}

TEST(KmerTokenizer, NonOverlappingAndN) {
  auto tok = make_kmer_tokenizer(6, 6);
  EXPECT_EQ(tok->vocab_size(), 5 + 4096);
  std::string s = testing::random_bases(600, 9);
  auto ids = tok->encode(s);
  EXPECT_EQ(ids.size(), 100u);
  EXPECT_EQ(tok->decode(ids), s);
  EXPECT_EQ(tok->encode(s + "ACG").size(), 100u);  // floor(L / k)
  auto with_n = tok->encode("ACGTACNNNNNN");
  EXPECT_EQ(with_n.size(), 2u);
  EXPECT_NE(with_n[0], kUnkId);
  EXPECT_EQ(with_n[1], kUnkId);
  EXPECT_EQ(tok->bases_for_tokens(85), 510);
  for (int k = 3; k <= 8; ++k) {
    auto t = make_kmer_tokenizer(k, 1);
    EXPECT_EQ(t->encode(s).size(), 600u - k + 1);
    EXPECT_EQ(t->decode(t->encode(s)), s);
  }
}

TEST(KmerTokenizer, RejectsBadOptions) {
  EXPECT_THROW(make_kmer_tokenizer(2, 1), Error);
  EXPECT_THROW(make_kmer_tokenizer(9, 1), Error);
  expect_error([&] { make_kmer_tokenizer(6, 3); }, ExitCode::kUsage, {"stride"});
}

TEST(Tokenizer, JsonRoundTripAndEquality) {
  testing::TempDir dir;
  auto a = make_kmer_tokenizer(4, 1);
  save_tokenizer(*a, dir.file("tok.json"));
  auto b = load_tokenizer(dir.file("tok.json"));
  EXPECT_TRUE(*a == *b);
  EXPECT_FALSE(*a == *make_kmer_tokenizer(4, 4));
  EXPECT_FALSE(*a == *make_char_tokenizer());
  EXPECT_TRUE(*tokenizer_from_json(make_char_tokenizer()->to_json()) == *make_char_tokenizer());
  auto j = a->to_json();
  EXPECT_EQ(j["special_tokens"]["[MASK]"], 4);
  EXPECT_EQ(j["vocab_size"], 5 + 256);
  EXPECT_THROW(tokenizer_from_json(nlohmann::json{{"kind", "words"}}), Error);
  EXPECT_THROW(tokenizer_from_json(nlohmann::json{{"kind", "kmer"}}), Error);
}

// The Nucleotide Transformer split: non-overlapping k-mers, single bases for N and leftovers.
TEST(NtTokenizer, KmersThenSingleBases) {
  auto t = make_nt_tokenizer(3);
  EXPECT_EQ(t->kind(), "nt");
  EXPECT_EQ(t->vocab_size(), 5 + 64 + 5);
  // ACG | T N (N breaks the k-mer) | N | ACG | T T (leftovers)
  const auto ids = t->encode("ACGTNNACGTT");
  std::vector<std::string> pieces;
  for (auto id : ids) pieces.push_back(t->id_to_piece(id));
  EXPECT_EQ(pieces, (std::vector<std::string>{"ACG", "T", "N", "N", "ACG", "T", "T"}));
  EXPECT_EQ(ids[2], t->n_id());
  EXPECT_EQ(t->decode(ids), "ACGTNNACGTT");
  EXPECT_TRUE(*tokenizer_from_json(t->to_json()) == *t);
  EXPECT_FALSE(*t == *make_nt_tokenizer(6));
  EXPECT_THROW(make_nt_tokenizer(9), Error);
}

TEST(Tokenizer, RequireSameTokenizerNamesTheMismatch) {
  auto kmer = make_kmer_tokenizer(6, 1);
  EXPECT_NO_THROW(require_same_tokenizer(*kmer, kmer->to_json(), "ckpt/step_1"));
  expect_error(
      [&] { require_same_tokenizer(*kmer, make_char_tokenizer()->to_json(), "ckpt/step_1"); },
      ExitCode::kUsage, {"ckpt/step_1", "vocab 10", "vocab 4101"});
}

TEST(BpeTokenizer, TrainSaveLoadRoundTrip) {
  // A small sample with repeats so merges exist.
  std::vector<std::string> lines;
  for (int i = 0; i < 40; ++i)
    lines.push_back(testing::random_bases(300, i % 7) + "ACGTACGTTTGACA");
  auto tok = train_bpe_tokenizer(lines, 64);
  EXPECT_EQ(tok->kind(), "bpe");
  EXPECT_LE(tok->vocab_size(), 64);
  EXPECT_GT(tok->vocab_size(), 9);
  EXPECT_EQ(tok->id_to_piece(kPadId), "[PAD]");
  EXPECT_EQ(tok->id_to_piece(kMaskId), "[MASK]");
  std::string s = testing::random_bases(500, 100);
  auto ids = tok->encode(s);
  EXPECT_LT(ids.size(), s.size());  // merges make tokens longer than one base
  for (auto id : ids) {
    EXPECT_GE(id, kFirstRegularId);
    EXPECT_LT(id, tok->vocab_size());
  }
  EXPECT_EQ(tok->decode(ids), s);

  testing::TempDir dir;
  save_bpe_model(*tok, dir.file("bpe.model"));
  auto loaded = load_bpe_model(dir.file("bpe.model"));
  EXPECT_EQ(loaded->encode(s), ids);
  // JSON embeds the model.
  auto from_json = tokenizer_from_json(tok->to_json());
  EXPECT_TRUE(*from_json == *tok);
  EXPECT_EQ(from_json->encode(s), ids);
  EXPECT_TRUE(*train_bpe_tokenizer(lines, 64) == *tok);  // deterministic training
  EXPECT_THROW(train_bpe_tokenizer(lines, 6), Error);
}

}  // namespace
}  // namespace dnallm::data
