"""PyTorch DDP over Gloo on the bench-cpu model: the peer for bench/ddp/bench_ddp.sh.

Same model, initialisation and batch drawing as bench/train/torch_peer.py; each rank draws its
own micro-batch of `--batch` sequences; torch.nn.parallel.DistributedDataParallel with its
default 25 MB buckets overlaps the all-reduce with backward. --variant as torch_peer.py:
"eager", "sdpa-fused" (SDPA attention, AdamW(fused=True)) or "compile" (sdpa-fused, the DDP
model under torch.compile, whose DDPOptimizer splits the graph at bucket boundaries so the
all-reduce still overlaps backward). Prints one JSON object (rank 0).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))
from torch_peer import (VARIANTS, BertMLM, add_step_arguments, make_optimizer,  # noqa: E402
                        read_genome, timed_steps)


def worker(rank, args, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(1)
    genome = read_genome(args.fasta)
    rng = torch.Generator().manual_seed(1 + rank)
    attn, fused, compiled = VARIANTS[args.variant]
    model = torch.nn.parallel.DistributedDataParallel(BertMLM(seq=args.seq, attn=attn))
    opt = make_optimizer(model, fused)
    if compiled:
        model = torch.compile(model)
    times, final_loss = timed_steps(model, opt, genome, rng, args.warmup, args.steps, args.batch,
                                    args.seq)
    if rank == 0:
        med = statistics.median(times)
        out.put({"peer": "pytorch-ddp-gloo", "variant": args.variant, "torch": torch.__version__, "world": args.world,
                 "threads_per_rank": torch.get_num_threads(), "step_s": times,
                 "step_s_median": med,
                 "tokens_per_s": args.world * args.batch * args.seq / med,
                 "final_loss": final_loss})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    add_step_arguments(ap, warmup=2, steps=4, threads=1, variant="eager")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=29631)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(worker, args=(args, out), nprocs=args.world)
    print(json.dumps(out.get()))


if __name__ == "__main__":
    main()
