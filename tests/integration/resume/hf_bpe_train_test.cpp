// tokenizer.kind = "hf" end to end (Note [Hugging Face BPE in our id layout]): dnallm-train
// with a DNABERT-2-style BPE tokenizer.json directory trains, checkpoints, resumes under the
// same tokenizer (require_same_tokenizer on the embedded files), dnallm-infer embeds with
// the final/ export alone (the directory removed: the files travel in final/tokenizer.json),
// and final/hf's tokenizer.json (BPE in our id layout) encodes as the run's tokenizer.
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../ddp/test_util.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"

namespace dnallm::testing {
namespace {

// DNABERT-2's layout: [UNK] [CLS] [SEP] [PAD] [MASK], A C G T, the 16 dinucleotides merged
// first, then a few 4-mers; Whitespace pre-tokenizer, [CLS] $A [SEP].
size_t write_dnabert2_style(const std::string& dir) {  // returns the vocabulary size
  std::filesystem::create_directories(dir);
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (const char* s : {"[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"}) {
    added.push_back({{"id", vocab.size()}, {"content", s}, {"special", true}});
    vocab[s] = vocab.size();
  }
  for (const char* b : {"A", "C", "G", "T"}) vocab[b] = vocab.size();
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  for (const char* a : {"A", "C", "G", "T"}) {
    for (const char* b : {"A", "C", "G", "T"}) {
      merges.push_back(std::string(a) + " " + b);
      vocab[std::string(a) + b] = vocab.size();
    }
  }
  for (const char* m : {"AA TT", "GC GC", "TA TA", "CA GG"}) {
    const std::string s(m);
    merges.push_back(s);
    vocab[s.substr(0, 2) + s.substr(3)] = vocab.size();
  }
  nlohmann::ordered_json tj = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "Whitespace"}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "[CLS]"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"SpecialToken", {{"id", "[SEP]"}, {"type_id", 0}}}}}},
        {"special_tokens",
         {{"[CLS]", {{"id", "[CLS]"}, {"ids", {1}}, {"tokens", {"[CLS]"}}}},
          {"[SEP]", {{"id", "[SEP]"}, {"ids", {2}}, {"tokens", {"[SEP]"}}}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", "[UNK]"},
        {"fuse_unk", false},
        {"vocab", vocab},
        {"merges", merges}}}};
  std::ofstream(dir + "/tokenizer.json") << tj.dump(1);
  std::ofstream(dir + "/tokenizer_config.json")
      << R"({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]",
            "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"})";
  return vocab.size();
}

TEST(HfBpeTokenizer, TrainsResumesAndInfersWithADnabert2StyleDirectory) {
  const std::string dir = make_temp_dir("hf_bpe_train");
  const size_t vocab_size = write_dnabert2_style(dir + "/tok");
  auto train = [&](int steps, std::string* log) {
    return run_command(
        fmt::format("cd {src} && {bin}dnallm-train --set model.hidden=32 --set model.layers=2 "
                    "--set model.heads=2 --set model.ffn=64 --set model.max_seq_length=64 "
                    "--set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
                    "--set tokenizer.kind=hf --set tokenizer.path={dir}/tok "
                    "--set training.max_steps={steps} --set training.micro_batch_size=4 "
                    "--set checkpoint.save_steps=2 --set checkpoint.dir={dir}/ck "
                    "--set checkpoint.save_final=true 2>&1",
                    fmt::arg("src", kSrc), fmt::arg("bin", kBin), fmt::arg("dir", dir),
                    fmt::arg("steps", steps)),
        log);
  };
  std::string log;
  ASSERT_EQ(train(2, &log), 0) << log;
  ASSERT_EQ(train(4, &log), 0) << log;
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  std::ifstream in(dir + "/ck/final/tokenizer.json");
  const auto saved = nlohmann::json::parse(in);
  EXPECT_EQ(saved.at("kind"), "hf");
  EXPECT_EQ(saved.at("vocab_size").get<size_t>(), vocab_size);  // the same five specials
  std::filesystem::remove_all(dir + "/tok");
  std::ofstream(dir + "/in.fa") << ">a\nACGTAATTGCGCNNTATAcagg\n>b\nGGGCGCATTACGAT\n";
  ASSERT_EQ(run_command(fmt::format("{}dnallm-infer embed --device cpu --model {}/ck/final "
                                    "--input {}/in.fa --out {}/emb.npy 2>&1",
                                    kBin, dir, dir, dir),
                        &log),
            0)
      << log;
  EXPECT_TRUE(std::filesystem::exists(dir + "/emb.npy"));

  // final/hf: transformers' layout; its BPE tokenizer.json gives the run's ids.
  const auto ours = data::load_tokenizer(dir + "/ck/final/tokenizer.json");
  const auto exported = data::HfTokenizer::load(dir + "/ck/final/hf");
  EXPECT_EQ(exported.scheme(), data::HfTokenizer::Scheme::kBpe);
  EXPECT_EQ(exported.special().pad, data::kPadId);
  std::mt19937_64 rng(5);
  for (int i = 0; i < 100; ++i) {
    std::string s;
    for (size_t n = 1 + rng() % 500; n > 0; --n) s += "ACGTN"[rng() % 5];
    auto framed = ours->encode(s);
    framed.insert(framed.begin(), data::kClsId);
    framed.push_back(data::kSepId);
    ASSERT_EQ(exported.encode(s), framed) << s;
  }
}

}  // namespace
}  // namespace dnallm::testing
