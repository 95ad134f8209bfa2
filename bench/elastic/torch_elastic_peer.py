"""The torchrun peer of bench/elastic: a small BERT-style masked LM under PyTorch DDP over
Gloo, started by `python3 -m torch.distributed.run`, that resumes from a torch.save
checkpoint (rank 0 saves every --save-steps steps: temporary file, then rename).

Rank 0 appends JSON lines to --metrics: {"event":"restart","generation":G} when
TORCHELASTIC_RESTART_COUNT > 0, then {"step":S,"loss":L,"t":wall-clock} per step, and
{"event":"checkpoint","step":S} after each save, the same events dnallm-train writes.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


class TinyMLM(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, ffn, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        return self.head(self.encoder(self.tok(x) + self.pos(pos)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--steps", type=int, default=1000000)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--micro", type=int, default=6)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, seq = 8, 64
    torch.manual_seed(7)
    model = TinyMLM(vocab, 32, 2, 2, 64, seq)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    step = 0
    if os.path.exists(a.ckpt):
        state = torch.load(a.ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = state["step"]
    metrics = open(a.metrics, "a") if rank == 0 else None

    def log(line):
        if metrics:
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts > 0:
        log({"event": "restart", "generation": restarts + 1, "resumed_step": step})
    while step < a.steps:
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randint(0, vocab, (a.micro, seq), generator=g)
        mask = torch.rand(a.micro, seq, generator=g) < 0.15
        inputs = x.masked_fill(mask, vocab - 1)
        logits = ddp(inputs)
        loss = nn.functional.cross_entropy(logits[mask], x[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        log({"step": step, "loss": loss.item(), "t": time.time()})
        if rank == 0 and step % a.save_steps == 0:
            tmp = a.ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, a.ckpt)
            log({"event": "checkpoint", "step": step})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
