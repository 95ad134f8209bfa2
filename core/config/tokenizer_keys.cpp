// [tokenizer]: the keys of TokenizerConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

void tokenizer_keys(std::vector<KeyDesc>& out) {
  SectionKeys<TokenizerConfig>(out, "tokenizer", &Config::tokenizer)
      .choice("kind", &TokenizerConfig::kind,
              "`char`: one token per base; `kmer`: k-mers every `stride` bases; `nt`: the "
              "Nucleotide Transformer split (EsmTokenizer's): non-overlapping k-mers, single "
              "bases for N and leftovers; `bpe`: byte-pair encoding trained on the data; `hf`: "
              "a Hugging Face directory's BPE tokenizer.json as it is (DNABERT-2: "
              "`tokenizer.path`, else `model.init_from`)")
      .range("k", &TokenizerConfig::k, 3, 8, "k-mer length")
      .range("stride", &TokenizerConfig::stride, 1, 8,
             "k-mer stride: 1 overlapping, k non-overlapping")
      .range("vocab_size", &TokenizerConfig::vocab_size, 16, 1 << 20,
             "bpe: vocabulary size to train")
      .key("path", &TokenizerConfig::path,
           "bpe: model file to load, or where to save a trained one; hf: the model directory");
}

}  // namespace dnallm::config_detail
