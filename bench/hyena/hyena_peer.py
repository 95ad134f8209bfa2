#!/usr/bin/env python3
"""The reference's side of bench/hyena/bench_hyena.sh: LongSafari's hub HyenaDNA code
(modeling_hyena.py; --code, never committed) with the shape, batch, length and threads of
dnallm-bench-hyena, forward + backward with the same loss. Prints one JSON line."""
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
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-inner", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    add_time_steps_arguments(ap, seq=32768, steps=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--checkpoint", action="store_true")
    args = ap.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    reference_package("hyena_ref", args.code)
    from hyena_ref.configuration_hyena import HyenaConfig
    from hyena_ref.modeling_hyena import HyenaDNAForCausalLM
    torch.manual_seed(0)
    config = HyenaConfig(vocab_size=12, d_model=args.d_model, d_inner=args.d_inner,
                         n_layer=args.layers, max_seq_len=args.seq + 2, emb_dim=5,
                         filter_order=64, activation_freq=10, embed_dropout=0.0,
                         pad_token_id=4)
    model = HyenaDNAForCausalLM(config).train()
    if args.checkpoint:
        model.gradient_checkpointing_enable()
    ids = torch.randint(7, 12, (args.batch, args.seq))

    def step():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        model.zero_grad()
        loss.backward()

    s = time_steps(step, args.warmup, args.steps)
    print(json.dumps({"impl": "reference", "d_model": args.d_model, "layers": args.layers,
                      "seq": args.seq, "batch": args.batch, "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "step_s": s,
                      "tokens_per_s": args.batch * args.seq / s,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
