#!/usr/bin/env python3
"""The Hugging Face peer of `dnallm-infer embed`: transformers' AutoModel on our export
(<final>/hf), mean pooling over real tokens, batches in input order, on one GPU (or CPU).
Prints one JSON line: sequences, seconds (the embedding loop, after loading and one warm-up
batch), seq_per_s, and writes the embeddings as .npy for the caller to compare."""
import argparse
import json
import time

import numpy as np
import torch
import transformers


def read_fasta(path):
    seqs, cur = [], []
    for line in open(path):
        line = line.strip()
        if line.startswith(">"):
            if cur:
                seqs.append("".join(cur))
            cur = []
        elif line:
            cur.append(line)
    if cur:
        seqs.append("".join(cur))
    return seqs


def tokenizer_input(tok_dir, seqs):
    with open(f"{tok_dir}/tokenizer_config.json") as f:
        how = json.load(f).get("dnallm_input", "the bases as they are")
    if how.startswith("overlapping "):
        k = int(how.split()[1].split("-")[0])
        return [" ".join(s[i:i + k] for i in range(len(s) - k + 1)) for s in seqs]
    return seqs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="our export's hf/ folder")
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    model = transformers.AutoModel.from_pretrained(a.model, attn_implementation="sdpa",
                                                   torch_dtype=dtype).to(a.device).eval()
    seqs = read_fasta(a.fasta)
    texts = tokenizer_input(a.model, seqs)

    def run(batch_texts):
        # truncation=True: cut at the export's model_max_length (the model's max_seq_length),
        # [CLS] first 510 tokens [SEP], as dnallm-infer does.
        enc = tok(batch_texts, return_tensors="pt", padding=True, truncation=True).to(a.device)
        hidden = model(**enc).last_hidden_state.float()
        m = enc["attention_mask"].unsqueeze(-1).float()
        return (hidden * m).sum(1) / m.sum(1)

    with torch.inference_mode():
        run(texts[:a.batch])  # warm-up
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = [run(texts[i:i + a.batch]).cpu() for i in range(0, len(texts), a.batch)]
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    np.save(a.out, torch.cat(out).numpy())
    print(json.dumps({"sequences": len(seqs), "seconds": seconds,
                      "seq_per_s": len(seqs) / seconds}))


if __name__ == "__main__":
    main()
