#!/usr/bin/env python3
"""Golden check of our BPE tokenizer.json reader (worker/data/hf_bpe.cpp) against the real
tokenizers library: ids must be identical.

Trains BPE tokenizers with the library on the bundled genome (data/*.fa.gz) in DNABERT-2's
layout (special tokens [UNK] [CLS] [SEP] [PAD] [MASK] = ids 0-4, pre-tokenizer Whitespace,
TemplateProcessing [CLS] $A [SEP], model BPE with unk_token [UNK]; tokenizer_class
PreTrainedTokenizerFast), in variants: vocabulary 200 and 4096, merges as DNABERT-2's "a b"
strings and as the library's current ["a", "b"] pairs, fuse_unk, ignore_merges, an N in the
alphabet, pre-tokenizer null and WhitespaceSplit. Each is reloaded by the library from the file
we read (so the file is one it accepts), then many sequences (random bases with N runs and
lower case, genome windows, lengths 1..20k, a few of random printable ASCII) are encoded by
the library (the upper-cased text: ours upper-cases, as for every scheme) and by our
hf_tokenize_tool; every line must match. transformers' AutoTokenizer on the directory is
checked on a few sequences too (the ids users get from it).

  python tests/hf/check_bpe.py --tool build/tests/hf/hf_tokenize_tool --source-dir .
"""
import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile

from hf_common import require

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]


def genome(path):
    with gzip.open(path, "rt") as f:
        return "".join(line.strip() for line in f if not line.startswith(">"))


def train(tk, text, vocab_size, alphabet):
    """A DNABERT-2-style BPE tokenizer trained on `text` cut in lines of 1,000 bases."""
    tok = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                     initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([text[i:i + 1000] for i in range(0, len(text), 1000)], trainer)
    tok.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return json.loads(tok.to_str())


