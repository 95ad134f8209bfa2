#!/usr/bin/env python3
"""Synthetic genomes shaped like real assemblies, for bench/data/bench_store.sh.

Each file holds `--contigs` contigs of decreasing length (like chromosomes), 60 bases a line,
with N runs at both ends (telomeres, up to 10 kbases) and long N gaps inside (~4% N), and about half the
bases soft-masked (lower case) in runs of 300-6,000 bases (repeats). Streams: memory stays a few
MB whatever --bases. Deterministic for a --seed.

  make_genome.py --bases 300e6 --out /tmp/g.fa.gz             # one gzip file (gzip -1)
  make_genome.py --bases 3e9 --files 300 --out /tmp/corpus/g   # g_000.fa.gz ... g_299.fa.gz
"""
import argparse
import random
import subprocess
import sys

LINE = 60
CHUNK = LINE * 16384  # bases generated at a time (a multiple of the line width)
UPPER = bytes.maketrans(bytes(range(256)), bytes(b"ACGT"[i % 4] for i in range(256)))
LOWER = bytes.maketrans(bytes(range(256)), bytes(b"acgt"[i % 4] for i in range(256)))


def contig_lengths(total, count):
    """Lengths summing to `total`, decreasing like chromosome sizes (weights 1 .. 1/3)."""
    weights = [1.0 - 0.67 * i / max(1, count - 1) for i in range(count)]
    scale = total / sum(weights)
    lengths = [max(1, int(w * scale)) for w in weights]
    lengths[0] += total - sum(lengths)
    return lengths


class Contig:
    """Streams one contig's bases in chunks: repeats soft-masked, N at the ends and in gaps."""

    def __init__(self, length, rng):
        self.length, self.rng = length, rng
        self.telomere = min(10_000, length // 50)
        gaps = max(1, length // 20_000_000)  # about 4% of the bases in gaps, as in hg38
        self.gaps = sorted(
            (rng.randrange(self.telomere, max(self.telomere + 1, length - self.telomere)),
             rng.randrange(min(length // 200 + 1, 500_000), min(500_000, length // 50) + 2))
            for _ in range(gaps))
        self.lower = False
        self.run_left = rng.randrange(300, 6000)

    def chunk(self, start, n):
        raw = self.rng.randbytes(n)
        up, lo = raw.translate(UPPER), raw.translate(LOWER)
        pieces, at = [], 0
        while at < n:  # alternate upper and lower-case runs
            take = min(self.run_left, n - at)
            pieces.append((lo if self.lower else up)[at:at + take])
            at += take
            self.run_left -= take
            if self.run_left == 0:
                self.lower = not self.lower
                self.run_left = self.rng.randrange(300, 6000)
        seq = bytearray(b"".join(pieces))
        for g_start, g_len in [(0, self.telomere), (self.length - self.telomere, self.telomere)] + \
                self.gaps:
            lo_, hi_ = max(g_start, start), min(g_start + g_len, start + n, self.length)
            if lo_ < hi_:
                seq[lo_ - start:hi_ - start] = b"N" * (hi_ - lo_)
        return bytes(seq)


def write_file(path, bases, contigs, rng, name_prefix):
    with open(path, "wb") as out:
        gz = subprocess.Popen(["gzip", "-1", "-c"], stdin=subprocess.PIPE, stdout=out)
        for c, length in enumerate(contig_lengths(bases, contigs)):
            gz.stdin.write(f">{name_prefix}chr{c + 1} synthetic length={length}\n".encode())
            contig = Contig(length, rng)
            for start in range(0, length, CHUNK):
                seq = contig.chunk(start, min(CHUNK, length - start))
                gz.stdin.write(b"\n".join(seq[i:i + LINE] for i in range(0, len(seq), LINE)))
                gz.stdin.write(b"\n")
        gz.stdin.close()
        if gz.wait() != 0:
            sys.exit(f"make_genome.py: gzip failed writing {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bases", type=float, required=True, help="bases in all (e.g. 3e8)")
    p.add_argument("--contigs", type=int, default=24, help="contigs a file (default 24)")
    p.add_argument("--files", type=int, default=1, help="files (default 1: --out is the file)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True, help="the .fa.gz file, or the prefix with --files")
    a = p.parse_args()
    rng = random.Random(a.seed)
    total = int(a.bases)
    if a.files == 1:
        write_file(a.out, total, a.contigs, rng, "")
        return
    per_file = contig_lengths(total, a.files)
    for f, bases in enumerate(per_file):
        write_file(f"{a.out}_{f:03d}.fa.gz", bases, a.contigs, rng, f"g{f:03d}_")


if __name__ == "__main__":
    main()
