#!/usr/bin/env python3
"""The Python peer of bench/infer/bench_variants.sh's embedding rows: mean-pooled final hidden
states of every sequence of a FASTA file with a Hugging Face directory, by the loop a
transformers user writes: batches of --batch sequences in file order, the tokenizer padding each
to its longest row, the base model (model.base_model) under torch.no_grad(), the mean over the
attention mask. Writes the embeddings as .npy and prints one JSON line with the loop's time
(reading the FASTA and loading the model excluded).
  hub_embed_peer.py --model DIR --fasta F.fa --batch 32 --threads N --out peer.npy"""
import argparse
import json
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer, EsmTokenizer

from variants_peer import read_fasta


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = json.load(open(f"{args.model}/config.json"))
    causal = "ForCausalLM" in config["architectures"][0]
    tok = (EsmTokenizer.from_pretrained(args.model) if config["model_type"] == "esm"
           else AutoTokenizer.from_pretrained(args.model))
    model = (AutoModelForCausalLM if causal else AutoModelForMaskedLM).from_pretrained(
        args.model).eval().base_model
    seqs = list(read_fasta(args.fasta).values())
    out = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(seqs), args.batch):
            inputs = tok(seqs[i:i + args.batch], padding=True, return_tensors="pt")
            hidden = model(input_ids=inputs["input_ids"],
                           attention_mask=inputs["attention_mask"]).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            out.append(((hidden * mask).sum(1) / mask.sum(1)).numpy())
    seconds = time.perf_counter() - start
    np.save(args.out, np.concatenate(out))
    print(json.dumps({"sequences": len(seqs), "seconds": seconds,
                      "seq_per_s": len(seqs) / seconds, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
