#!/usr/bin/env python3
"""Peer for dnallm-bench-ckpt: torch.save / torch.load of the very same tensors.

Usage: torch_peer.py LAYOUT_JSON DATA_BIN OUT_FILE ITERS
LAYOUT_JSON: [{"name", "dtype": "fp32"|"bf16", "numel", "offset"}] into DATA_BIN.
Prints one JSON line: median save_s (torch.save + flush + fsync) and load_s.
"""
import json
import os
import statistics
import sys
import time

import numpy as np
import torch


def main():
    layout_path, data_path, out_path, iters = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    layout = json.load(open(layout_path))
    raw = np.fromfile(data_path, dtype=np.uint8)
    state = {}
    for t in layout:
        nbytes = t["numel"] * (4 if t["dtype"] == "fp32" else 2)
        chunk = raw[t["offset"]:t["offset"] + nbytes]
        if t["dtype"] == "fp32":
            state[t["name"]] = torch.from_numpy(chunk.view(np.float32).copy())
        else:  # bf16: reinterpret int16 bits
            state[t["name"]] = torch.from_numpy(chunk.view(np.int16).copy()).view(torch.bfloat16)
    total = sum(v.numel() * v.element_size() for v in state.values())
    saves, loads = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        with open(out_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loaded = torch.load(out_path)
        loads.append(time.perf_counter() - t0)
        assert all(torch.equal(loaded[k].view(torch.int16) if loaded[k].dtype == torch.bfloat16
                               else loaded[k], state[k].view(torch.int16)
                               if state[k].dtype == torch.bfloat16 else state[k])
                   for k in list(state)[:3])
    print(json.dumps({"bytes": total, "file_bytes": os.path.getsize(out_path),
                      "save_s": statistics.median(saves), "load_s": statistics.median(loads)}))
    os.remove(out_path)


if __name__ == "__main__":
    main()
