#!/usr/bin/env python3
"""Loads our Caduceus exports with kuleshov-group's caduceus code (the classes users load the
published checkpoints with, over mamba-ssm's pure-PyTorch reference scan) and compares their
logits with the fixture's expected ones. Neither is ours and neither is committed: --code and
--mamba name the folders tests/hf/make_caduceus_fixtures.py describes (einops on the path).

  DNALLM_CADUCEUS_EXPORT_KEEP=/tmp/cx build/tests/worker/worker_model_test \\
      --gtest_filter='Caduceus*.Export*'
  python tests/hf/check_caduceus_export.py --code DIR --mamba DIR --exports /tmp/cx \\
      --fixtures tests/data/hf-fixtures
"""
import argparse
import json
import os
import sys

from hf_common import CodeFolders, exports_exit_code, import_reference


def main():
    ap = argparse.ArgumentParser()
    code = CodeFolders(ap, ("--code", "DNALLM_CADUCEUS_CODE"), ("--mamba", "DNALLM_MAMBA_CPU"))
    ap.add_argument("--exports", required=True)
    ap.add_argument("--fixtures", required=True)
    args = ap.parse_args()
    if code.missing("check_caduceus_export", args, "not checked"):
        return 0
    sys.path.insert(0, os.path.abspath(args.mamba))
    torch, transformers = import_reference(args.code, "caduceus_ref")
    from caduceus_ref.modeling_caduceus import CaduceusForMaskedLM, CaduceusForSequenceClassification
    from safetensors.torch import load_file
    import caduceus_ref.modeling_caduceus as modeling_caduceus
    import caduceus_ref.modeling_rcps as modeling_rcps
    import mamba_ssm.ops.triton.layer_norm as mamba_layer_norm
    from make_caduceus_fixtures import fused_norm_fn
    for module in (modeling_caduceus, modeling_rcps):  # fused_add_norm (caduceus_ps_fused_mlm)
        module.layer_norm_fn = fused_norm_fn(mamba_layer_norm, False)
        module.rms_norm_fn = fused_norm_fn(mamba_layer_norm, True)
    worst = 0.0
    names = sorted(os.listdir(args.exports))
    if not names:
        print(f"check_caduceus_export: FAILED ({args.exports} holds no export)")
        return 1
    for name in names:
        folder = os.path.join(args.exports, name)
        expected = load_file(os.path.join(args.fixtures, name, "expected.safetensors"))
        with open(os.path.join(folder, "config.json")) as f:
            arch = json.load(f)["architectures"][0]
        cls = (CaduceusForSequenceClassification if arch.endswith("ForSequenceClassification")
               else CaduceusForMaskedLM)
        model, info = cls.from_pretrained(folder, output_loading_info=True)
        # Every tensor must come from the file, except the RCPS masked LM's head, which the hub
        # code's tie_weights sets to the embedding (Note [Caduceus tied projections] in
        # worker/models/caduceus/caduceus.hpp: mamba_rev's tied projections are in the file,
        # since transformers 5 would leave them uninitialised).
        problems = {k: sorted(n for n in v if not (k == "missing_keys" and
                                                   n == "lm_head.lm_head.weight"))
                    for k, v in info.items()
                    if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        problems = {k: v for k, v in problems.items() if v}
        if problems:
            print(f"check_caduceus_export: FAILED ({name}: the reference code reports {problems})")
            return 1
        with torch.no_grad():
            logits = model.eval()(input_ids=expected["input_ids"]).logits.float()
        diff = (logits - expected["logits"]).abs().max().item()
        worst = max(worst, diff)
        print(f"{name}: {cls.__name__} from our export, max |reference code - expected| = "
              f"{diff:.3g}")
    return exports_exit_code("check_caduceus_export", worst)


if __name__ == "__main__":
    sys.exit(main())
