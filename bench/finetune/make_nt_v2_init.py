#!/usr/bin/env python3
"""A freshly initialised Nucleotide Transformer v2 directory of a chosen size, made with NT-v2's
remote code (--nt-v2-code DIR or DNALLM_NT_V2_CODE; tests/hf/hf_common.py import_nt_v2) from the
shape of tests/data/hf-fixtures/esm_v2_mlm (its 6-mer vocabulary and tokenizer files), for
bench/finetune/parity.sh: dnallm-train pre-trains it (model.init_from) and exports it back in
NT-v2's layout, the NT-v2-shaped base both fine-tuning systems start from.

  make_nt_v2_init.py --out DIR [--hidden 128] [--layers 4] [--heads 4] [--ffn 256]
                     [--max-positions 130] [--seed 0]
"""
import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "hf"))
from hf_common import import_nt_v2, nt_v2_code_dir  # noqa: E402

FIXTURE = os.path.join(ROOT, "tests", "data", "hf-fixtures", "esm_v2_mlm")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--nt-v2-code", default=None)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--max-positions", type=int, default=130)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    code = nt_v2_code_dir(a.nt_v2_code)
    if code is None:
        sys.exit("SKIP: no Nucleotide Transformer v2 code (--nt-v2-code DIR or DNALLM_NT_V2_CODE)")
    import torch
    from safetensors.torch import save_file
    modeling = import_nt_v2(code)
    with open(os.path.join(FIXTURE, "config.json")) as f:
        c = json.load(f)
    c.update(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
             intermediate_size=a.ffn, max_position_embeddings=a.max_positions)
    config_cls = sys.modules["nt_v2_remote.esm_config"].EsmConfig
    torch.manual_seed(a.seed)
    model = modeling.EsmForMaskedLM(config_cls(**{k: v for k, v in c.items()
                                                   if k not in ("auto_map", "architectures")}))
    os.makedirs(a.out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    for name in os.listdir(FIXTURE):
        if name.startswith(("vocab", "tokenizer", "special_tokens")):
            shutil.copyfile(os.path.join(FIXTURE, name), os.path.join(a.out, name))
    print(f"make_nt_v2_init: {a.out}: NT-v2 hidden {a.hidden} x {a.layers} layers, "
          f"{sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
