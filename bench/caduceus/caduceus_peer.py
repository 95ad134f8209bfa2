#!/usr/bin/env python3
"""The reference's side of bench/caduceus/bench_caduceus.sh: kuleshov-group's Caduceus code over
mamba-ssm's Mamba with its pure-PyTorch scan (selective_scan_ref), laid out as
tests/hf/make_caduceus_fixtures.py describes (--code, --mamba; never committed), with the shape,
batch, length, loss and threads of dnallm-bench-caduceus. Prints one JSON line."""
import argparse
import json
import os
import resource
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "hf"))
from hf_common import add_time_steps_arguments, reference_package, time_steps  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", required=True)
    ap.add_argument("--mamba", required=True)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-state", type=int, default=16)
    add_time_steps_arguments(ap, seq=4096, steps=2)
    ap.add_argument("--rcps", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.mamba))
    import torch
    reference_package("caduceus_ref", args.code)
    from caduceus_ref.configuration_caduceus import CaduceusConfig
    from caduceus_ref.modeling_caduceus import CaduceusForMaskedLM
    torch.manual_seed(0)
    complement = {i: i for i in range(7)}
    complement.update({7: 10, 8: 9, 9: 8, 10: 7, 11: 11})
    config = CaduceusConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=12,
                            pad_vocab_size_multiple=8,
                            ssm_cfg={"d_state": args.d_state, "expand": 2, "d_conv": 4},
                            rms_norm=True, fused_add_norm=False, residual_in_fp32=False,
                            bidirectional=True, bidirectional_strategy="add",
                            bidirectional_weight_tie=True, rcps=args.rcps,
                            complement_map=complement)
    model = CaduceusForMaskedLM(config).train()
    ids = torch.randint(7, 12, (args.batch, args.seq))

    def step():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 ids.reshape(-1))
        model.zero_grad()
        loss.backward()

    s = time_steps(step, args.warmup, args.steps)
    print(json.dumps({"impl": "reference", "d_model": args.d_model, "layers": args.layers,
                      "rcps": args.rcps, "seq": args.seq, "batch": args.batch,
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "step_s": s, "tokens_per_s": args.batch * args.seq / s,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
