#!/usr/bin/env python3
"""Regenerate the golden Hugging Face fixtures (tests/data/hf-fixtures) from transformers
itself: for each family a tiny randomly initialised model in the layout DNA-LM users
download (config.json + model.safetensors, the tokenizer files as the family ships them),
fixture.json (the sequences, the strings given to the tokenizer, the ids it produced) and
expected.safetensors (input_ids, attention_mask int64 [3, T]; logits float32, which
transformers computes in fp32 on CPU with dropout off; bert_cls_lora also merged_logits, after
merge_and_unload). The families and what they stand for: tests/data/hf-fixtures/README.md.

  python tests/hf/make_fixtures.py --out /tmp/fixtures [--family bert_mlm ...] [--seed 0]
      [--nt-v2-code DIR] [--dnabert2-ref DIR]

The Nucleotide Transformer v2 families (esm_v2_mlm, esm_v2_cls) are made by InstaDeepAI's own
remote code (esm_config.py and modeling_esm.py of a nucleotide-transformer-v2 Hugging Face
repository, in DIR or $DNALLM_NT_V2_CODE); without it they are skipped with a message.

The weights are random (seeded per family, so one family regenerates the same without the
others) and, unlike a fresh transformers model, every parameter is perturbed: biases and
LayerNorm gains are then not 0 and 1, so an import that maps one of them wrongly shows. A
regenerated set therefore differs from the committed one; both must pass our C++ import test
(DNALLM_HF_FIXTURES_DIR=OUT build/tests/worker/worker_hf_import_test). Needs torch,
transformers, tokenizers, peft and safetensors (scripts/install-deps.sh).

DNABERT-2 (dnabert2_mlm, dnabert2_cls, dnabert2_long_mlm: inputs longer than its
max_position_embeddings) runs its own remote code, which is not in this repository: with
--dnabert2-ref DIR (or DNALLM_DNABERT2_REF) the reference's fp32 CPU logits are made with it
(tests/hf/dnabert2_reference.py says which shims it gets and needs einops); without, these
families are skipped with a message. Their folders hold what a download holds except the .py
files (config.json with auto_map, model.safetensors, tokenizer.json of a real BPE model in
DNABERT-2's layout, tokenizer_config.json).
"""
import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile

import dnabert2_reference
from hf_common import (NT_V2_AUTO_MAP, SEQS, auto_model_class, import_nt_v2, import_peers,
                       max_abs_diff, nt_v2_code_dir, nt_v2_model_class, overlapping_kmers)

DNABERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NT_SPECIALS = ["<unk>", "<pad>", "<mask>", "<cls>", "<eos>", "<bos>"]
CHAR_VOCAB = ["<pad>", "<unk>", "<bos>", "<eos>", "A", "C", "G", "T", "N"]
# Small enough to run in a second on a CPU, big enough for two heads and two layers.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)


def all_kmers(k):
    return ["".join(p) for p in itertools.product("ACGT", repeat=k)]


class Fixture:
    """What one family's builder returns: the model, its tokenizer, the tokenizer's inputs
    and a note for fixture.json."""

    def __init__(self, model, tokenizer, inputs, note):
        self.model, self.tokenizer, self.inputs, self.note = model, tokenizer, inputs, note


# DNABERT-2's tokenizer layout (MAGICS-LAB/DNABERT_2 issue 74, its training script): a
# tokenizers BPE model with unk [UNK], trained with these special tokens first (ids 0..4, so
# [PAD] = 3), the Whitespace pre-tokenizer, no normalizer, and [CLS] $A [SEP] framing.
DNABERT2_SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
# DNABERT-2-117M's config.json keys (sizes shrunk by each family; alibi_starting_size small so
# that the fixture sequences run past it and the reference rebuilds its table).
DNABERT2_CONFIG = {
    "_name_or_path": "zhihan1996/DNABERT-2-117M", "alibi_starting_size": 16,
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.0,
    "auto_map": {"AutoConfig": "configuration_bert.BertConfig",
                 "AutoModel": "bert_layers.BertModel",
                 "AutoModelForMaskedLM": "bert_layers.BertForMaskedLM",
                 "AutoModelForSequenceClassification":
                     "bert_layers.BertForSequenceClassification"},
    "classifier_dropout": None, "gradient_checkpointing": False, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512, "model_type": "bert", "position_embedding_type": "absolute",
    "torch_dtype": "float32", "transformers_version": "4.28.0", "type_vocab_size": 2,
    "use_cache": True}


