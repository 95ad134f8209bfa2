#!/usr/bin/env python3
"""Golden fixtures for Caduceus (tests/data/hf-fixtures/caduceus_*), made by the reference code
users load the published checkpoints with: kuleshov-group/caduceus's caduceus/ package
(configuration_caduceus.py, modeling_caduceus.py, modeling_rcps.py) over mamba-ssm's Mamba
module with its pure-PyTorch reference scan (selective_scan_ref) on the CPU. Neither is ours
and neither is committed. --code names a folder with the three caduceus files; --mamba names a
folder holding a `mamba_ssm` package that imports on the CPU: mamba_ssm/modules/mamba_simple.py
and block.py from state-spaces/mamba unchanged, mamba_ssm/ops/selective_scan_interface.py
defining selective_scan_fn = that repository's selective_scan_ref (and mamba_inner_fn = None),
mamba_ssm/ops/triton/layer_norm.py defining RMSNorm as its rms_norm_ref computes it (and
layer_norm_fn = rms_norm_fn = None) and holding that repository's layer_norm_ref and rms_norm_ref
unchanged, plus einops on the path. Without them this script exits 0
with a message (CI cannot fetch them). The caduceus code needs one patch for transformers 5:
tie_weights() must accept the keyword recompute_mapping (the fixture README says so; `def
tie_weights(self, *args, **kwargs)` does).
tests/hf/check_caduceus_export.py loads our exports of these fixtures with the same code
(tests/worker/caduceus_test.cpp writes them with DNALLM_CADUCEUS_EXPORT_KEEP=DIR).

  python tests/hf/make_caduceus_fixtures.py --code DIR --mamba DIR --out tests/data/hf-fixtures

Fixtures (d_model 16, 2 layers, d_state 4): caduceus_ph_mlm (bidirectional, weight-tied),
caduceus_ps_mlm (RCPS), caduceus_ps_cls (RCPS classifier, 3 labels, mean pooling), all with
fused_add_norm off, and caduceus_ps_fused_mlm (RCPS, fused_add_norm on, as the published
Caduceus-PS configs: the RCPS block's fused path normalises the channel halves swapped, unlike the
unfused RCPSAddNormWrapper). For the fused path the Triton kernels layer_norm_fn / rms_norm_fn the
caduceus code calls are replaced by mamba-ssm's own references layer_norm_ref / rms_norm_ref with
the same arguments (fused_norm_fn below), which compute what the kernels compute. Every parameter
is perturbed.
"""
import argparse
import json
import os
import sys

from hf_common import SEQS, CodeFolders, import_reference

# Caduceus' character tokenizer: [CLS] 0 [SEP] 1 [BOS] 2 [MASK] 3 [PAD] 4 [RESERVED] 5 [UNK] 6,
# A C G T N = 7..11; its complement map swaps A/T and C/G.
COMPLEMENT = {i: i for i in range(7)}
COMPLEMENT.update({7: 10, 8: 9, 9: 8, 10: 7, 11: 11})
TINY = dict(d_model=16, n_layer=2, vocab_size=12, pad_vocab_size_multiple=8,
            ssm_cfg={"d_state": 4, "expand": 2, "dt_rank": "auto", "d_conv": 4},
            rms_norm=True, fused_add_norm=False, residual_in_fp32=False, norm_epsilon=1e-5,
            bidirectional=True, bidirectional_strategy="add", bidirectional_weight_tie=True,
            complement_map=COMPLEMENT, pad_token_id=4)


def ids_of(seqs):
    """The tokenizer's ids (characters, [SEP] appended, left padding), as the fixture's
    sequences need no special handling: every base is A/C/G/T/N."""
    table = {c: 7 + i for i, c in enumerate("ACGTN")}
    longest = max(len(s) for s in seqs) + 1
    return [[4] * (longest - len(s) - 1) + [table[c] for c in s] + [1] for s in seqs]


def fused_norm_fn(ref_module, is_rms_norm):
    """layer_norm_fn / rms_norm_fn (mamba_ssm/ops/triton/layer_norm.py) on the CPU: the add of the
    residual, the norm and the prenorm residual as the kernel returns them, by the repository's
    layer_norm_ref / rms_norm_ref. No dropout, rowscale or second input in Caduceus' calls."""
    ref = ref_module.rms_norm_ref if is_rms_norm else ref_module.layer_norm_ref

    def fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
           dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False,
           is_rms_norm=is_rms_norm, return_dropout_mask=False):
        assert x1 is None and weight1 is None and dropout_p == 0.0 and rowscale is None
        out = ref(x, weight, bias, residual=residual, eps=eps, prenorm=prenorm)
        if prenorm and residual_in_fp32:  # the kernel's residual_out is fp32 then
            out = (out[0], out[1].float())
        return out
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    code = CodeFolders(ap, ("--code", "DNALLM_CADUCEUS_CODE"), ("--mamba", "DNALLM_MAMBA_CPU"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if code.missing("make_caduceus_fixtures", args, "Caduceus fixtures not made"):
        return 0
    sys.path.insert(0, os.path.abspath(args.mamba))
    torch, transformers = import_reference(args.code, "caduceus_ref")
    from caduceus_ref.configuration_caduceus import CaduceusConfig
    from caduceus_ref.modeling_caduceus import CaduceusForMaskedLM, CaduceusForSequenceClassification
    from safetensors.torch import save_file, save_model
    import caduceus_ref.modeling_caduceus as modeling_caduceus
    import caduceus_ref.modeling_rcps as modeling_rcps
    import mamba_ssm.ops.triton.layer_norm as mamba_layer_norm
    for module in (modeling_caduceus, modeling_rcps):  # only the fused_add_norm path calls them
        module.layer_norm_fn = fused_norm_fn(mamba_layer_norm, False)
        module.rms_norm_fn = fused_norm_fn(mamba_layer_norm, True)

    cases = [("caduceus_ph_mlm", CaduceusForMaskedLM, dict(rcps=False)),
             ("caduceus_ps_mlm", CaduceusForMaskedLM, dict(rcps=True)),
             ("caduceus_ps_cls", CaduceusForSequenceClassification, dict(rcps=True, num_labels=3)),
             ("caduceus_ps_fused_mlm", CaduceusForMaskedLM, dict(rcps=True, fused_add_norm=True))]
    ids = torch.tensor(ids_of(SEQS))
    for index, (name, cls, extra) in enumerate(cases):
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        torch.manual_seed(args.seed + index)
        config = CaduceusConfig(**{**TINY, "complement_map": dict(COMPLEMENT), **extra})
        config.architectures = [cls.__name__]
        model = cls(config).eval()
        with torch.no_grad():
            for p in model.parameters():  # tied tensors are one parameter: moved once
                p.add_(torch.randn_like(p) * 0.05)
        config.save_pretrained(folder)
        save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()},
                  os.path.join(folder, "expected.safetensors"))
        with open(os.path.join(folder, "fixture.json"), "w") as f:
            json.dump({"family": name, "class": cls.__name__, "sequences": SEQS,
                       "input_ids": ids.tolist(), "logits_shape": list(logits.shape),
                       "made_by": "tests/hf/make_caduceus_fixtures.py (kuleshov-group/caduceus "
                                  "over mamba-ssm's selective_scan_ref" +
                                  (", layer_norm_fn/rms_norm_fn by layer_norm_ref/rms_norm_ref)"
                                   if extra.get("fused_add_norm") else ")")}, f, indent=1)
            f.write("\n")
        print(f"{name}: logits {list(logits.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
