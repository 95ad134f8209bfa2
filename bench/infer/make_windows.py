#!/usr/bin/env python3
"""Writes N windows of the bundled E. coli genome, of random lengths in [MIN_LEN, MAX_LEN]
bases (seed 1), as FASTA: the input of the embedding benchmarks (bench/infer, bench/gpu).
  make_windows.py OUT.fa N MIN_LEN MAX_LEN"""
import gzip
import random
import sys

path, n, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
genome = "".join(line.strip() for line in gzip.open("data/ecoli_k12_mg1655.fa.gz", "rt")
                 if not line.startswith(">"))
rng = random.Random(1)
with open(path, "w") as f:
    for i in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(genome) - length)
        f.write(f">w{i}\n{genome[start:start + length]}\n")
