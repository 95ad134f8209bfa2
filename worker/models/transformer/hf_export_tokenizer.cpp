// Hugging Face tokenizer files for our tokenizers (export_hf_tokenizer in hf_export.hpp).
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/durable_io.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/data/hf_tokenizer.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/models/transformer/hf_export.hpp"

namespace dnallm::models {
namespace {

using nlohmann::ordered_json;

// The Nucleotide Transformer split is EsmTokenizer's (longest vocabulary piece at each
// position; <cls> = [CLS] before, <eos> = [SEP] after): vocab.txt in our id order.
void export_esm_tokenizer(const data::Tokenizer& tok, ordered_json map, int64_t max_seq_length,
                          const std::string& dir) {
  std::ofstream vocab(dir + "/vocab.txt", std::ios::trunc);
  for (int64_t id = 0; id < tok.vocab_size(); ++id) vocab << tok.id_to_piece(id) << "\n";
  DNALLM_CHECK(vocab.good(), ExitCode::kFailure, "cannot write {}/vocab.txt", dir);
  map["eos_token"] = "[SEP]";
  checkpoint::write_json_durable(dir + "/special_tokens_map.json", map);
  ordered_json config = map;
  config["tokenizer_class"] = "EsmTokenizer";
  config["model_max_length"] = max_seq_length;
  config["padding_side"] = "right";
  config["dnallm_input"] = "the bases as they are";
  checkpoint::write_json_durable(dir + "/tokenizer_config.json", config);
}

// Our special tokens, ids 0.., as the tokenizers library lists them.
ordered_json added_tokens() {
  const auto& names = data::special_token_names();
  ordered_json added = ordered_json::array();
  for (size_t id = 0; id < names.size(); ++id) {
    added.push_back({{"id", id},
                     {"content", names[id]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  return added;
}

// [CLS] sequence (then [SEP] for encoders); pairs (not used by our objectives) as BERT frames
// them: single, then B and [SEP].
ordered_json post_processor(Arch arch) {
  auto special = [](const char* name) {
    return ordered_json{{"SpecialToken", {{"id", name}, {"type_id", 0}}}};
  };
  ordered_json single = ordered_json::array({special("[CLS]")});
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  ordered_json specials = {
      {"[CLS]", {{"id", "[CLS]"}, {"ids", {data::kClsId}}, {"tokens", {"[CLS]"}}}}};
  if (arch == Arch::kBert) {
    single.push_back(special("[SEP]"));
    specials["[SEP]"] = {{"id", "[SEP]"}, {"ids", {data::kSepId}}, {"tokens", {"[SEP]"}}};
  }
  ordered_json pair = single;
  pair.push_back({{"Sequence", {{"id", "B"}, {"type_id", 1}}}});
  if (arch == Arch::kBert) pair.push_back({{"SpecialToken", {{"id", "[SEP]"}, {"type_id", 1}}}});
  return {{"type", "TemplateProcessing"},
          {"single", single},
          {"pair", pair},
          {"special_tokens", specials}};
}

// tokenizer.json: a WordLevel model over our vocabulary, split per base (char) or on spaces
// (k-mers, DNABERT's input convention).
ordered_json word_level_tokenizer(const data::Tokenizer& tok, Arch arch, bool kmer) {
  ordered_json vocab = ordered_json::object();
  for (int64_t id = 0; id < tok.vocab_size(); ++id) vocab[tok.id_to_piece(id)] = id;
  ordered_json tj;
  tj["version"] = "1.0";
  tj["truncation"] = nullptr;
  tj["padding"] = nullptr;
  tj["added_tokens"] = added_tokens();
  tj["normalizer"] = nullptr;
  if (kmer) {
    tj["pre_tokenizer"] = {{"type", "WhitespaceSplit"}};
  } else {
    tj["pre_tokenizer"] = {{"type", "Split"},
                           {"pattern", {{"String", ""}}},
                           {"behavior", "Isolated"},
                           {"invert", false}};
  }
  tj["post_processor"] = post_processor(arch);
  tj["decoder"] = nullptr;
  tj["model"] = {{"type", "WordLevel"}, {"vocab", vocab}, {"unk_token", "[UNK]"}};
  return tj;
}

// tokenizer.kind = "hf": the directory's own BPE tokenizer.json (embedded in to_json()), its
// ids renamed to ours (Note [Hugging Face BPE in our id layout]): our vocabulary, our special
// tokens and framing, its normalizer, pre-tokenizer and merges. Read back by our reader (the
// one tests/hf/check_bpe.py holds to the tokenizers library) before it is written.
ordered_json hf_bpe_tokenizer(const data::Tokenizer& tok, Arch arch) {
  const auto theirs = ordered_json::parse(tok.to_json().at("hf_tokenizer_json").get<std::string>());
  ordered_json vocab = ordered_json::object();
  for (int64_t id = 0; id < tok.vocab_size(); ++id) vocab[tok.id_to_piece(id)] = id;
  ordered_json model = theirs.at("model");
  model["vocab"] = vocab;
  if (!model.value("unk_token", ordered_json()).is_null()) model["unk_token"] = "[UNK]";
  ordered_json tj;
  tj["version"] = "1.0";
  tj["truncation"] = nullptr;
  tj["padding"] = nullptr;
  tj["added_tokens"] = added_tokens();
  tj["normalizer"] = theirs.value("normalizer", ordered_json());
  tj["pre_tokenizer"] = theirs.value("pre_tokenizer", ordered_json());
  tj["post_processor"] = post_processor(arch);
  tj["decoder"] = nullptr;
  tj["model"] = model;
  const auto back =
      data::HfTokenizer::from_bpe_json(nlohmann::json::object(), nlohmann::json(tj), "export");
  const auto probe = std::string("ACGTNACGTTGCAAAAATTTTGGGGCCCCACGT");
  auto ids = back.encode_unframed(probe);
  DNALLM_CHECK(ids == tok.encode(probe), ExitCode::kFailure,
               "the exported BPE tokenizer.json does not encode as the run's tokenizer: a bug");
  return tj;
}

}  // namespace

void export_hf_tokenizer(const data::Tokenizer& tok, Arch arch, int64_t max_seq_length,
                         const std::string& dir) {
  std::filesystem::create_directories(dir);
  ordered_json map = {{"unk_token", "[UNK]"},
                      {"pad_token", "[PAD]"},
                      {"cls_token", "[CLS]"},
                      {"sep_token", "[SEP]"},
                      {"mask_token", "[MASK]"}};
  if (tok.tokenizer_kind() == cfg::TokenizerKind::kNt && arch == Arch::kBert)
    return export_esm_tokenizer(tok, map, max_seq_length, dir);
  const bool kmer = tok.tokenizer_kind() == cfg::TokenizerKind::kKmer;
  const bool bpe = tok.tokenizer_kind() == cfg::TokenizerKind::kHf;
  auto summary = tok.to_json();
  summary.erase("hf_tokenizer_json");  // kind "hf" embeds its files
  summary.erase("hf_tokenizer_config");
  DNALLM_CHECK(tok.tokenizer_kind() == cfg::TokenizerKind::kChar || bpe ||
                   (kmer && tok.to_json().value("stride", 0) == 1 && arch == Arch::kBert),
               ExitCode::kUsage,
               "the tokenizer {} has no Hugging Face export yet: supported are kind = \"char\", "
               "\"hf\", and for encoders overlapping k-mers (stride 1) and \"nt\"",
               clip_for_message(summary.dump()));
  checkpoint::write_json_durable(
      dir + "/tokenizer.json",
      bpe ? hf_bpe_tokenizer(tok, arch) : word_level_tokenizer(tok, arch, kmer));
  if (arch == Arch::kGpt) map["bos_token"] = "[CLS]";
  checkpoint::write_json_durable(dir + "/special_tokens_map.json", map);
  ordered_json config = map;
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  config["model_max_length"] = max_seq_length;
  config["padding_side"] = "right";
  if (kmer) {
    config["do_lower_case"] = false;
    // DNABERT's convention: the input string is the overlapping k-mers separated by spaces.
    config["dnallm_input"] =
        "overlapping " + std::to_string(tok.to_json().value("k", 0)) + "-mers separated by spaces";
  } else {
    config["dnallm_input"] = bpe ? "the bases, upper case (BPE)" : "the bases as they are";
  }
  checkpoint::write_json_durable(dir + "/tokenizer_config.json", config);
}

}  // namespace dnallm::models
