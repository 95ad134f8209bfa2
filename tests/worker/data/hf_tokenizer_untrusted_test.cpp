// Issue 22: a downloaded tokenizer is untrusted (Note [Untrusted files], core/untrusted_file.hpp).
// Each test writes the damaged directory itself and expects exit code 2 (usage) with one line
// naming the file and what is wrong; the tokenizer files and dnallm-infer's tokenizer.json are
// read only when they are regular files of bounded size.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/process.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"

namespace dnallm::data {
namespace {

using dnallm::testing::expect_error;

namespace fs = std::filesystem;

class HfTokenizerUntrustedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = dnallm::testing::make_test_case_dir("hf_tok");
    std::ofstream(dir_ / "tokenizer_config.json")
        << R"({"tokenizer_class": "BertTokenizer", "do_lower_case": false})";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A DNABERT-style 3-mer vocabulary: the specials, then every 3-mer over ACGT.
  static std::vector<std::string> vocab() {
    std::vector<std::string> v = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
    const char* b = "ACGT";
    for (int i = 0; i < 64; ++i) v.push_back({b[i / 16], b[(i / 4) % 4], b[i % 4]});
    return v;
  }
  void write_vocab_txt(const std::vector<std::string>& v) {
    std::ofstream f(dir_ / "vocab.txt");
    for (const auto& p : v) f << p << "\n";
  }
  void write_tokenizer_json(const std::vector<std::pair<std::string, int>>& entries) {
    nlohmann::json vocab = nlohmann::json::object();
    std::string text = "{";
    for (size_t i = 0; i < entries.size(); ++i) {
      text += (i ? "," : "") + nlohmann::json(entries[i].first).dump() + ":" +
              std::to_string(entries[i].second);
    }
    text += "}";
    std::ofstream(dir_ / "tokenizer.json")
        << R"({"model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": )" << text << "}}";
  }
  // Expects HfTokenizer::load to fail with kUsage, one line holding `needle`.
  void expect_refused(const std::string& needle) {
    try {
      HfTokenizer::load(dir_.string());
      FAIL() << "accepted; expected: " << needle;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.code(), ExitCode::kUsage) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      EXPECT_LT(what.size(), 600u) << what;
    }
  }
  fs::path dir_;
};

TEST_F(HfTokenizerUntrustedTest, TheWellFormedDirectoryLoads) {
  write_vocab_txt(vocab());
  std::vector<std::pair<std::string, int>> entries;
  for (size_t i = 0; i < vocab().size(); ++i) entries.emplace_back(vocab()[i], int(i));
  write_tokenizer_json(entries);
  EXPECT_EQ(HfTokenizer::load(dir_.string()).vocab_size(), 69);
}

TEST_F(HfTokenizerUntrustedTest, ADuplicatedTokenInVocabTxt) {
  auto v = vocab();
  v.push_back("ACG");
  write_vocab_txt(v);
  expect_refused("vocab.txt: token \"ACG\" appears twice (ids 11 and 69)");
}

TEST_F(HfTokenizerUntrustedTest, TwoTokensWithOneIdInTokenizerJson) {
  std::vector<std::pair<std::string, int>> entries;
  for (size_t i = 0; i < vocab().size(); ++i) entries.emplace_back(vocab()[i], int(i));
  entries[7].second = 6;  // "AAG" takes "AAC"'s id
  write_tokenizer_json(entries);
  expect_refused("tokens \"AAC\" and \"AAG\" have the same id 6");
}

TEST_F(HfTokenizerUntrustedTest, ATokenTwiceInTokenizerJson) {
  std::vector<std::pair<std::string, int>> entries;
  for (size_t i = 0; i < vocab().size(); ++i) entries.emplace_back(vocab()[i], int(i));
  entries.emplace_back("AAA", 69);
  write_tokenizer_json(entries);
  expect_refused("key \"AAA\" appears twice");
}

TEST_F(HfTokenizerUntrustedTest, VocabTxtDisagreesWithTokenizerJson) {
  auto v = vocab();
  write_vocab_txt(v);
  std::swap(v[5], v[6]);  // AAA <-> AAC in tokenizer.json
  std::vector<std::pair<std::string, int>> entries;
  for (size_t i = 0; i < v.size(); ++i) entries.emplace_back(v[i], int(i));
  write_tokenizer_json(entries);
  expect_refused("vocab.txt and tokenizer.json disagree at id 5 (\"AAA\" vs \"AAC\"");
}

TEST_F(HfTokenizerUntrustedTest, VocabTxtLinkedToDevZero) {
  fs::create_symlink("/dev/zero", dir_ / "vocab.txt");
  expect_refused("is not a regular file (a device)");
}

TEST_F(HfTokenizerUntrustedTest, VocabTxtTooLarge) {
  { std::ofstream(dir_ / "vocab.txt") << "[PAD]\n"; }
  fs::resize_file(dir_ / "vocab.txt", kMaxTokenizerFileBytes + 1);
  expect_refused("more than the 67108864 bytes allowed");
}

TEST_F(HfTokenizerUntrustedTest, TokenizerJsonIsADirectoryOrALoop) {
  write_vocab_txt(vocab());
  fs::create_directories(dir_ / "tokenizer.json");
  expect_refused("is a directory");
  fs::remove(dir_ / "tokenizer.json");
  fs::create_symlink(dir_ / "tokenizer.json", dir_ / "tokenizer.json");
  expect_refused("symbolic link loop");
}

TEST_F(HfTokenizerUntrustedTest, AValueOfTheWrongType) {
  write_vocab_txt(vocab());
  std::ofstream(dir_ / "tokenizer_config.json") << R"({"tokenizer_class": 7})";
  expect_refused("wrong type");
}

// dnallm-infer's tokenizer.json (our own format) has the same limits.
TEST_F(HfTokenizerUntrustedTest, OurTokenizerJsonIsBoundedToo) {
  fs::create_symlink("/dev/zero", dir_ / "ours.json");
  expect_error([&] { load_tokenizer((dir_ / "ours.json").string()); }, ExitCode::kUsage,
               {"not a regular file"});
  std::ofstream(dir_ / "dup.json") << R"({"kind": "char", "kind": "bpe"})";
  expect_error([&] { load_tokenizer((dir_ / "dup.json").string()); }, ExitCode::kUsage,
               {"\"kind\" appears twice"});
}

TEST(UntrustedFile, MessagesQuoteBoundedContent) {
  const std::string big(1 << 20, 'x');
  const auto clipped = clip_for_message(big);
  EXPECT_LT(clipped.size(), 200u);
  EXPECT_NE(clipped.find("(1048576 bytes in all)"), std::string::npos);
  EXPECT_EQ(clip_for_message("a\nb"), "a?b");
  try {
    parse_json_strict("{\"k\": \"" + big, "big.json", ExitCode::kUsage);
    FAIL();
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 600u);
    EXPECT_NE(std::string(e.what()).find("big.json is not valid JSON"), std::string::npos);
  }
}

}  // namespace
}  // namespace dnallm::data
