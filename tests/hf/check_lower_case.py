#!/usr/bin/env python3
"""Lower-case (soft-masked) input, read as each model's own tokenizer reads it (Note [Sequence
codec], worker/data/sequence_codec.hpp): the input_ids that `dnallm-eval --logits` writes for
sequences with lower-case runs equal those of the reference tokenizers (transformers'
AutoTokenizer, or the tokenizers library for DNABERT-2's tokenizer.json), padding included, for
every tokenizer kind of tests/data/hf-fixtures: DNABERT's k-mers, the Nucleotide Transformer's
6-mers (a lower-case run is one <unk>), one token a base (word-level), BPE, and the HyenaDNA /
Caduceus character tokenizers. The batch: soft_masked() of the fixture's sequences and n_row().
With --uppercase the ids are those of the upper-cased sequences. The warning names the
lower-case bases that became unknown tokens.

HyenaDNA's and Caduceus' tokenizers are their hub code (not installed here): their ids are the
golden rows lower_case.json in the fixture folder, made by that reference code
(tests/hf/make_lower_case_rows.py). HyenaDNA reads a lower-case base as [UNK] (its _tokenize
keeps the case); Caduceus upper-cases the text first, so a lower-case base is that base.

  python tests/hf/check_lower_case.py --eval build/bin/dnallm-eval --fixtures tests/data/hf-fixtures
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from hf_common import checks_exit_code, import_peers, overlapping_kmers

FAMILIES = ["bert_mlm", "esm_mlm", "esm_v2_mlm", "llama_causal", "gptneox_causal",
            "roberta_prelayernorm_mlm", "dnabert2_mlm", "hyenadna_causal", "caduceus_ps_mlm"]


def soft_masked(seqs):
    """The fixture's sequences with lower-case runs: a single base, a run, the start, the end."""
    a, b, c = seqs
    return [a[:5] + a[5:6].lower() + a[6:20] + a[20:31].lower() + a[31:],
            b[:8].lower() + b[8:-4] + b[-4:].lower(),
            c.lower()]


GOLDEN = ("hyenadna", "caduceus")  # families whose ids are lower_case.json's golden rows


def n_row():
    """N and n among bases of both cases (our readers refuse any other character)."""
    return "NNACGTnnacgtNnAaCcGgTtN"


def rows(seqs):
    """The batch checked: soft_masked(seqs) and n_row()."""
    return soft_masked(seqs) + [n_row()]


def golden_ids(folder, seqs, upper):
    """input_ids [rows][T] from the folder's lower_case.json (made by the reference tokenizer
    code, tests/hf/make_lower_case_rows.py); a missing or stale file is a failure."""
    path = os.path.join(folder, "lower_case.json")
    if not os.path.exists(path):
        sys.exit(f"FAIL: {path} is missing: make it with tests/hf/make_lower_case_rows.py "
                 "(it needs the reference tokenizer code)")
    golden = json.load(open(path))
    if golden["sequences"] != seqs:
        sys.exit(f"FAIL: {path} was made for other sequences than this check builds: make it "
                 "again with tests/hf/make_lower_case_rows.py")
    return golden["uppercase_input_ids" if upper else "input_ids"]


def reference_ids(folder, seqs, transformers):
    """input_ids [rows][T] as the reference tokenizer gives them, padded as it pads (live, by
    the installed libraries; the families of GOLDEN have golden_ids() instead)."""
    config = {}
    if os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        config = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    cls = config.get("tokenizer_class", "")
    name = os.path.basename(folder)
    if name.startswith("dnabert2"):
        import tokenizers
        tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        rows = [tok.encode(s).ids for s in seqs]
        pad = tok.token_to_id("[PAD]")
        longest = max(len(r) for r in rows)
        return [r + [pad] * (longest - len(r)) for r in rows]
    tok = (transformers.EsmTokenizer.from_pretrained(folder) if cls == "EsmTokenizer"
           else transformers.AutoTokenizer.from_pretrained(folder))
    inputs = seqs
    if cls.startswith("Bert"):
        with open(os.path.join(folder, "vocab.txt")) as f:
            k = max(len(t) for t in f.read().split() if set(t) <= set("ACGTN"))
        inputs = [overlapping_kmers(s, k) for s in seqs]
    return tok(inputs, padding=True)["input_ids"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval", required=True)
    ap.add_argument("--fixtures", required=True)
    args = ap.parse_args()
    torch, transformers = import_peers()
    from safetensors.torch import load_file
    tmp = tempfile.mkdtemp(prefix="dnallm_lower_case_")
    failures = 0
    for name in FAMILIES:
        folder = os.path.join(args.fixtures, name)
        seqs = rows(json.load(open(os.path.join(folder, "fixture.json")))["sequences"])
        with open(os.path.join(tmp, "seqs.txt"), "w") as f:
            f.write("\n".join(seqs) + "\n")
        for upper in (False, True):
            out = os.path.join(tmp, "out.safetensors")
            cmd = [args.eval, "--model", folder, "--logits", os.path.join(tmp, "seqs.txt"),
                   "--out", out] + (["--uppercase"] if upper else [])
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"FAIL {name} uppercase={upper}: exit {r.returncode}\n{r.stdout}{r.stderr}")
                failures += 1
                continue
            got = load_file(out)["input_ids"].tolist()
            if name.startswith(GOLDEN):
                want = golden_ids(folder, seqs, upper)
            else:
                want = reference_ids(folder, [s.upper() for s in seqs] if upper else seqs,
                                     transformers)
            warned = "lower-case (soft-masked) bases" in r.stderr
            # The warning is given when lower-case bases became unknown tokens: not for a
            # tokenizer that upper-cases its input itself (Caduceus).
            ok = got == want and warned == (not upper and not name.startswith("caduceus"))
            failures += 0 if ok else 1
            print(f"{'ok  ' if ok else 'FAIL'} {name} uppercase={upper}: ids "
                  f"{'equal' if got == want else 'DIFFER'}, warning {'given' if warned else 'none'}")
            if got != want:
                print(f"  ours:      {got}\n  reference: {want}")
    return checks_exit_code(failures,
                            "lower-case input is read as every reference tokenizer reads it")


if __name__ == "__main__":
    sys.exit(main())