def write_dir(path, tj):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tj, f, indent=2)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "right",
              "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
              "pad_token": "[PAD]", "mask_token": "[MASK]", "model_max_length": 512}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def sequences(rng, g, count):
    """Random bases (N runs, lower case), genome windows, lengths 1..20k, some ASCII."""
    def length():
        r = rng.random()
        return rng.randint(1, 20) if r < 0.3 else (
            rng.randint(20, 1000) if r < 0.8 else rng.randint(1000, 20000))
    out = ["A", "N", "NNNN", "ACGT", "acgtn", "GCGCGC", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"]
    while len(out) < count:
        n, kind = length(), rng.random()
        if kind < 0.4:
            start = rng.randrange(len(g) - n)
            s = list(g[start:start + n])
        else:
            s = [rng.choice("ACGT") for _ in range(n)]
        for _ in range(rng.randint(0, 3)):  # N runs
            at = rng.randrange(len(s))
            s[at:at + rng.randint(1, 12)] = "N" * rng.randint(1, 12)
        if rng.random() < 0.3:  # soft-masked (lower-case) stretches
            a = rng.randrange(len(s))
            b = min(len(s), a + rng.randint(1, 500))
            s[a:b] = [c.lower() for c in s[a:b]]
        if kind > 0.95:  # punctuation, spaces, digits: the pre-tokenizer's word boundaries
            alphabet = [chr(c) for c in range(0x20, 0x7f) if chr(c) not in "[]"] + list("\t\v\f\r")
            for _ in range(rng.randint(1, 20)):
                s.insert(rng.randrange(len(s) + 1), rng.choice(alphabet))
        out.append("".join(s))
    return out


def variants(tk, g):
    """(name, tokenizer.json) pairs."""
    small = train(tk, g[:300_000], 200, [])
    large = train(tk, g[:1_000_000], 4096, [])
    with_n = train(tk, g[:300_000] + "NNNNNNNNNN" * 50, 300, ["N"])
    out = []

    def legacy(tj):  # DNABERT-2's file: merges as "a b" strings
        tj = json.loads(json.dumps(tj))
        tj["model"]["merges"] = [" ".join(m) for m in tj["model"]["merges"]]
        return tj

    def edit(tj, **model):
        tj = json.loads(json.dumps(tj))
        for k, v in model.items():
            if k == "pre_tokenizer":
                tj["pre_tokenizer"] = v
            else:
                tj["model"][k] = v
        return tj

    out.append(("vocab200-legacy-merges", legacy(small)))
    out.append(("vocab200-pair-merges", small))
    out.append(("vocab4096-legacy-merges", legacy(large)))
    out.append(("vocab4096-fuse_unk", edit(large, fuse_unk=True)))
    out.append(("vocab4096-ignore_merges", edit(large, ignore_merges=True)))
    out.append(("vocab300-with-N", with_n))
    out.append(("vocab200-no-pre-tokenizer", edit(small, pre_tokenizer=None)))
    out.append(("vocab200-WhitespaceSplit",
                edit(small, pre_tokenizer={"type": "WhitespaceSplit"}, fuse_unk=True)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True, help="hf_tokenize_tool")
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--count", type=int, default=300, help="sequences per variant")
    ap.add_argument("--seed", type=int, default=20261125)
    a = ap.parse_args()
    (tk,) = require("tokenizers")
    (transformers,) = require("transformers")
    transformers.utils.logging.set_verbosity_error()  # "longer than model_max_length" notes
    g = genome(os.path.join(a.source_dir, "data", "ecoli_k12_mg1655.fa.gz"))
    rng = random.Random(a.seed)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="dnallm_check_bpe_") as work:
        variants_cache = variants(tk, g)
        for name, tj in variants_cache:
            d = os.path.join(work, name)
            write_dir(d, tj)
            lib = tk.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
            seqs = sequences(rng, g, a.count)
            seq_file = os.path.join(d, "sequences.txt")
            with open(seq_file, "w") as f:
                f.write("".join(s + "\n" for s in seqs))
            run = subprocess.run([a.tool, d, seq_file], capture_output=True, text=True)
            if run.returncode != 0:
                print(f"FAIL {name}: hf_tokenize_tool exit {run.returncode}: {run.stderr.strip()}")
                failed += 1
                continue
            ours = run.stdout.split("\n")[:-1]
            theirs = [" ".join(map(str, e.ids)) for e in lib.encode_batch([s.upper() for s in seqs])]
            bad = [i for i in range(len(seqs)) if i >= len(ours) or ours[i] != theirs[i]]
            auto = transformers.AutoTokenizer.from_pretrained(d)
            auto_bad = [i for i in range(0, len(seqs), 30)
                        if auto(seqs[i].upper())["input_ids"] != list(map(int, theirs[i].split()))]
            tokens = sum(len(t.split()) for t in theirs)
            bases = sum(map(len, seqs))
            if bad or len(ours) != len(seqs) or auto_bad:
                failed += 1
                print(f"FAIL {name}: {len(bad)} of {len(seqs)} sequences differ"
                      f"{'; transformers differs at ' + str(auto_bad[:5]) if auto_bad else ''}")
                for i in bad[:3]:
                    o = ours[i].split() if i < len(ours) else []
                    t = theirs[i].split()
                    j = next((j for j in range(min(len(o), len(t))) if o[j] != t[j]),
                             min(len(o), len(t)))
                    print(f"  sequence {i} ({len(seqs[i])} chars, {seqs[i][:60]!r}...): first "
                          f"difference at token {j}: ours {o[j:j + 5]} library {t[j:j + 5]}")
            else:
                print(f"ok   {name}: {len(seqs)} sequences, {bases} chars, {tokens} tokens "
                      f"identical ({len(tj['model']['merges'])} merges)")
        # A file the library reads but we do not implement: refused, exit 2, one line.
        d = os.path.join(work, "dropout")
        tj = variants_cache[0][1]
        tj = json.loads(json.dumps(tj))
        tj["model"]["dropout"] = 0.1
        write_dir(d, tj)
        tk.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        run = subprocess.run([a.tool, d, seq_file], capture_output=True, text=True)
        msg = run.stderr.strip()
        if run.returncode != 2 or "\n" in msg or "model.dropout = 0.1" not in msg:
            failed += 1
            print(f"FAIL dropout 0.1: exit {run.returncode}, message {msg!r}")
        else:
            print(f"ok   dropout 0.1 refused (exit 2): {msg}")
    if failed:
        sys.exit(f"FAIL: {failed} variant(s) differ from the tokenizers library")
    print("all BPE variants identical to the tokenizers library")


if __name__ == "__main__":
    main()
