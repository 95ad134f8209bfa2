#!/usr/bin/env python3
"""PyTorch peer for bench/infer/bench_embed.sh: mean-pooled embeddings of every sequence of a
FASTA file with the weights of a dnallm export (model.safetensors, pre-LN BERT, char tokens),
computed by the loop a Hugging Face user writes: batches of --batch sequences in file order,
each padded to its longest row, [CLS] seq [SEP], under torch.no_grad(), with the model classes
of bench/train/torch_peer.py. --variant: "eager" (explicit matmul/softmax attention), "sdpa"
(F.scaled_dot_product_attention, the padding mask as an additive bias, none when nothing is
padded) or "compile" (sdpa under torch.compile(dynamic=True): every batch has another padded
length). Writes the embeddings as .npy and prints one JSON line with the loop's time (reading
the FASTA and loading the model excluded; for "compile" the compilation is inside the loop,
as a user meets it, and also reported apart as first_batch_s)."""
import argparse
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))
from torch_peer import CHAR, CLS, PAD, SEP, UNK, Block, attention_bias  # noqa: E402


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (name, info["dtype"])
        a, b = info["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[a:b], dtype=np.float32).copy()).view(
            info["shape"])
    return out


class Encoder(torch.nn.Module):
    def __init__(self, cfg, w, attn="eager"):
        super().__init__()
        self.attn = attn
        h = cfg["hidden_size"]
        self.tok = torch.nn.Embedding.from_pretrained(w["bert.embeddings.word_embeddings.weight"])
        self.pos = torch.nn.Embedding.from_pretrained(w["bert.embeddings.position_embeddings.weight"])
        self.blocks = torch.nn.ModuleList()
        for i in range(cfg["num_hidden_layers"]):
            b = Block(h, cfg["num_attention_heads"], cfg["intermediate_size"], attn)
            p = f"bert.encoder.layer.{i}."
            names = {"ln1": "attention.output.LayerNorm", "q": "attention.self.query",
                     "k": "attention.self.key", "v": "attention.self.value",
                     "o": "attention.output.dense", "ln2": "output.LayerNorm",
                     "fc1": "intermediate.dense", "fc2": "output.dense"}
            for attr, ours in names.items():
                m = getattr(b, attr)
                m.weight.data.copy_(w[p + ours + ".weight"])
                m.bias.data.copy_(w[p + ours + ".bias"])
            self.blocks.append(b)
        self.ln = torch.nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))
        self.ln.weight.data.copy_(w["bert.encoder.final_layer_norm.weight"])
        self.ln.bias.data.copy_(w["bert.encoder.final_layer_norm.bias"])

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        bias = attention_bias(mask, self.attn)
        for blk in self.blocks:
            x = blk(x, bias)
        return self.ln(x)


def read_fasta(path):
    seqs, cur = [], []
    with open(path) as f:
        for line in f:
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur))
                cur = []
            else:
                cur.append(line.strip().upper())
    if cur:
        seqs.append("".join(cur))
    return seqs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--variant", choices=["eager", "sdpa", "compile"], default="eager")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    attn = "eager" if args.variant == "eager" else "sdpa"
    model = Encoder(cfg, load_safetensors(os.path.join(args.model, "model.safetensors")),
                    attn).eval()
    if args.variant == "compile":
        model = torch.compile(model, dynamic=True)
    seqs = read_fasta(args.fasta)
    budget = cfg["max_position_embeddings"] - 2
    t0 = time.perf_counter()
    out = []
    first_batch_s = None
    with torch.no_grad():
        for s in range(0, len(seqs), args.batch):
            rows = [[CLS] + [CHAR.get(c, UNK) for c in q[:budget]] + [SEP]
                    for q in seqs[s:s + args.batch]]
            t = max(len(r) for r in rows)
            ids = torch.full((len(rows), t), PAD, dtype=torch.long)
            mask = torch.zeros((len(rows), t), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r)
                mask[i, :len(r)] = 1
            hidden = model(ids, mask)
            m = mask.unsqueeze(-1).float()
            out.append(((hidden * m).sum(1) / m.sum(1)).numpy())
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - t0
    emb = np.concatenate(out)
    elapsed = time.perf_counter() - t0
    np.save(args.out, emb)
    print(json.dumps({"peer": "pytorch", "variant": args.variant, "torch": torch.__version__,
                      "first_batch_s": first_batch_s,
                      "threads": torch.get_num_threads(), "sequences": len(seqs),
                      "loop_s": elapsed, "seq_per_s": len(seqs) / elapsed}))


if __name__ == "__main__":
    main()
