#!/usr/bin/env python3
"""BPE encode throughput (bases/s): ours (HfTokenizer, worker/data/hf_bpe.cpp, through
tests/hf/hf_tokenize_tool --time) vs the tokenizers library, one thread each, on 1 Mb of the
bundled E. coli genome, with a DNABERT-2-layout tokenizer (vocabulary 4096, Whitespace,
[CLS] $A [SEP]) that the library trains on another 1 Mb of it. Two shapes: 1,000 windows of
1 kb (fine-tuning inputs) and one 1 Mb sequence (a long input: one BPE word). Best of ROUNDS
for each; the library's word cache is cleared before each timed pass (our encoder has none).
Checks that both give the same ids, then prints the ratio ours / library (> 1: ours faster).

  bench/data/bench_bpe.sh [build dir] [--dir TOKENIZER_DIR]    (env: ROUNDS, default 3)
--dir: a downloaded tokenizer directory (zhihan1996/DNABERT-2-117M) instead of the trained one.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "hf"))
from check_bpe import genome, train, write_dir  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", "3")))
    ap.add_argument("--dir", help="a tokenizer directory to use instead of training one")
    a = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    import tokenizers as tk
    g = genome(os.path.join(a.source_dir, "data", "ecoli_k12_mg1655.fa.gz"))
    text = g[2_000_000:3_000_000]
    shapes = {"1000 x 1 kb": [text[i:i + 1000] for i in range(0, len(text), 1000)],
              "1 x 1 Mb": [text]}
    with tempfile.TemporaryDirectory(prefix="dnallm_bench_bpe_") as work:
        d = a.dir or os.path.join(work, "dnabert2-like")
        if not a.dir:
            write_dir(d, train(tk, g[:1_000_000], 4096, []))
        lib = tk.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        lib.no_truncation()  # a downloaded file may carry settings transformers does not apply
        lib.no_padding()
        print(f"bench/data bpe: {d}: tokenizers {tk.__version__} (one thread) vs {a.tool}; "
              f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
        for name, seqs in shapes.items():
            path = os.path.join(work, "seqs.txt")
            with open(path, "w") as f:
                f.write("".join(s + "\n" for s in seqs))
            bases = sum(map(len, seqs))
            best_ours = best_lib = float("inf")
            for _ in range(a.rounds):
                run = subprocess.run([a.tool, d, path, "--time"], capture_output=True, text=True,
                                     check=True)
                best_ours = min(best_ours, float(run.stderr.split()[1]))
                ours = run.stdout.split("\n")[:-1]
                lib.model._clear_cache()
                lib_ids = []
                t0 = time.perf_counter()
                for s in seqs:
                    lib_ids.append(lib.encode(s).ids)
                best_lib = min(best_lib, time.perf_counter() - t0)
            same = ours == [" ".join(map(str, x)) for x in lib_ids]
            tokens = sum(map(len, lib_ids))
            print(f"  {name}: {bases} bases -> {tokens} tokens; ids identical: {same}")
            print(f"    ours    {bases / best_ours / 1e6:8.2f} Mbases/s ({best_ours * 1e3:.1f} ms)")
            print(f"    library {bases / best_lib / 1e6:8.2f} Mbases/s ({best_lib * 1e3:.1f} ms)")
            print(f"    ratio ours / library: {best_lib / best_ours:.2f}")
            if not same:
                sys.exit("FAIL: the ids differ")


if __name__ == "__main__":
    main()
