#!/usr/bin/env python3
"""Load our Hugging Face exports with transformers' Auto classes (and PEFT) and compare with
our own logits: the other direction of tests/data/hf-fixtures. CTest hf_check_export runs it
(tests/hf/export_test.sh) on every kind of export the C++ test writes (ours: MLM
rotary/learned/NT, classification, regression, LoRA classification with its PEFT adapter,
causal; and every fixture family imported and exported again: bert, esm, gpt_neox, llama,
roberta-prelayernorm, a PEFT adapter), with the project's Python environment
(scripts/install-deps.sh):

  DNALLM_HF_EXPORT_KEEP=/tmp/hf-exports build/tests/worker/worker_hf_import_test \
      --gtest_filter='Kinds/*'
  $DNALLM_PYTHON tests/hf/check_export.py --eval build/bin/dnallm-eval /tmp/hf-exports/*
  # or a trained model: dnallm-train writes <checkpoint.dir>/final/hf
  $DNALLM_PYTHON tests/hf/check_export.py --eval build/bin/dnallm-eval runs/x/final/hf

For each DIR: `dnallm-eval --model DIR --logits SEQS --out ours.safetensors` gives our ids and
logits; AutoTokenizer must give the same ids for the same sequences (input as
tokenizer_config.json's "dnallm_input" says: the bases, or overlapping k-mers separated by
spaces), and AutoModelFor<the class in config.json> the same logits (max abs difference <=
--tolerance at real tokens), with every tensor the model has in the file and nothing else
(transformers' loading report). With DIR/adapter and DIR/base: PeftModel.from_pretrained(base,
adapter) must give our adapter logits, and merge_and_unload() our merged ones. Prints one line
per check, then the max |logit difference| of every kind, and exits 1 if any check fails (or
transformers is not installed). A Nucleotide Transformer v2 export (config.json with its
auto_map) is loaded with that remote code (--nt-v2-code DIR or $DNALLM_NT_V2_CODE:
esm_config.py, modeling_esm.py); without it its model checks are skipped with a message. A
DNABERT-2 export (config.json with DNABERT-2's auto_map) is loaded with its remote code
(--dnabert2-ref or DNALLM_DNABERT2_REF; tests/hf/dnabert2_reference.py) and skipped with a
message without it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import dnabert2_reference
from hf_common import (SEQS, Checks, adapter_problems, add_remote_code_arguments,
                       auto_model_class, import_peers, load_model, max_abs_diff,
                       nt_v2_model_class, overlapping_kmers, remote_code, versions)


BPE_PENDING = 'model type "BPE" is not supported'


def tokenizer_inputs(tok_dir, seqs):
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        how = json.load(f).get("dnallm_input", "the bases as they are")
    if how.startswith("overlapping "):
        k = int(how.split()[1].split("-")[0])
        return [overlapping_kmers(s, k) for s in seqs]
    return list(seqs)


def ours(eval_bin, model_dir, seq_file, out_dir, adapter=None, tokenizer=None):
    out = os.path.join(out_dir, "ours.safetensors")
    cmd = [eval_bin, "--model", model_dir, "--logits", seq_file, "--out", out]
    if adapter:
        cmd += ["--adapter", adapter]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise subprocess.CalledProcessError(done.returncode, cmd, stderr=done.stderr)
    from safetensors.torch import load_file
    return load_file(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+", help="our Hugging Face export directories")
    ap.add_argument("--eval", default="build/bin/dnallm-eval", help="dnallm-eval binary")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    add_remote_code_arguments(ap, "DNABERT-2 exports")
    args = ap.parse_args()
    torch, transformers = import_peers()
    import peft
    ref, nt_v2 = remote_code(args)

    print(versions(transformers, peft, torch))
    checks = Checks()
    summary = []  # (kind, what, max |logit diff|)

    def report(kind, what, ok, detail):
        checks.report(f"{kind} {what}", ok, detail)

    def compare(kind, what, theirs, mine, mask, token_level):
        # Padding positions are not part of our function: token-level logits count at real
        # tokens only (a classifier's logits are one row per sequence).
        diff = max_abs_diff(theirs, mine, mask if token_level else None)
        summary.append((kind, what, diff))
        report(kind, what, diff <= args.tolerance, f"max |logit diff| {diff:.3g}")

    with tempfile.TemporaryDirectory() as tmp:
        seq_file = os.path.join(tmp, "seqs.txt")
        with open(seq_file, "w") as f:
            f.write("\n".join(SEQS) + "\n")
        for d in args.dirs:
            d = os.path.abspath(d)
            kind = os.path.basename(d.rstrip("/"))
            dnabert2 = dnabert2_reference.is_dnabert2(d)
            if dnabert2:
                if ref is None:
                    print(f"skip {kind}: {dnabert2_reference.SKIP_MESSAGE}", flush=True)
                    continue
                d = dnabert2_reference.with_code(ref, d, tmp)
            try:
                mine = ours(args.eval, d, seq_file, tmp)
            except subprocess.CalledProcessError as e:
                if BPE_PENDING in (e.stderr or ""):
                    # A re-exported DNABERT-2 fixture keeps its BPE tokenizer.json, which
                    # dnallm-eval reads once worker/data/hf_tokenizer.cpp has BPE.
                    print(f"skip {kind}: dnallm-eval cannot read its BPE tokenizer.json yet",
                          flush=True)
                    continue
                report(kind, "dnallm-eval --logits", False, str(e))
                continue
            ids, mask = mine["input_ids"], mine["attention_mask"]
            tok = transformers.AutoTokenizer.from_pretrained(d)
            enc = tok(tokenizer_inputs(d, SEQS), padding=True, return_tensors="pt")
            same_ids = torch.equal(enc["input_ids"], ids) and torch.equal(
                enc["attention_mask"], mask)
            report(kind, f"AutoTokenizer ({type(tok).__name__}) ids", same_ids,
                   "identical" if same_ids else f"\n{enc['input_ids']}\nvs ours\n{ids}")
            with open(os.path.join(d, "config.json")) as f:
                # (DNABERT-2's auto_map is its own remote code, loaded by auto_model_class)
                remote = not dnabert2 and "auto_map" in json.load(f)
            if remote and nt_v2 is None:
                print(f"skip {kind}: a Nucleotide Transformer v2 export; its remote code is not "
                      "given (--nt-v2-code DIR or $DNALLM_NT_V2_CODE)", flush=True)
                continue
            cls = nt_v2_model_class(nt_v2, d) if remote else auto_model_class(transformers, d)
            token_level = not (cls is transformers.AutoModelForSequenceClassification or
                               cls.__name__.endswith("ForSequenceClassification"))
            model, problems = load_model(cls, d)
            report(kind, f"{type(model).__name__} weights", not problems,
                   problems or "every tensor of the model, nothing else")
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
            compare(kind, f"{type(model).__name__} logits", logits, mine["logits"], mask,
                    token_level)
            adapter, base = os.path.join(d, "adapter"), os.path.join(d, "base")
            if not os.path.isdir(adapter):
                continue
            try:
                mine_a = ours(args.eval, base, seq_file, tmp, adapter=adapter, tokenizer=base)
            except subprocess.CalledProcessError as e:
                report(kind, "dnallm-eval --adapter --logits", False, str(e))
                continue
            ids_a, mask_a = mine_a["input_ids"], mine_a["attention_mask"]
            base_model, problems = load_model(cls, base)
            report(kind, "base/ weights", not problems,
                   problems or "every tensor of the model, nothing else")
            pm = peft.PeftModel.from_pretrained(base_model, adapter).eval()
            problems = adapter_problems(peft, pm, adapter)
            report(kind, "adapter/ tensors", not problems, problems or "exactly what PEFT saves")
            with torch.no_grad():
                unmerged = pm(input_ids=ids_a, attention_mask=mask_a).logits
                merged = pm.merge_and_unload()(input_ids=ids_a, attention_mask=mask_a).logits
            compare(kind, "PeftModel (unmerged) logits", unmerged, mine_a["logits"], mask_a,
                    token_level)
            compare(kind, "merge_and_unload logits", merged, mine_a["merged_logits"], mask_a,
                    token_level)
            compare(kind, "merge_and_unload vs our merged export", merged, mine["logits"], mask,
                    token_level)
    print("\nmax |logit diff| per kind (transformers/PEFT vs dnallm-eval):")
    width = [max((len(row[i]) for row in summary), default=0) for i in (0, 1)]
    for kind, what, diff in summary:
        print(f"  {kind:<{width[0]}}  {what:<{width[1]}}  {diff:.3g}")
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
