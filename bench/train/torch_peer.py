#!/usr/bin/env python3
"""PyTorch peer for bench/train: the bench-cpu model (BERT masked LM, pre-LN, learned
positions, GELU, tied MLM decoder, char tokens) trained with torch.optim.AdamW on batches of
the same shape drawn the same way (random genome windows, [CLS] w [SEP], 15% masking with
80/10/10), full-sequence MLM logits: what a Hugging Face BertForMaskedLM run does.
Variants (--variant): "eager" (explicit matmul/softmax attention, torch.optim.AdamW's default
for-loop update: the peer as it was against torch 1.13), "sdpa-fused" (F.scaled_dot_product_attention
as HF's attn_implementation="sdpa" calls it, the mask dropped when nothing is padded, and
AdamW(fused=True), torch's fused CPU kernel, torch >= 2.4) and "compile" (sdpa-fused with the
model under torch.compile, inductor's C++ CPU backend; compilation happens in the warm-up steps).
Prints one JSON line with the median step time and tokens/s."""
import argparse
import gzip
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
CHAR = {"A": 5, "C": 6, "G": 7, "T": 8, "N": 9}
VOCAB = 10


def attention_bias(mask, attn):
    """Additive key mask [B, 1, 1, T]; for sdpa None when nothing is padded (as HF's sdpa path
    and dnallm-train do, so the kernel runs unmasked). Under torch.compile the host check is a
    graph break before the blocks."""
    if attn == "sdpa" and bool(mask.all()):
        return None
    return (1.0 - mask[:, None, None, :].float()) * -1e9


class Block(nn.Module):
    def __init__(self, h, heads, ffn, attn="eager"):
        super().__init__()
        self.heads = heads
        self.attn = attn
        self.ln1 = nn.LayerNorm(h, eps=1e-12)
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.o = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h, eps=1e-12)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x, bias):
        b, t, h = x.shape
        d = h // self.heads
        y = self.ln1(x)
        q = self.q(y).view(b, t, self.heads, d).transpose(1, 2)
        k = self.k(y).view(b, t, self.heads, d).transpose(1, 2)
        v = self.v(y).view(b, t, self.heads, d).transpose(1, 2)
        if self.attn == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            if bias is not None:
                s = q @ k.transpose(-1, -2) / math.sqrt(d) + bias
            else:
                s = q @ k.transpose(-1, -2) / math.sqrt(d)
            a = s.softmax(-1) @ v
        a = a.transpose(1, 2).reshape(b, t, h)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BertMLM(nn.Module):
    def __init__(self, h=256, layers=4, heads=4, ffn=1024, seq=512, attn="eager"):
        super().__init__()
        self.attn = attn
        self.tok = nn.Embedding(VOCAB, h)
        self.pos = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, ffn, attn) for _ in range(layers))
        self.ln = nn.LayerNorm(h, eps=1e-12)
        self.dense = nn.Linear(h, h)
        self.ln_head = nn.LayerNorm(h, eps=1e-12)
        self.bias = nn.Parameter(torch.zeros(VOCAB))
        for m in self.modules():  # the same initialisation as dnallm-train (BERT's)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, ids, mask, labels):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        bias = attention_bias(mask, self.attn)
        for blk in self.blocks:
            x = blk(x, bias)
        x = self.ln_head(F.gelu(self.dense(self.ln(x))))
        logits = F.linear(x, self.tok.weight, self.bias)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)


def read_genome(path):
    opener = gzip.open if path.endswith(".gz") else open
    parts = []
    with opener(path, "rt") as f:
        for line in f:
            if not line.startswith(">"):
                parts.append(line.strip().upper())
    return "".join(parts)


def make_batch(genome, rows, seq, rng):
    ids = torch.full((rows, seq), PAD, dtype=torch.long)
    labels = torch.full((rows, seq), -100, dtype=torch.long)
    w = seq - 2
    for r in range(rows):
        start = int(torch.randint(0, len(genome) - w, (1,), generator=rng))
        toks = torch.tensor([CHAR.get(c, UNK) for c in genome[start:start + w]])
        ids[r, 0], ids[r, 1:w + 1], ids[r, w + 1] = CLS, toks, SEP
        sel = torch.rand(w, generator=rng) < 0.15
        labels[r, 1:w + 1][sel] = toks[sel]
        u = torch.rand(w, generator=rng)
        body = ids[r, 1:w + 1]
        body[sel & (u < 0.8)] = MASK
        rnd = sel & (u >= 0.8) & (u < 0.9)
        body[rnd] = torch.randint(5, 9, (int(rnd.sum()),), generator=rng)
    return ids, torch.ones_like(ids), labels


VARIANTS = {  # name: (attention, fused AdamW, torch.compile)
    "eager": ("eager", False, False),
    "sdpa-fused": ("sdpa", True, False),
    "compile": ("sdpa", True, True),
}


def make_optimizer(model, fused=False):
    """AdamW lr 3e-4, weight decay 0.01 on matrices only (as dnallm's flat AdamW); fused=True
    takes torch's fused kernel (CPU since torch 2.4)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                              {"params": no_decay, "weight_decay": 0.0}], lr=3e-4, **extra)


def build(variant, seq):
    """(model to call, optimizer) for a variant of VARIANTS."""
    attn, fused, compiled = VARIANTS[variant]
    model = BertMLM(seq=seq, attn=attn)
    opt = make_optimizer(model, fused)
    return (torch.compile(model) if compiled else model), opt


def timed_steps(model, opt, genome, rng, warmup, steps, batch, seq):
    """Runs warmup + steps optimizer steps; returns (timed step seconds, last loss)."""
    times = []
    for step in range(warmup + steps):
        ids, mask, labels = make_batch(genome, batch, seq, rng)
        t0 = time.perf_counter()
        loss = model(ids, mask, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
    return times, loss.item()


def add_step_arguments(ap, warmup, steps, threads, variant, variants=VARIANTS):
    """The options of every bench-cpu peer (this one, torch_ddp_peer.py, torch_fsdp_peer.py):
    the genome, the warm-up and timed steps, threads, the batch's shape and the variant (one of
    `variants`)."""
    ap.add_argument("--fasta", default="data/ecoli_k12_mg1655.fa.gz")
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--variant", choices=sorted(variants), default=variant)


def main():
    ap = argparse.ArgumentParser()
    add_step_arguments(ap, warmup=3, steps=5, threads=0, variant="eager")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    genome = read_genome(args.fasta)
    rng = torch.Generator().manual_seed(1)
    model, opt = build(args.variant, args.seq)
    times, final_loss = timed_steps(model, opt, genome, rng, args.warmup, args.steps,
                                    args.batch, args.seq)
    med = statistics.median(times)
    print(json.dumps({"peer": "pytorch", "variant": args.variant, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "step_s_median": med,
                      "step_s_min": min(times), "step_s": times,
                      "tokens_per_s": args.batch * args.seq / med, "final_loss": final_loss}))


if __name__ == "__main__":
    main()
