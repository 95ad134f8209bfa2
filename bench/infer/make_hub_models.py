#!/usr/bin/env python3
"""Writes two Hugging Face directories, as save_pretrained() writes a download, for the
published-model benchmarks (bench/infer/bench_variants.sh): OUT/causal, a Llama causal LM with
one token a base, and OUT/masked, an ESM masked LM with the Nucleotide Transformer's 6-mer
vocabulary (the tokenizer files of tests/data/hf-fixtures' llama_causal and esm_mlm); both
hidden 256, 4 layers, 4 heads, 1,026 positions, random weights (seed 0).
  make_hub_models.py OUT"""
import os
import shutil
import sys

import torch
from transformers import EsmConfig, EsmForMaskedLM, LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
fixtures = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "hf-fixtures")
torch.manual_seed(0)
causal = LlamaForCausalLM(LlamaConfig(
    vocab_size=9, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1026, pad_token_id=0,
    bos_token_id=2, eos_token_id=3, tie_word_embeddings=False))
causal.save_pretrained(os.path.join(out, "causal"))
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(fixtures, "llama_causal", f), os.path.join(out, "causal", f))
masked = EsmForMaskedLM(EsmConfig(
    vocab_size=4107, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, max_position_embeddings=1026, position_embedding_type="rotary",
    pad_token_id=1, mask_token_id=2, token_dropout=False, emb_layer_norm_before=False))
masked.save_pretrained(os.path.join(out, "masked"))
for f in ("vocab.txt", "tokenizer_config.json"):
    shutil.copy(os.path.join(fixtures, "esm_mlm", f), os.path.join(out, "masked", f))
