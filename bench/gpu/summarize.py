#!/usr/bin/env python3
"""The bench/gpu table from the raw results bench_gpu.sh wrote.

usage: summarize.py OUT WARMUP ROUNDS MICRO...
OUT holds ours_<mb>_<r>.jsonl (dnallm-train metrics), peer_<mb>_<r>.out (hf_peer.py's JSON)
and <name>.mem (peak MiB by nvidia-smi) for each run."""
import json
import math
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_peer import flops_per_token, peak_flops  # noqa: E402

SHAPE = dict(layers=12, hidden=768, seq=512)


def read_mem(path):
    try:
        v = float(open(path).read().strip() or 0)
        return v if v > 0 else float("nan")
    except OSError:
        return float("nan")


def device_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return ""


def ours(out, mb, warmup, rounds, peak):
    steps, mfus, loss, params, self_peak = [], [], float("nan"), 0, float("nan")
    mem = float("nan")
    for r in range(1, rounds + 1):
        path = f"{out}/ours_{mb}_{r}.jsonl"
        if not os.path.exists(path):
            continue
        for line in open(path):
            j = json.loads(line)
            ev = j.get("event")
            if ev is None and j["step"] > warmup:
                steps.append(j["step_s"])
                if "mfu" in j:
                    mfus.append(j["mfu"])
                loss = j["loss"]
            elif ev == "memory":
                params = j.get("parameters", params)
            elif ev == "summary":
                self_peak = j.get("peak_gpu_mb", self_peak)
        m = read_mem(f"{out}/ours_{mb}_{r}.mem")
        mem = m if math.isnan(mem) else max(mem, m)
    if not steps:
        return None
    median = statistics.median(steps)
    tps = mb * SHAPE["seq"] / median
    mfu = statistics.median(mfus) if mfus else \
        tps * flops_per_token(params, **SHAPE) / peak
    return dict(name="dnallm-train", steps=len(steps), median=median, tps=tps, mfu=mfu,
                mem=mem, self_mem=self_peak, loss=loss)


def peer(out, mb, rounds):
    steps, r_last, mem = [], None, float("nan")
    for r in range(1, rounds + 1):
        try:
            j = json.loads(open(f"{out}/peer_{mb}_{r}.out").read().strip().splitlines()[-1])
        except (OSError, IndexError, ValueError):
            continue
        steps += [j["median_step_s"]]
        r_last = j
        m = read_mem(f"{out}/peer_{mb}_{r}.mem")
        mem = m if math.isnan(mem) else max(mem, m)
    if r_last is None:
        return None
    median = statistics.median(steps)
    tps = mb * SHAPE["seq"] / median
    return dict(name=f"{r_last['impl']} (torch {r_last['torch']}, tf {r_last['transformers']})",
                steps=r_last["steps"] * rounds, median=median, tps=tps,
                mfu=tps * r_last["flops_per_token"] / peak_flops(r_last["device"]),
                mem=mem, self_mem=r_last["peak_allocated_mb"], loss=r_last["loss_last"])


def main():
    out, warmup, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    micro = [int(m) for m in sys.argv[4:]]
    name = device_name()
    for f in sorted(os.listdir(out)):  # else the device the peer ran on
        if not name and f.startswith("peer_") and f.endswith(".out"):
            try:
                name = json.loads(open(os.path.join(out, f)).read().splitlines()[-1])["device"]
            except (ValueError, KeyError, IndexError):
                pass
    peak = peak_flops(name)
    head = (f"{'micro':>5} {'impl':<44}{'steps':>6}{'median_s':>10}{'tokens/s':>10}"
            f"{'MFU':>7}{'peak MiB':>10}{'alloc MiB':>10}{'loss':>8}")
    print(head)
    ratios = []
    for mb in micro:
        a, b = ours(out, mb, warmup, rounds, peak), peer(out, mb, rounds)
        for row in (a, b):
            if row is None:
                print(f"{mb:>5} {'(failed: see the logs)':<44}")
                continue
            print(f"{mb:>5} {row['name'][:43]:<44}{row['steps']:>6}{row['median']:>10.4f}"
                  f"{row['tps']:>10.0f}{row['mfu'] * 100:>6.1f}%{row['mem']:>10.0f}"
                  f"{row['self_mem'] if row['self_mem'] is not None else float('nan'):>10.0f}"
                  f"{row['loss']:>8.3f}")
        if a and b:
            ratios.append((mb, a["tps"] / b["tps"], a["mem"] / b["mem"]))
    for mb, tps, mem in ratios:
        print(f"micro-batch {mb}: ours / peer tokens/s = {tps:.2f}x, peak memory = {mem:.2f}x")


if __name__ == "__main__":
    main()
