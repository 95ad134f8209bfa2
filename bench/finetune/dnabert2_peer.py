#!/usr/bin/env python3
"""The peer of bench/finetune/bench_dnabert2.sh: full fine-tuning of a DNABERT-2 directory with
DNABERT-2's own remote code (bert_layers.BertForSequenceClassification through
AutoModelForSequenceClassification, trust_remote_code, its PyTorch attention path on the CPU;
tests/hf/dnabert2_reference.py installs it with its two shims) in a plain PyTorch loop: AdamW,
constant learning rate, the CSV's rows in order, `--batch` a step, fp32. Prints one JSON line:
train_s (the loop's wall time), tokens (non-padding tokens trained on), final loss, versions.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "hf"))
import dnabert2_reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a DNABERT-2 directory (our final/hf)")
    ap.add_argument("--dnabert2-ref", required=True, help="DNABERT-2's remote code")
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ref = dnabert2_reference.reference_dir(args.dnabert2_ref)
    tmp = tempfile.mkdtemp()
    model_dir = dnabert2_reference.with_code(ref, args.model, tmp)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, trust_remote_code=True, num_labels=2).train()
    rows = []
    with open(args.train_csv) as f:
        header = f.readline().strip().split(",")
        si, li = header.index("sequence"), header.index("label")
        for line in f:
            parts = line.strip().split(",")
            rows.append((parts[si], int(parts[li])))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    batches = []
    for step in range(args.steps):
        chunk = [rows[(step * args.batch + i) % len(rows)] for i in range(args.batch)]
        enc = tok([s for s, _ in chunk], padding=True, return_tensors="pt")
        batches.append((enc["input_ids"], enc["attention_mask"],
                        torch.tensor([l for _, l in chunk])))
    tokens = sum(int(m.sum()) for _, m, _ in batches)
    start = time.perf_counter()
    loss = None
    for ids, mask, labels in batches:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()
    train_s = time.perf_counter() - start
    print(json.dumps({"train_s": train_s, "tokens": tokens, "train_loss": loss,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
