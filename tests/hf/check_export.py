#!/usr/bin/env python3
"""Load our Hugging Face exports with transformers' Auto classes (and PEFT) and compare with
our own logits: the other direction of tests/data/hf-fixtures. Run where transformers, peft,
safetensors and torch are installed (the GPU node has them):

  # every kind of export the CI test writes (MLM rotary/learned, classification, regression,
  # LoRA classification with its PEFT adapter, causal):
  DNALLM_HF_EXPORT_KEEP=/tmp/hf-exports build/tests/worker/worker_hf_import_test \
      --gtest_filter='Kinds/HfExportTest.*'
  python3 tests/hf/check_export.py --eval build/bin/dnallm-eval /tmp/hf-exports/*
  # or a trained model: dnallm-train writes <checkpoint.dir>/final/hf
  python3 tests/hf/check_export.py --eval build/bin/dnallm-eval runs/x/final/hf

For each DIR: `dnallm-eval --model DIR --logits SEQS --out ours.safetensors` gives our ids and
logits; AutoTokenizer must give the same ids for the same sequences (input as
tokenizer_config.json's "dnallm_input" says: the bases, or overlapping k-mers separated by
spaces), and AutoModelFor<the class in config.json> the same logits (max abs difference <=
--tolerance at real tokens). With DIR/adapter and DIR/base: PeftModel.from_pretrained(base,
adapter) must give our adapter logits, and merge_and_unload() our merged ones. Prints one line
per check and exits 1 if any fails.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

SEQS = ["ACGTACGTTAGCCGATAGGCTTACGATCGATCGGATCCATGCAAGTCNNACGTTGCA",
        "TTGACAGCTAGCTCAGTCCTAGGTATAATGCTAGCACGTAGCTAGCAGTCAGTACGA",
        "GGGCGCATTACGAT"]


def tokenizer_inputs(tok_dir, seqs):
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        how = json.load(f).get("dnallm_input", "the bases as they are")
    if how.startswith("overlapping "):
        k = int(how.split()[1].split("-")[0])
        return [" ".join(s[i:i + k] for i in range(len(s) - k + 1)) for s in seqs]
    return list(seqs)


def auto_class(transformers, model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    if arch.endswith("ForMaskedLM"):
        return transformers.AutoModelForMaskedLM, True
    if arch.endswith("ForCausalLM"):
        return transformers.AutoModelForCausalLM, True
    if arch.endswith("ForSequenceClassification"):
        return transformers.AutoModelForSequenceClassification, False
    raise SystemExit(f"{model_dir}: unexpected architecture {arch}")


def ours(eval_bin, model_dir, seq_file, out_dir, adapter=None, tokenizer=None):
    out = os.path.join(out_dir, "ours.safetensors")
    cmd = [eval_bin, "--model", model_dir, "--logits", seq_file, "--out", out]
    if adapter:
        cmd += ["--adapter", adapter]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    from safetensors.torch import load_file
    return load_file(out)


def max_diff(a, b, mask, token_level):
    import torch
    a, b = a.double(), b.double().reshape(a.shape)
    if token_level:
        m = mask.bool()
        return (a[m] - b[m]).abs().max().item()
    return (a - b).abs().max().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+", help="our Hugging Face export directories")
    ap.add_argument("--eval", default="build/bin/dnallm-eval", help="dnallm-eval binary")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()

    import torch
    import transformers
    failures = 0
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        seq_file = os.path.join(tmp, "seqs.txt")
        with open(seq_file, "w") as f:
            f.write("\n".join(SEQS) + "\n")

        def report(name, ok, detail):
            nonlocal failures
            failures += 0 if ok else 1
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

        for d in args.dirs:
            d = os.path.abspath(d)
            mine = ours(args.eval, d, seq_file, tmp)
            tok = transformers.AutoTokenizer.from_pretrained(d)
            enc = tok(tokenizer_inputs(d, SEQS), padding=True, return_tensors="pt")
            same_ids = torch.equal(enc["input_ids"], mine["input_ids"]) and torch.equal(
                enc["attention_mask"], mine["attention_mask"])
            report(f"{d} AutoTokenizer ids", same_ids,
                   "identical" if same_ids else f"\n{enc['input_ids']}\nvs ours\n{mine['input_ids']}")
            cls, token_level = auto_class(transformers, d)
            model = cls.from_pretrained(d).eval()
            with torch.no_grad():
                logits = model(input_ids=mine["input_ids"], attention_mask=mine["attention_mask"]).logits
            diff = max_diff(logits, mine["logits"], mine["attention_mask"], token_level)
            report(f"{d} {type(model).__name__} logits", diff <= args.tolerance,
                   f"max abs diff {diff:.3g}")
            adapter, base = os.path.join(d, "adapter"), os.path.join(d, "base")
            if os.path.isdir(adapter):
                import peft
                mine_a = ours(args.eval, base, seq_file, tmp, adapter=adapter, tokenizer=base)
                base_model = cls.from_pretrained(base).eval()
                pm = peft.PeftModel.from_pretrained(base_model, adapter).eval()
                with torch.no_grad():
                    la = pm(input_ids=mine_a["input_ids"], attention_mask=mine_a["attention_mask"]).logits
                    merged = pm.merge_and_unload()
                    lm = merged(input_ids=mine_a["input_ids"], attention_mask=mine_a["attention_mask"]).logits
                diff_a = max_diff(la, mine_a["logits"], mine_a["attention_mask"], token_level)
                diff_m = max_diff(lm, mine_a["merged_logits"], mine_a["attention_mask"], token_level)
                report(f"{d} PeftModel (peft {peft.__version__}) logits", diff_a <= args.tolerance,
                       f"max abs diff {diff_a:.3g}")
                report(f"{d} merge_and_unload logits", diff_m <= args.tolerance,
                       f"max abs diff {diff_m:.3g}")
                diff_full = max_diff(lm, mine["logits"], mine["attention_mask"], token_level)
                report(f"{d} merged adapter vs our merged export", diff_full <= args.tolerance,
                       f"max abs diff {diff_full:.3g}")
    print("all checks passed" if failures == 0 else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
