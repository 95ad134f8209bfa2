#include "worker/data/objectives.hpp"

#include <initializer_list>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"

namespace dnallm::data {
namespace {

// One sample a length: `len` random bases (seed `len`), sample id `len`, class `len % 2` (read
// by classification only), each encoded by the character tokenizer with SampleRng(1).
std::vector<EncodedSample> encode_lengths(const ObjectiveOptions& o,
                                          std::initializer_list<int> lengths) {
  const auto tok = make_char_tokenizer();
  std::vector<EncodedSample> enc;
  for (int len : lengths) {
    Sample s{testing::random_bases(len, len)};
    s.label = len % 2;
    SampleRng rng(1);
    enc.push_back(encode_sample(s, len, *tok, o, rng));
  }
  return enc;
}

TEST(Objectives, MaskedLmRatesAndSpecialsNeverMasked) {
  auto tok = make_char_tokenizer();
  ObjectiveOptions o;
  o.max_seq_length = 512;
  Sample s{testing::random_bases(510, 1)};
  int64_t selected = 0, masked = 0, unchanged = 0, total = 0;
  for (uint64_t i = 0; i < 200; ++i) {
    SampleRng rng(42, 0, i, 1);
    auto e = encode_sample(s, i, *tok, o, rng);
    ASSERT_EQ(e.input_ids.size(), 512u);
    EXPECT_EQ(e.input_ids.front(), kClsId);
    EXPECT_EQ(e.input_ids.back(), kSepId);
    EXPECT_EQ(e.labels.front(), kIgnoreIndex);
    EXPECT_EQ(e.labels.back(), kIgnoreIndex);
    auto orig = tok->encode(s.bases);
    for (size_t k = 1; k + 1 < e.input_ids.size(); ++k) {
      ++total;
      if (e.labels[k] == kIgnoreIndex) {
        EXPECT_EQ(e.input_ids[k], orig[k - 1]);
        continue;
      }
      ++selected;
      EXPECT_EQ(e.labels[k], orig[k - 1]);
      if (e.input_ids[k] == kMaskId)
        ++masked;
      else if (e.input_ids[k] == orig[k - 1])
        ++unchanged;
      EXPECT_GE(e.input_ids[k], kFirstRegularId - 1);
    }
  }
  double rate = static_cast<double>(selected) / total;
  EXPECT_NEAR(rate, 0.15, 0.01);
  EXPECT_NEAR(static_cast<double>(masked) / selected, 0.8, 0.02);
  // "unchanged" holds the 10% kept plus random replacements that drew the same base (1/5).
  EXPECT_NEAR(static_cast<double>(unchanged) / selected, 0.1 + 0.1 / 5, 0.02);
}

TEST(Objectives, NTokensNeverMaskedNorScored) {
  auto tok = make_char_tokenizer();
  ObjectiveOptions o;
  o.max_seq_length = 64;
  o.mlm_probability = 1.0;
  Sample s{std::string(62, 'N')};
  SampleRng rng(1);
  auto e = encode_sample(s, 0, *tok, o, rng);
  for (auto l : e.labels) EXPECT_EQ(l, kIgnoreIndex);
  o.objective = Objective::kCausalLm;
  auto c = encode_sample(s, 0, *tok, o, rng);
  for (auto l : c.labels) EXPECT_EQ(l, kIgnoreIndex);
}

TEST(Objectives, CausalLabelsEqualInputsUnshifted) {
  auto tok = make_char_tokenizer();
  ObjectiveOptions o;
  o.objective = Objective::kCausalLm;
  o.max_seq_length = 16;
  Sample s{testing::random_bases(40, 2)};
  SampleRng rng(1);
  auto e = encode_sample(s, 0, *tok, o, rng);
  ASSERT_EQ(e.input_ids.size(), 16u);  // [CLS] + 15 tokens, truncated
  EXPECT_EQ(e.labels[0], kIgnoreIndex);
  for (size_t k = 1; k < 16; ++k) EXPECT_EQ(e.labels[k], e.input_ids[k]);
  auto b = collate({e}, o);
  EXPECT_EQ(b.num_label_tokens, 15);
  EXPECT_EQ(b.num_bases, 15);
}

TEST(Objectives, PaddingAndAttentionMask) {
  ObjectiveOptions o;
  o.objective = Objective::kClassification;
  o.max_seq_length = 32;
  auto enc = encode_lengths(o, {5, 10, 3});
  auto b = collate(enc, o);
  EXPECT_EQ(b.rows, 3);
  EXPECT_EQ(b.seq_len, 12);
  EXPECT_EQ(b.labels, (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(b.input_ids.size(), 36u);
  EXPECT_EQ(b.attention_mask[0 * 12 + 6], 1);
  EXPECT_EQ(b.attention_mask[0 * 12 + 7], 0);
  EXPECT_EQ(b.input_ids[0 * 12 + 7], kPadId);
  EXPECT_EQ(b.input_ids[1 * 12 + 11], kSepId);
  EXPECT_TRUE(b.segment_ids.empty());
  EXPECT_EQ(b.sample_ids, (std::vector<uint64_t>{5, 10, 3}));
  EXPECT_EQ(b.num_bases, 18);
  EXPECT_EQ(b.num_label_tokens, 3);
  o.objective = Objective::kRegression;
  for (auto& e : enc) e.target = 0.25F;
  auto r = collate(enc, o);
  EXPECT_TRUE(r.labels.empty());
  EXPECT_EQ(r.targets, (std::vector<float>{0.25F, 0.25F, 0.25F}));
  EXPECT_EQ(r.num_label_tokens, 3);
}

TEST(Objectives, PackingKeepsDocumentsApart) {
  ObjectiveOptions o;
  o.objective = Objective::kCausalLm;
  o.max_seq_length = 20;
  o.packing = true;
  auto enc = encode_lengths(o, {8, 6, 9, 3});  // framed lengths 9, 7, 10, 4
  auto b = collate(enc, o);
  ASSERT_EQ(b.rows, 2);  // [9 + 7] [10 + 4]
  EXPECT_EQ(b.seq_len, 20);
  std::vector<int64_t> row0(b.segment_ids.begin(), b.segment_ids.begin() + 20);
  std::vector<int64_t> expect0(20, 0);
  std::fill(expect0.begin(), expect0.begin() + 9, 1);
  std::fill(expect0.begin() + 9, expect0.begin() + 16, 2);
  EXPECT_EQ(row0, expect0);
  EXPECT_EQ(b.input_ids[9], kClsId);  // second document starts with its own [CLS]
  EXPECT_EQ(b.labels[9], kIgnoreIndex);
  EXPECT_EQ(b.sample_ids.size(), 4u);
  EXPECT_EQ(b.num_label_tokens, 8 + 6 + 9 + 3);
  o.objective = Objective::kClassification;
  EXPECT_THROW(collate(enc, o), Error);
}

TEST(Objectives, FromConfigNames) {
  EXPECT_EQ(objective_from(cfg::Arch::kBert, cfg::Task::kPretrain), Objective::kMaskedLm);
  EXPECT_EQ(objective_from(cfg::Arch::kGpt, cfg::Task::kPretrain), Objective::kCausalLm);
  EXPECT_EQ(objective_from(cfg::Arch::kGpt, cfg::Task::kRegression), Objective::kRegression);
  EXPECT_EQ(objective_from(cfg::Arch::kBert, cfg::Task::kClassification),
            Objective::kClassification);
}

}  // namespace
}  // namespace dnallm::data
