// [model]: the keys of ModelConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

void model_keys(std::vector<KeyDesc>& out) {
  SectionKeys<ModelConfig>(out, "model", &Config::model)
      .choice("arch", &ModelConfig::arch,
              "the model family (Note [Model registry]): `bert`: bidirectional transformer "
              "encoder trained as a masked LM; `gpt`: transformer decoder trained as a causal LM; "
              "`hyena`: HyenaDNA (long convolutions; `hidden` = d_model, `ffn` = d_inner), a "
              "causal LM; `caduceus` / `caduceus-ps`: Caduceus (bidirectional Mamba; `-ps` with "
              "reverse-complement parameter sharing), a masked LM")
      .choice("task", &ModelConfig::task,
              "`pretrain`: the language-model objective of `arch`; `classification` / "
              "`regression`: a sequence-level head on labelled tables (`data.label_column`)")
      .range("hidden", &ModelConfig::hidden, 1, 65536, "model width")
      .range("layers", &ModelConfig::layers, 1, 1024, "transformer blocks")
      .range("heads", &ModelConfig::heads, 1, 1024, "attention heads; `hidden` % `heads` == 0")
      .range("kv_heads", &ModelConfig::kv_heads, 0, 1024,
             "key/value heads (grouped-query attention, Llama's `num_key_value_heads`): each is "
             "shared by `heads` / `kv_heads` query heads, 1 is multi-query; `heads` % "
             "`kv_heads` == 0; 0: as many as `heads`")
      .range("ffn", &ModelConfig::ffn, 1, 1 << 20, "feed-forward inner width")
      .range("max_seq_length", &ModelConfig::max_seq_length, 4, 1 << 20,
             "tokens per sequence, [CLS]/[SEP] included")
      .choice("position", &ModelConfig::position,
              "position encoding: learned absolute embeddings, rotary (RoPE) or ALiBi (attention "
              "biases -slope * distance per head, any length; DNABERT-2)")
      .choice("mlp", &ModelConfig::mlp,
              "feed-forward: `gelu` (dense, GELU, dense) or `geglu` (GELU(gate) * up, then "
              "down; the gate and up projections without bias; DNABERT-2)")
      .key("post_layer_norm", &ModelConfig::post_layer_norm,
           "BERT's post-LN blocks (LN(x + sublayer(x))) with a LayerNorm after the embeddings, "
           "instead of pre-LN blocks with a final norm (DNABERT-1/2)")
      .choice("attn_implementation", &ModelConfig::attn_implementation,
              "attention kernel: `sdpa` (LibTorch's scaled_dot_product_attention), `eager` "
              "(explicit matmul and softmax); `auto` is `sdpa`")
      .range("dropout", &ModelConfig::dropout, 0, 0.99,
             "dropout probability (0 keeps runs deterministic)")
      .key("gradient_checkpointing", &ModelConfig::gradient_checkpointing,
           "recompute each block's activations in the backward pass instead of keeping them: "
           "less memory for about one more forward pass of compute")
      .range("chunk_positions", &ModelConfig::chunk_positions, 0, int64_t{1} << 30,
             "HyenaDNA with `gradient_checkpointing`: each block's position-wise parts this many "
             "positions at a time, forward and recompute (Note [Hyena chunked block]; 0: all at "
             "once); the same function, less memory at long lengths (docs/long-context.md)")
      .range("chunk_channels", &ModelConfig::chunk_channels, 0, int64_t{1} << 20,
             "HyenaDNA with `gradient_checkpointing`: the FFT long convolution this many channels "
             "at a time (0: all at once); with `chunk_positions`, what lets 1M tokens fit")
      .range("num_labels", &ModelConfig::num_labels, 1, 1 << 20,
             "classification classes (regression: 1)")
      .choice("pooling", &ModelConfig::pooling,
              "how classification/regression heads summarise a sequence: the first token's "
              "state, or the mean over its tokens")
      .key("init_from", &ModelConfig::init_from,
           "model directory to start from (fine-tuning): one of our exports (`[tokenizer]` must "
           "match its `tokenizer.json`, else exit 2) or a Hugging Face directory (config.json + "
           "model.safetensors + vocab.txt/tokenizer.json of a bert, esm, roberta-prelayernorm, "
           "gpt_neox or llama model; its config.json sets the architecture, `[model]` the task, "
           "heads and dropout; see [hugging-face.md](hugging-face.md))");
}

}  // namespace dnallm::config_detail
