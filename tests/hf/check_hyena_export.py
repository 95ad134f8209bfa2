#!/usr/bin/env python3
"""Loads our HyenaDNA exports with LongSafari's hub code (the way users load the published
checkpoints: AutoModel classes over modeling_hyena.py) and compares its logits with the
fixture's expected ones. The hub code is not ours and not committed: --code names a folder
holding it (see tests/hf/make_hyena_fixtures.py).

  DNALLM_HYENA_EXPORT_KEEP=/tmp/hx build/tests/worker/worker_model_test --gtest_filter='Hyena*.Export*'
  python tests/hf/check_hyena_export.py --code /tmp/hyena_ref/hf --exports /tmp/hx \\
      --fixtures tests/data/hf-fixtures
"""
import argparse
import os
import shutil
import sys

from hf_common import CodeFolders, exports_exit_code, import_reference


def main():
    ap = argparse.ArgumentParser()
    code = CodeFolders(ap, ("--code", "DNALLM_HYENA_CODE"))
    ap.add_argument("--exports", required=True)
    ap.add_argument("--fixtures", required=True)
    args = ap.parse_args()
    if code.missing("check_hyena_export", args, "not checked"):
        return 0
    torch, transformers = import_reference(args.code, "hyena_ref")
    from hyena_ref.modeling_hyena import HyenaDNAForCausalLM, HyenaDNAForSequenceClassification
    from safetensors.torch import load_file
    worst = 0.0
    for name in sorted(os.listdir(args.exports)):
        folder = os.path.join(args.exports, name)
        expected = load_file(os.path.join(args.fixtures, name, "expected.safetensors"))
        classifier = "score.weight" in load_file(os.path.join(folder, "model.safetensors"))
        cls = HyenaDNAForSequenceClassification if classifier else HyenaDNAForCausalLM
        model = cls.from_pretrained(folder).eval()
        with torch.no_grad():
            logits = model(input_ids=expected["input_ids"]).logits.float()
        diff = (logits - expected["logits"]).abs().max().item()
        worst = max(worst, diff)
        print(f"{name}: {cls.__name__} from our export, max |hub code - expected| = {diff:.3g}")
    return exports_exit_code("check_hyena_export", worst)


if __name__ == "__main__":
    sys.exit(main())
