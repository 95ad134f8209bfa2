#!/usr/bin/python3
"""torch.distributed all_reduce (Gloo) sweep: the PyTorch peer for dnallm-bench-comm.

Started like torchrun workers (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment). Prints one JSON object per size from rank 0, with the same fields as
`dnallm-bench-comm --json`. Every element of the result is checked.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    size = a.min_bytes
    while size <= a.max_bytes:
        count = size // 4
        idx = torch.arange(count, dtype=torch.int64)
        src = ((idx % 7) + 1 + rank).to(torch.float32)
        want = ((idx % 7) + 1).to(torch.float32) * world + world * (world - 1) / 2
        times = []
        for it in range(a.warmup + a.iters):
            buf = src.clone()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            dt = (time.perf_counter() - t0) * 1e6
            if it >= a.warmup:
                times.append(dt)
        wrong = torch.tensor([int((buf != want).sum())])
        dist.all_reduce(wrong)
        t = statistics.median(times)
        algbw = size / (t * 1e3)
        if rank == 0:
            print(json.dumps({"backend": "torch-gloo", "op": "allreduce", "dtype": "fp32",
                              "redop": "sum", "world_size": world, "bytes": size,
                              "count": count, "time_us": t, "algbw_gbs": algbw,
                              "busbw_gbs": algbw * 2 * (world - 1) / world,
                              "wrong": int(wrong.item())}), flush=True)
        size *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
