#!/usr/bin/env python3
"""Run the golden Hugging Face fixtures (tests/data/hf-fixtures) through the transformers,
tokenizers and PEFT installed now: they must still compute what the fixtures say.

For each fixture folder: AutoTokenizer.from_pretrained(folder) on fixture.json's tokenizer
inputs (the sequences, or their overlapping k-mers separated by spaces for a BertTokenizer)
must give expected.safetensors' input_ids and attention_mask exactly, and
AutoModelFor<config.json's head>.from_pretrained(folder) its logits within --tolerance (every
position, padding included: both sides are transformers on the same batch). For a folder with
base/ and adapter/ (bert_cls_lora): PeftModel.from_pretrained(base, adapter) must give
`logits` and merge_and_unload() `merged_logits`. Prints one line per check with the max
|logit difference| and exits 1 if any fails (and when transformers is missing: run
scripts/install-deps.sh).

  python tests/hf/check_fixtures.py tests/data/hf-fixtures [--nt-v2-code DIR] [--dnabert2-ref DIR]

The Nucleotide Transformer v2 families (config.json with its auto_map) run through that remote
code (DIR or $DNALLM_NT_V2_CODE: esm_config.py, modeling_esm.py); without it they are skipped
with a message. The DNABERT-2 families need its remote code (--dnabert2-ref or
DNALLM_DNABERT2_REF: see tests/hf/dnabert2_reference.py); without it they are skipped with a
message.
"""
import argparse
import json
import os
import sys
import tempfile

import dnabert2_reference
from hf_common import (Checks, adapter_problems, add_remote_code_arguments, auto_model_class,
                       import_peers, load_model, max_abs_diff, nt_v2_model_class,
                       overlapping_kmers, remote_code, versions)

FAMILIES = ["bert_mlm", "bert_cls", "esm_mlm", "esm_cls", "gptneox_causal", "llama_causal",
            "roberta_prelayernorm_mlm", "bert_cls_lora", "llama_gqa_causal", "llama_mqa_causal",
            "esm_v2_mlm", "esm_v2_cls", "esm_v1_mlm", "dnabert2_mlm", "dnabert2_cls",
            "dnabert2_long_mlm", "llama_rope500k_gqa_causal", "gptneox_pythia_causal"]


def expected_inputs(folder, fixture, tokenizer_class):
    """The strings the family's tokenizer is given: DNABERT's overlapping k-mers for a
    BertTokenizer (k from vocab.txt), the bases as they are otherwise."""
    seqs = fixture["sequences"]
    if tokenizer_class.startswith("Bert"):
        with open(os.path.join(folder, "vocab.txt")) as f:
            k = max(len(t) for t in f.read().split() if set(t) <= set("ACGTN"))
        return [overlapping_kmers(s, k) for s in seqs]
    return list(seqs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fixtures", help="the fixtures folder (tests/data/hf-fixtures)")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    add_remote_code_arguments(ap, "the dnabert2 families")
    args = ap.parse_args()
    scratch = tempfile.TemporaryDirectory()
    torch, transformers = import_peers()
    ref, nt_v2 = remote_code(args)
    import peft
    from safetensors.torch import load_file

    print(versions(transformers, peft, torch))
    checks = Checks()
    report = checks.report

    for family in FAMILIES:
        folder = os.path.join(args.fixtures, family)
        if not os.path.isdir(folder):
            report(family, False, f"no folder {folder}")
            continue
        dnabert2 = dnabert2_reference.is_dnabert2(folder)
        if dnabert2:
            if ref is None:
                print(f"skip {family}: {dnabert2_reference.SKIP_MESSAGE}", flush=True)
                continue
            folder = dnabert2_reference.with_code(ref, folder, scratch.name)
        config = os.path.join(folder, "config.json")
        # (DNABERT-2's auto_map is its own remote code, loaded by auto_model_class)
        remote = (not dnabert2 and os.path.isfile(config) and
                  "auto_map" in json.load(open(config)))
        if remote and nt_v2 is None:
            print(f"skip {family}: the Nucleotide Transformer v2 remote code is not given "
                  "(--nt-v2-code DIR or $DNALLM_NT_V2_CODE)", flush=True)
            continue
        with open(os.path.join(folder, "fixture.json")) as f:
            fixture = json.load(f)
        expected = load_file(os.path.join(folder, "expected.safetensors"))
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        inputs = expected_inputs(folder, fixture, type(tok).__name__)
        if "tokenizer_inputs" in fixture and fixture["tokenizer_inputs"] != inputs:
            report(f"{family} tokenizer inputs", False,
                   f"fixture.json says {fixture['tokenizer_inputs']}, the family's convention "
                   f"gives {inputs}")
        enc = tok(inputs, padding=True, return_tensors="pt")
        same = (torch.equal(enc["input_ids"], expected["input_ids"]) and
                torch.equal(enc["attention_mask"], expected["attention_mask"]))
        report(f"{family} {type(tok).__name__} ids", same,
               "identical" if same else
               f"\n{enc['input_ids']}\nexpected\n{expected['input_ids']}")
        ids, mask = expected["input_ids"], expected["attention_mask"]
        adapter = os.path.join(folder, "adapter")
        model_dir = os.path.join(folder, "base") if os.path.isdir(adapter) else folder
        cls = (nt_v2_model_class(nt_v2, model_dir) if remote else
               auto_model_class(transformers, model_dir))
        model, problems = load_model(cls, model_dir)
        report(f"{family} {type(model).__name__} weights", not problems,
               problems or "every tensor of the model, nothing else")
        if os.path.isdir(adapter):
            model = peft.PeftModel.from_pretrained(model, adapter).eval()
            problems = adapter_problems(peft, model, adapter)
            report(f"{family} adapter tensors", not problems, problems or "exactly what PEFT saves")
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        diff = max_abs_diff(logits, expected["logits"])
        report(f"{family} {type(model).__name__} logits", diff <= args.tolerance,
               f"max |logit diff| {diff:.3g}")
        if os.path.isdir(adapter):
            with torch.no_grad():
                merged = model.merge_and_unload()(input_ids=ids, attention_mask=mask).logits
            diff = max_abs_diff(merged, expected["merged_logits"])
            report(f"{family} merge_and_unload logits", diff <= args.tolerance,
                   f"max |logit diff| {diff:.3g}")
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