# dnabert2_long_mlm's sequences: the start of E. coli lacZ (88 bases), the lac promoter and
# operator with one N (74 bases), a short one (16 bases, padding); the first two tokenize to
# more than 16 tokens.
DNABERT2_LONG_SEQS = [
    "ATGACCATGATTACGGATTCACTGGCCGTCGTTTTACAACGTCGTGACTGGGAAAACCCTGGCGTTACCCAACTTAATCGCCTTGCAG",
    "TTTACACTTTATGCTTCCGGCTCGTATGTTGTGTGGAATTGTGAGCGGATAACAATTTCACACAGGAANCAGCT",
    "GGGCGCATTACGATCC"]


class Maker:
    def __init__(self, out, seed, dnabert2_ref=None, nt_v2_code=None):
        self.out, self.seed, self.dnabert2_ref = out, seed, dnabert2_ref
        self.nt_v2 = None  # the remote code's modeling_esm module, when given
        self.torch, self.transformers = import_peers("tokenizers")
        import peft
        self.peft = peft
        self.transformers.logging.set_verbosity_error()
        if nt_v2_code:
            self.nt_v2 = import_nt_v2(nt_v2_code)

    # -- tokenizers, as each family ships them ---------------------------------------------

    def dnabert_tokenizer(self, folder, k):
        """BertTokenizer over [PAD] [UNK] [CLS] [SEP] [MASK] + every k-mer, with vocab.txt
        (what DNABERT ships; save_pretrained writes only tokenizer.json)."""
        vocab = DNABERT_SPECIALS + all_kmers(k)
        with open(os.path.join(folder, "vocab.txt"), "w") as f:
            f.write("\n".join(vocab) + "\n")
        tok = self.transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)},
                                              do_lower_case=False)
        assert len(tok) == len(vocab), (len(tok), len(vocab))
        return tok

    def nt_tokenizer(self, folder, k):
        """EsmTokenizer over the specials + every k-mer + single bases (Nucleotide
        Transformer: non-overlapping k-mers, single bases for N and leftovers)."""
        vocab = NT_SPECIALS + all_kmers(k) + ["A", "T", "C", "G", "N"]
        path = os.path.join(folder, "vocab.txt")
        with open(path, "w") as f:
            f.write("\n".join(vocab) + "\n")
        tok = self.transformers.EsmTokenizer(vocab_file=path)
        assert len(tok) == len(vocab), (len(tok), len(vocab))
        return tok

    def char_tokenizer(self):
        """A tokenizers WordLevel tokenizer, one token a base, no special tokens added."""
        from tokenizers import Tokenizer, models, pre_tokenizers
        tk = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(CHAR_VOCAB)},
                                        unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
        return self.transformers.PreTrainedTokenizerFast(
            tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>",
            eos_token="<eos>")

    # -- the families ------------------------------------------------------------------------

    def dnabert(self, folder, head, **config):
        tok = self.dnabert_tokenizer(folder, 3)
        cfg = self.transformers.BertConfig(vocab_size=len(tok), hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0, **TINY, **config)
        return Fixture(head(cfg), tok, [overlapping_kmers(s, 3) for s in SEQS],
                       "DNABERT-1 style: post-LN BERT, overlapping 3-mers written "
                       "space-separated, vocab.txt")

    def nucleotide_transformer(self, folder, head, **config):
        tok = self.nt_tokenizer(folder, 6)
        cfg = self.transformers.EsmConfig(
            vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64,
            position_embedding_type=config.pop("position_embedding_type", "rotary"),
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, token_dropout=False,
            emb_layer_norm_before=False, pad_token_id=tok.pad_token_id,
            mask_token_id=tok.mask_token_id, **config)
        return Fixture(head(cfg), tok, list(SEQS),
                       "Nucleotide Transformer style: ESM (pre-LN, rotary), non-overlapping "
                       "6-mers, single bases for N and leftovers, as EsmTokenizer splits them")

    def bert_mlm(self, folder):
        return self.dnabert(folder, self.transformers.BertForMaskedLM)

    def bert_cls(self, folder):
        return self.dnabert(folder, self.transformers.BertForSequenceClassification, num_labels=2)

    def esm_mlm(self, folder):
        return self.nucleotide_transformer(folder, self.transformers.EsmForMaskedLM)

    def esm_v1_mlm(self, folder):
        """Nucleotide Transformer v1: transformers' ESM with learned positions, which it
        numbers from the pad id (1) + 1."""
        fx = self.nucleotide_transformer(folder, self.transformers.EsmForMaskedLM,
                                         position_embedding_type="absolute")
        fx.note = ("Nucleotide Transformer v1 style: ESM (pre-LN) with learned positions "
                   "numbered from pad_token_id (1) + 1, EsmTokenizer 6-mers")
        return fx

    def esm_cls(self, folder):
        return self.nucleotide_transformer(folder, self.transformers.EsmForSequenceClassification,
                                           num_labels=3)

    def gptneox_causal(self, folder):
        tok = self.char_tokenizer()
        cfg = self.transformers.GPTNeoXConfig(
            vocab_size=len(tok), rotary_pct=1.0, use_parallel_residual=False, hidden_dropout=0.0,
            attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **TINY)
        return Fixture(self.transformers.GPTNeoXForCausalLM(cfg), tok, list(SEQS),
                       "causal, single-nucleotide tokens (tokenizers WordLevel), rotary, "
                       "sequential residual, untied head")

    def llama_causal(self, folder):
        tok = self.char_tokenizer()
        cfg = self.transformers.LlamaConfig(
            vocab_size=len(tok), num_key_value_heads=2, pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **TINY)
        return Fixture(self.transformers.LlamaForCausalLM(cfg), tok, list(SEQS),
                       "causal, single-nucleotide tokens, RMSNorm, SwiGLU, rotary")

    def nucleotide_transformer_v2(self, folder, head, **config):
        """NT-v2 / AgroNT: the remote EsmConfig with a gated (SwiGLU) feed-forward without
        biases, rotary positions, an untied LM head, no dropout; pad id 1, as the hub's."""
        tok = self.nt_tokenizer(folder, 6)
        import nt_v2_remote.esm_config as esm_config
        cfg = esm_config.EsmConfig(
            vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64, position_embedding_type="rotary",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, token_dropout=False,
            emb_layer_norm_before=False, add_bias_fnn=False, tie_word_embeddings=False,
            pad_token_id=tok.pad_token_id, mask_token_id=tok.mask_token_id, **config)
        return Fixture(head(cfg), tok, list(SEQS),
                       "Nucleotide Transformer v2 (remote code esm_config.EsmConfig / "
                       "modeling_esm): ESM with rotary positions, SwiGLU without biases "
                       "(add_bias_fnn false), untied LM head; EsmTokenizer 6-mers")

    def esm_v2_mlm(self, folder):
        return self.nucleotide_transformer_v2(folder, self.nt_v2.EsmForMaskedLM)

    def esm_v2_cls(self, folder):
        return self.nucleotide_transformer_v2(folder, self.nt_v2.EsmForSequenceClassification,
                                              num_labels=3)

    NT_V2_FAMILIES = ("esm_v2_mlm", "esm_v2_cls")

    def llama_grouped(self, kv_heads, what):
        tok = self.char_tokenizer()
        cfg = self.transformers.LlamaConfig(
            vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, **dict(TINY, num_attention_heads=4),
            num_key_value_heads=kv_heads)
        return Fixture(self.transformers.LlamaForCausalLM(cfg), tok, list(SEQS),
                       f"as llama_causal with {what}: 4 query heads, {kv_heads} key/value "
                       f"head(s) (num_key_value_heads)")

    def llama_gqa_causal(self, folder):
        return self.llama_grouped(2, "grouped-query attention")

    def llama_rope500k_gqa_causal(self, folder):
        """Llama 3's rotary base (rope_theta 500000) with grouped-query attention."""
        tok = self.char_tokenizer()
        cfg = self.transformers.LlamaConfig(
            vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, **dict(TINY, num_attention_heads=4),
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        model = self.transformers.LlamaForCausalLM(cfg)
        self.expect_inv_freq(model.model.rotary_emb.inv_freq, 500000.0, 8)
        return Fixture(model, tok, list(SEQS),
                       "as llama_gqa_causal (4 query heads, 2 key/value heads) with Llama 3's "
                       "rotary base: rope_parameters.rope_theta 500000")

    def gptneox_pythia_causal(self, folder):
        """Pythia's GPT-NeoX: rotary on the first quarter of each head (rotary_pct 0.25: 4 of
        16 channels) and the parallel residual x + attn(ln1(x)) + mlp(ln2(x))."""
        tok = self.char_tokenizer()
        cfg = self.transformers.GPTNeoXConfig(
            vocab_size=len(tok), rotary_pct=0.25, rotary_emb_base=10000,
            use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0,
            tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **TINY)
        model = self.transformers.GPTNeoXForCausalLM(cfg)
        layer = model.gpt_neox.layers[0]
        assert layer.use_parallel_residual and layer.attention.rotary_ndims == 4, (
            layer.use_parallel_residual, layer.attention.rotary_ndims)
        self.expect_inv_freq(model.gpt_neox.rotary_emb.inv_freq, 10000.0, 4)
        return Fixture(model, tok, list(SEQS),
                       "Pythia style: causal, single-nucleotide tokens, rotary on the first 4 of "
                       "each head's 16 channels (rotary_pct 0.25), parallel residual "
                       "(use_parallel_residual), untied head")

    def expect_inv_freq(self, inv_freq, theta, dims):
        """The reference's rotary frequencies are base `theta` over `dims` channels."""
        torch = self.torch
        want = 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims))
        assert inv_freq.shape == want.shape and torch.allclose(
            inv_freq.double(), want, rtol=1e-6, atol=0), (inv_freq, want)

    def llama_mqa_causal(self, folder):
        return self.llama_grouped(1, "multi-query attention")

    def roberta_prelayernorm_mlm(self, folder):
        tok = self.dnabert_tokenizer(folder, 3)
        # RoBERTa numbers positions from pad_token_id + 1: two more rows than tokens.
        cfg = self.transformers.RobertaPreLayerNormConfig(
            vocab_size=len(tok), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=0, type_vocab_size=1, **dict(TINY, max_position_embeddings=66))
        return Fixture(self.transformers.RobertaPreLayerNormForMaskedLM(cfg), tok,
                       [overlapping_kmers(s, 3) for s in SEQS],
                       "pre-LN encoder with learned positions (RoBERTa numbering: position ids "
                       "start at pad_token_id + 1)")

    FAMILIES = ["bert_mlm", "bert_cls", "esm_mlm", "esm_cls", "gptneox_causal", "llama_causal",
                "roberta_prelayernorm_mlm", "bert_cls_lora", "llama_gqa_causal",
                "llama_mqa_causal", "esm_v2_mlm", "esm_v2_cls", "esm_v1_mlm", "dnabert2_mlm",
                "dnabert2_cls", "dnabert2_long_mlm", "llama_rope500k_gqa_causal",
                "gptneox_pythia_causal"]
    # Family i is seeded with seed + i; the dnabert2 families keep the places 8 and 9 they were
    # made with (their fixtures predate the llama_gqa_causal .. esm_v1_mlm families);
    # dnabert2_long_mlm its place (15), llama_rope500k_gqa_causal and gptneox_pythia_causal
    # theirs (16, 17).
    SEED_INDEX = {"dnabert2_mlm": 8, "dnabert2_cls": 9}
    DNABERT2 = {
        # 4 heads (power of two); 6 heads: the slopes of 4, then every second of 8.
        "dnabert2_mlm": dict(head="BertForMaskedLM", hidden_size=32, num_attention_heads=4,
                             intermediate_size=48, num_hidden_layers=2),
        "dnabert2_cls": dict(head="BertForSequenceClassification", hidden_size=48,
                             num_attention_heads=6, intermediate_size=64, num_hidden_layers=2,
                             num_labels=2),
        # Inputs longer than max_position_embeddings: ALiBi has no position table, and the
        # reference runs them (its table rebuilt past alibi_starting_size; the only thing sized
        # by max_position_embeddings, the token_type_ids buffer, BertModel never reads).
        "dnabert2_long_mlm": dict(head="BertForMaskedLM", hidden_size=16, num_attention_heads=4,
                                  intermediate_size=24, num_hidden_layers=2,
                                  max_position_embeddings=16, alibi_starting_size=8,
                                  sequences=DNABERT2_LONG_SEQS),
    }

    # -- DNABERT-2 (its own remote code: --dnabert2-ref) ---------------------------------------

    def dnabert2_tokenizer(self):
        """A real tokenizers BPE model in DNABERT-2's layout, trained on seeded random DNA."""
        import random
        from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
        rng = random.Random(self.seed)
        corpus = ["".join(rng.choice("ACGT") for _ in range(200)) for _ in range(200)]
        tk = Tokenizer(models.BPE(unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=DNABERT2_SPECIALS,
                                      show_progress=False)
        tk.train_from_iterator(corpus, trainer=trainer)
        tk.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
        return self.transformers.PreTrainedTokenizerFast(
            tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
            pad_token="[PAD]", mask_token="[MASK]")

    def make_dnabert2(self, family, folder):
        """The model is made and run in a scratch folder holding the reference code; the
        fixture folder gets everything but the .py files."""
        torch, transformers = self.torch, self.transformers
        spec = dict(self.DNABERT2[family])
        head = spec.pop("head")
        seqs = list(spec.pop("sequences", SEQS))
        tok = self.dnabert2_tokenizer()
        assert tok.convert_tokens_to_ids("[PAD]") == 3, "DNABERT-2's [PAD] is id 3"
        config = dict(DNABERT2_CONFIG, architectures=[head], vocab_size=len(tok), **spec)
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, family)
            os.makedirs(work)
            with open(os.path.join(work, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
            dnabert2_reference.install(self.dnabert2_ref, work)
            cfg = transformers.AutoConfig.from_pretrained(work, trust_remote_code=True)
            cls = auto_model_class(transformers, work)
            model = cls.from_config(cfg, trust_remote_code=True)
            self.perturb(model)
            model = model.eval()
            # The weights as DNABERT-2 stores them: every state-dict tensor, the tied decoder
            # too (save_pretrained refuses the remote code's undeclared tie).
            from safetensors.torch import save_file
            save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                      os.path.join(work, "model.safetensors"), metadata={"format": "pt"})
            if family == "dnabert2_mlm":
                # What the hub repository actually ships: a torch.save pickle of the state dict
                # (the decoder sharing the word embeddings' storage), for the .bin import.
                torch.save(model.state_dict(), os.path.join(work, "pytorch_model.bin"))
            tok.save_pretrained(work)
            ids, mask = self.encode(tok, seqs)
            self.check_round_trip(work, tok, seqs, ids, mask)
            assert ids.shape[1] > config["alibi_starting_size"], (
                f"{family}: {ids.shape[1]} tokens do not run past alibi_starting_size")
            long = ids.shape[1] > config["max_position_embeddings"]
            assert long == (family == "dnabert2_long_mlm"), (family, list(ids.shape))
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits.float()
                # The reference rebuilt its ALiBi table to the batch's length.
                alibi = model.bert.encoder.alibi
                assert list(alibi.shape[-2:]) == [ids.shape[1]] * 2, (family, alibi.shape)
                if long:  # each sequence alone (no padding) computes the same at its tokens
                    for b in range(ids.shape[0]):
                        n = int(mask[b].sum())
                        alone = model(input_ids=ids[b:b + 1, :n],
                                      attention_mask=mask[b:b + 1, :n]).logits
                        assert max_abs_diff(alone[0], logits[b, :n]) < 1e-5, (family, b)
                reloaded, info = cls.from_pretrained(work, trust_remote_code=True,
                                                     output_loading_info=True)
                again = reloaded.eval()(input_ids=ids, attention_mask=mask).logits
            assert not any(info[k] for k in ("missing_keys", "unexpected_keys",
                                             "mismatched_keys")), f"{family}: {info}"
            assert max_abs_diff(again, logits) == 0, f"{family}: the saved model computes otherwise"
            for name in os.listdir(work):
                if not name.endswith(".py"):
                    shutil.copyfile(os.path.join(work, name), os.path.join(folder, name))
        self.write_expected(folder, {"input_ids": ids, "attention_mask": mask, "logits": logits})
        self.write_fixture_json(folder, {
            "family": family, "class": f"bert_layers.{head} (DNABERT-2 remote code)",
            "tokenizer_class": type(tok).__name__, "sequences": seqs,
            "tokenizer_inputs": seqs,
            "note": ("DNABERT-2 (MosaicBERT): ALiBi (alibi_starting_size "
                     f"{config['alibi_starting_size']}, shorter than the sequences), fused Wqkv, "
                     "GLU feed-forward, post-LN; tokenizer.json a tokenizers BPE in DNABERT-2's "
                     "layout. " +
                     (f"Inputs longer than max_position_embeddings "
                      f"({config['max_position_embeddings']}; the padded batch has "
                      f"{ids.shape[1]} tokens, the sequences {mask.sum(1).tolist()}): ALiBi has "
                      "no position table and the reference computes them; each sequence alone "
                      "gives the same logits at its tokens. " if long else "") +
                     "Logits by the reference code on the CPU (PyTorch attention path); at "
                     "padding positions the reference outputs the head of a zero state: compare "
                     "at real tokens (attention_mask)"),
            "reference_code_sha256": dnabert2_reference.code_digest(self.dnabert2_ref),
            "reference_patches": dnabert2_reference.PATCHES,
            "input_ids": ids.tolist(), "logits_shape": list(logits.shape),
            "made_by": "tests/hf/make_fixtures.py --dnabert2-ref"})
        return list(logits.shape)

    # -- writing -------------------------------------------------------------------------------

    def perturb(self, model, scale=0.05):
        """Every parameter moved off its initial value (biases 0, LayerNorm gains 1)."""
        with self.torch.no_grad():
            for p in model.parameters():
                p.add_(self.torch.randn_like(p) * scale)

    def encode(self, tok, inputs):
        enc = tok(inputs, padding=True, return_tensors="pt")
        return enc["input_ids"].contiguous(), enc["attention_mask"].contiguous()

    def check_round_trip(self, folder, tok, inputs, ids, mask):
        """The saved tokenizer files, loaded the way users load them, give the same ids."""
        again = self.transformers.AutoTokenizer.from_pretrained(folder)
        ids2, mask2 = self.encode(again, inputs)
        assert self.torch.equal(ids, ids2) and self.torch.equal(mask, mask2), (
            f"{folder}: AutoTokenizer on the saved files gives other ids:\n{ids2}\nvs\n{ids}")
        unk = (ids == tok.unk_token_id).sum().item()
        assert unk <= 4, f"{folder}: {unk} unknown tokens: the tokenizer lost its vocabulary"

    def write_expected(self, folder, tensors):
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(folder, "expected.safetensors"))

    def write_fixture_json(self, folder, meta):
        with open(os.path.join(folder, "fixture.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")

    def make(self, family, index):
        folder = os.path.join(self.out, family)
        os.makedirs(folder, exist_ok=True)
        self.torch.manual_seed(self.seed + index)
        if family == "bert_cls_lora":
            return self.make_lora(folder)
        if family in self.DNABERT2:
            return self.make_dnabert2(family, folder)
        fx = getattr(self, family)(folder)
        self.perturb(fx.model)
        model = fx.model.eval()
        model.save_pretrained(folder)
        remote = family in self.NT_V2_FAMILIES
        if remote:  # as the hub's config.json: the classes are the repository's own code
            path = os.path.join(folder, "config.json")
            with open(path) as f:
                config = json.load(f)
            config["auto_map"] = NT_V2_AUTO_MAP
            with open(path, "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")
        fx.tokenizer.save_pretrained(folder)
        ids, mask = self.encode(fx.tokenizer, fx.inputs)
        self.check_round_trip(folder, fx.tokenizer, fx.inputs, ids, mask)
        with self.torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            cls = (nt_v2_model_class(self.nt_v2, folder) if remote else
                   auto_model_class(self.transformers, folder))
            reloaded = cls.from_pretrained(folder).eval()
            again = reloaded(input_ids=ids, attention_mask=mask).logits
        assert max_abs_diff(again, logits) == 0, f"{folder}: the saved model computes otherwise"
        self.write_expected(folder, {"input_ids": ids, "attention_mask": mask, "logits": logits})
        self.write_fixture_json(folder, {
            "family": family, "class": type(model).__name__,
            "tokenizer_class": type(fx.tokenizer).__name__, "sequences": SEQS,
            "tokenizer_inputs": fx.inputs, "note": fx.note, "input_ids": ids.tolist(),
            "logits_shape": list(logits.shape), "made_by": "tests/hf/make_fixtures.py"})
        return list(logits.shape)

    def make_lora(self, folder):
        """base/ a BertForSequenceClassification, adapter/ a PEFT LoRA on it (r 4, alpha 8,
        query and value; lora_B non-zero so the adapter matters), the tokenizer at the top."""
        fx = self.bert_cls(folder)
        self.perturb(fx.model)
        fx.model.eval().save_pretrained(os.path.join(folder, "base"))
        config = self.peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                      lora_dropout=0.0, task_type="SEQ_CLS")
        model = self.peft.get_peft_model(fx.model, config)
        with self.torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        model.eval().save_pretrained(os.path.join(folder, "adapter"))
        os.remove(os.path.join(folder, "adapter", "README.md"))  # PEFT's model-card template
        fx.tokenizer.save_pretrained(folder)
        ids, mask = self.encode(fx.tokenizer, fx.inputs)
        self.check_round_trip(folder, fx.tokenizer, fx.inputs, ids, mask)
        with self.torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            merged = model.merge_and_unload()(input_ids=ids, attention_mask=mask).logits.float()
        assert max_abs_diff(logits, merged) < 1e-4, "merge_and_unload changed the function"
        self.write_expected(folder, {"input_ids": ids, "attention_mask": mask, "logits": logits,
                                     "merged_logits": merged})
        self.write_fixture_json(folder, {
            "family": "bert_cls_lora", "class": "PeftModelForSequenceClassification",
            "tokenizer_class": type(fx.tokenizer).__name__, "peft": self.peft.__version__,
            "sequences": SEQS, "tokenizer_inputs": fx.inputs,
            "note": "base/ is a BertForSequenceClassification; adapter/ is a PEFT LoRA (r 4, "
                    "alpha 8, query+value); logits = base + adapter; merged_logits = after "
                    "merge_and_unload",
            "input_ids": ids.tolist(), "logits_shape": list(logits.shape),
            "made_by": "tests/hf/make_fixtures.py"})
        return list(logits.shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="where the family folders go")
    ap.add_argument("--family", action="append", choices=Maker.FAMILIES,
                    help="only these families (repeatable; default all)")
    ap.add_argument("--seed", type=int, default=0,
                    help="family i is seeded with seed + i (i: Maker.SEED_INDEX or its place)")
    ap.add_argument("--dnabert2-ref", help="folder of DNABERT-2's remote code (bert_layers.py, "
                    "bert_padding.py, configuration_bert.py); default $DNALLM_DNABERT2_REF; "
                    "without it the dnabert2 families are skipped")
    ap.add_argument("--nt-v2-code", help="folder with the Nucleotide Transformer v2 remote code "
                    "(esm_config.py, modeling_esm.py; default $DNALLM_NT_V2_CODE)")
    args = ap.parse_args()
    maker = Maker(args.out, args.seed, dnabert2_reference.reference_dir(args.dnabert2_ref),
                  nt_v2_code_dir(args.nt_v2_code))
    torch, transformers = maker.torch, maker.transformers
    report = {"made_by": "tests/hf/make_fixtures.py", "transformers": transformers.__version__,
              "peft": maker.peft.__version__, "torch": torch.__version__, "seed": args.seed,
              "families": {}}
    for index, family in enumerate(Maker.FAMILIES):
        if args.family and family not in args.family:
            continue
        if family in Maker.DNABERT2 and maker.dnabert2_ref is None:
            print(f"skipped {family}: {dnabert2_reference.SKIP_MESSAGE}", flush=True)
            continue
        if family in Maker.NT_V2_FAMILIES and maker.nt_v2 is None:
            print(f"skipped {family}: it needs the Nucleotide Transformer v2 remote code "
                  "(--nt-v2-code DIR or $DNALLM_NT_V2_CODE: esm_config.py and modeling_esm.py "
                  "of an InstaDeepAI nucleotide-transformer-v2 repository)", flush=True)
            report["families"][family] = {"ok": False, "skipped": "no --nt-v2-code"}
            continue
        shape = maker.make(family, Maker.SEED_INDEX.get(family, index))
        files = sorted(os.path.relpath(os.path.join(r, f), os.path.join(args.out, family))
                       for r, _, fs in os.walk(os.path.join(args.out, family)) for f in fs)
        report["families"][family] = {"ok": True, "files": files, "logits": shape}
        print(f"made {family}: logits {shape}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "REPORT.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
